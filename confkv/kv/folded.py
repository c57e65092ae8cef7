"""Decode attention straight over an int8 or fp8 pool's codes, the scales folded into the attention math.

The eager path decodes every gathered code to a float (``scale * code``) and hands the floats to SDPA. But a key's
scale is constant along what a score sums over, so ``q . (s * c) = s * (q . c)``: the scales can multiply the scores
instead of the keys, and a value's scale the attention probabilities instead of the values (``sum_t p_t s_t c_t =
sum_t (p_t s_t) c_t``). What is left per element is the conversion of the codes themselves to floats, written
straight into the layout the matrix products read: scores ``(q @ C^T) * s``, output ``(p * s) @ C``.

fp8 keys are their block's mean plus a scaled code (``Fp8KeyCodec``): ``q . (mean + s * c) = q . mean + s * (q . c)``,
so each block adds one term per query to its scores, computed once from the block's (e4m3) means.

This computes the same attention as dequantise-then-SDPA in a different order of float32 operations: within float32
rounding of it, not bit for bit. Only int8 and fp8 pools on the CPU without a float window take it. Measured on
the 2-core AMD EPYC (docs/kv-dtypes.md, "Decode step, fourth round"), the same fold for int4 (zero points as one
extra term per score and output, per-channel key scales folded into the query block by block) and the float window
read as extra exact keys were slower than decoding and SDPA, so those keep the eager path.
"""

from __future__ import annotations

import torch

from confkv.kv.block_keys import Fp8KeyCodec
from confkv.kv.pool import BlockPool
from confkv.kv.quant import Fp8Codec, Int8Codec, e4m3_as_half, from_f16


def supported(pool: BlockPool) -> bool:
    """Whether this pool takes the folded path: int8 and fp8 (one scale per token and KV head) on the CPU, where it
    was measured; on a GPU the fused SDPA kernel over decoded rows is kept (not measured against this)."""
    k, v = pool.fmt.k_codec, pool.fmt.v_codec
    int8 = isinstance(k, Int8Codec) and isinstance(v, Int8Codec)
    return pool.device.type == "cpu" and (int8 or (isinstance(k, Fp8KeyCodec) and isinstance(v, Fp8Codec)))


def _codes(rows: torch.Tensor, d: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered rows ``[n, L, kvh, d + 2 (+ fp8 keys' share of means)]`` -> codes as float32 ``[n, kvh, L, d]`` (one
    conversion pass, straight into that layout) and their scales ``[n, kvh, L]``. fp8's codes are its CPU decode's
    float16 reading of the e4m3 bits (the value times 2^-8, ``Fp8Codec.decode``), so its scales carry the 2^8."""
    data = rows[..., :d].view(torch.int8).permute(0, 2, 1, 3)
    scale = from_f16(rows[..., d : d + 2]).squeeze(-1).transpose(1, 2)
    if not fp8:
        return data.to(torch.float32, memory_format=torch.contiguous_format), scale
    return e4m3_as_half(data).float(), scale * 256.0


def decode_attention(
    pool: BlockPool, layer: int, blocks: torch.Tensor, qg: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of decode queries ``qg`` ``[n, kvh, g, D]`` over the rows' ``blocks`` ``[n, max_blocks]`` of
    ``layer``, keys ``valid`` ``[n, max_blocks * block_size]``. Returns ``[n, kvh, g, D]`` in ``qg``'s dtype."""
    n, d, kvh = blocks.shape[0], pool.head_dim, pool.num_kv_heads
    fp8 = isinstance(pool.fmt.v_codec, Fp8Codec)
    flat = blocks.reshape(-1)
    k_rows = pool.gather_blocks(pool.k[layer], flat).view(n, -1, kvh, pool.k_row)
    k_codes, k_scale = _codes(k_rows, d, fp8)
    v_codes, v_scale = _codes(pool.gather_blocks(pool.v[layer], flat).view(n, -1, kvh, pool.v_row), d, fp8)
    q = qg.float()
    scores = torch.matmul(q, k_codes.transpose(-1, -2)).mul_((k_scale * scaling)[:, :, None, :])
    if fp8:  # each block's q . mean, on every one of its slots
        bs = pool.block_size
        means = pool.fmt.k_codec.block_means(k_rows.view(n, -1, bs, kvh, pool.k_row))  # [n, blocks, kvh, D]
        bias = torch.matmul(q, means.permute(0, 2, 3, 1)).mul_(scaling)  # [n, kvh, g, blocks]
        scores.view(*bias.shape, bs).add_(bias.unsqueeze(-1))
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).mul_(v_scale[:, :, None, :])
    return torch.matmul(p, v_codes).to(qg.dtype)
