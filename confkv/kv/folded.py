"""Decode attention straight over a quantised pool's codes, the scales folded into the attention math.

The eager path decodes every gathered code to a float (``scale * code (+ zero point)``, a chain of elementwise passes
over the whole gathered tensor) and hands the floats to SDPA. But a key's scale is constant along what a score sums
over, so ``q . (s * c) = s * (q . c)``: the scales can multiply the scores instead of the keys, and a value's scale
the attention probabilities instead of the values (``sum_t p_t s_t c_t = sum_t (p_t s_t) c_t``). Zero points fold
the same way, into one extra term per score (keys) or per output (values). What is left per element is the
conversion of the codes themselves to floats, written straight into the layout the matrix products read:

* int8, fp8: one scale per token and KV head; scores ``(q @ C^T) * s``, output ``(p * s) @ C``.
* int4 values: a scale and zero point per token and group of 32 channels; per group ``(p * s_g) @ C_g + p @ m_g``.
* int4 keys (per channel within a block): per block, the query scaled per channel ``(q * s_b) @ C_b^T + q . m_b``.

The float window's rows (``confkv/kv/window.py``) are attended as extra keys beside the codes, their blocks' codes
masked, rather than written over decoded rows: nothing is decoded only to be overwritten.

This computes the same attention as dequantise-then-SDPA, in a different order of float32 operations: within
float32 rounding of it, not bit for bit. Only quantised pools take it; ``auto`` keeps SDPA.
"""

from __future__ import annotations

import torch

from confkv.kv.pool import BlockPool
from confkv.kv.quant import ChannelKeyCodec, Fp8Codec, GroupedInt4Codec, Int8Codec

#: Rows of the gathered blocks (flattened ``[n * max_blocks]``) with float-window copies, and the copies' arena blocks.
WindowBlocks = tuple[torch.Tensor, torch.Tensor]


def supported(pool: BlockPool) -> bool:
    """Whether this pool's formats have a folded form (every quantised ``kv_cache_dtype`` does)."""
    k, v = pool.fmt.k_codec, pool.fmt.v_codec
    per_token = (Int8Codec, Fp8Codec)
    return (isinstance(k, per_token) and type(k) is type(v)) or (
        isinstance(k, ChannelKeyCodec) and isinstance(v, GroupedInt4Codec)
    )


def _f16(rows: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 in bytes ``at, at + 1`` of each row ``[..., row]`` -> ``[...]`` float32."""
    return rows[..., at : at + 2].contiguous().view(torch.float16).float().squeeze(-1)


def _int16(codes: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Bytes read as int8, widened to int16 and laid out in ``order`` (one pass)."""
    return codes.view(torch.int8).permute(order).to(torch.int16, memory_format=torch.contiguous_format)


def _per_token_codes(codes: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Data bytes ``[n, L, kvh, D]`` -> codes as float32 ``[n, kvh, L, D]`` (fp8: the value times 2^-8, as
    ``Fp8Codec``'s CPU decode reads the e4m3 bits into float16's place)."""
    order = (0, 2, 1, 3)
    if not fp8:
        return codes.view(torch.int8).permute(order).to(torch.float32, memory_format=torch.contiguous_format)
    b = _int16(codes, order)
    b <<= 7
    return b.bitwise_and_(-0x4080).view(torch.float16).float()


def _nibble_codes(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Bytes of two 4-bit codes (low nibble first), laid out in ``order``, -> the codes as float32, twice as long
    (each byte widened to 16 bits and its high nibble moved to the second byte, as ``quant._nibbles`` does)."""
    w = packed.permute(order).to(torch.int16, memory_format=torch.contiguous_format)
    w = w.bitwise_or_(w << 4).bitwise_and_(0x0F0F)
    return w.view(torch.uint8).float()


def _key_scores(pool: BlockPool, k_rows: torch.Tensor, qg: torch.Tensor, n: int) -> torch.Tensor:
    """Unscaled scores ``q . k`` ``[n, kvh, g, L]`` over gathered key rows ``[n, L, kvh, row]``."""
    d, codec = pool.head_dim, pool.fmt.k_codec
    if not isinstance(codec, ChannelKeyCodec):
        c = _per_token_codes(k_rows[..., :d], isinstance(codec, Fp8Codec))  # [n, kvh, L, D]
        s = _f16(k_rows, d).transpose(1, 2)  # [n, kvh, L]
        if isinstance(codec, Fp8Codec):
            s = s * 256.0
        return torch.matmul(qg, c.transpose(-1, -2)).mul_(s[:, :, None, :])
    bs, kvh = pool.block_size, pool.num_kv_heads
    blocks = k_rows.view(n, -1, bs, kvh, k_rows.shape[-1])  # [n, nb, bs, kvh, row]
    c = _nibble_codes(blocks[..., : d // 2], (0, 3, 1, 2, 4))  # [n, kvh, nb, bs, D]
    grid = blocks[..., d // 2 :].permute(0, 3, 1, 2, 4).contiguous()  # [n, kvh, nb, bs, 4D / bs]
    grid = grid.view(n, kvh, -1, 4 * d).view(torch.float16).float()  # [n, kvh, nb, 2D]: scales, zero points
    scaled_q = qg[:, :, None] * grid[:, :, :, None, :d]  # [n, kvh, nb, g, D]
    main = torch.matmul(scaled_q, c.transpose(-1, -2))  # [n, kvh, nb, g, bs]
    zero = torch.matmul(qg[:, :, None], grid[..., d:, None])  # [n, kvh, nb, g, 1]
    return (main + zero).permute(0, 1, 3, 2, 4).reshape(n, kvh, qg.shape[2], -1)


def _weighted_values(pool: BlockPool, v_rows: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``p @ V`` ``[n, kvh, g, D]`` for probabilities ``p`` ``[n, kvh, g, L]`` over gathered value rows
    ``[n, L, kvh, row]``."""
    d, codec = pool.head_dim, pool.fmt.v_codec
    if not isinstance(codec, GroupedInt4Codec):
        c = _per_token_codes(v_rows[..., :d], isinstance(codec, Fp8Codec))
        s = _f16(v_rows, d).transpose(1, 2)
        if isinstance(codec, Fp8Codec):
            s = s * 256.0
        return torch.matmul(p * s[:, :, None, :], c)
    n, length, kvh, _ = v_rows.shape
    g = min(GroupedInt4Codec.GROUP, d)
    groups = v_rows.view(n, length, kvh, d // g, g // 2 + 4)
    c = _nibble_codes(groups[..., : g // 2], (0, 2, 3, 1, 4))  # [n, kvh, G, L, g]
    s = _f16(groups, g // 2).permute(0, 2, 3, 1)  # [n, kvh, G, L]
    m = _f16(groups, g // 2 + 2).permute(0, 2, 1, 3)  # [n, kvh, L, G]
    main = torch.matmul(p[:, :, None] * s[:, :, :, None, :], c)  # [n, kvh, G, g_q, g]
    zero = torch.matmul(p, m)  # [n, kvh, g_q, G]
    out = main.permute(0, 1, 3, 2, 4) + zero[..., None]
    return out.reshape(n, kvh, p.shape[2], d)


def decode_attention(
    pool: BlockPool,
    layer: int,
    blocks: torch.Tensor,
    qg: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    window: WindowBlocks | None,
) -> torch.Tensor:
    """Attention of decode queries ``qg`` ``[n, kvh, g, D]`` over the rows' ``blocks`` ``[n, max_blocks]`` of
    ``layer``, keys ``valid`` ``[n, max_blocks * block_size]``; with ``window``, the float window's rows of those
    blocks read instead of their codes. Returns ``[n, kvh, g, D]`` in ``qg``'s dtype."""
    n, mb = blocks.shape
    bs, kvh = pool.block_size, pool.num_kv_heads
    flat = blocks.reshape(-1)
    k_rows = pool.gather_blocks(pool.k[layer], flat).view(n, -1, kvh, pool.k_row)
    v_rows = pool.gather_blocks(pool.v[layer], flat).view(n, -1, kvh, pool.v_row)
    q = qg.float()
    scores = _key_scores(pool, k_rows, q, n).mul_(scaling)  # [n, kvh, g, L]
    if window is None:
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        return _weighted_values(pool, v_rows, p).to(qg.dtype)
    hit, arena = window
    by_block = valid.view(n * mb, bs)
    exact_valid = by_block[hit]  # [h, bs]: which of the copies' rows hold tokens
    code_valid = by_block.clone()
    code_valid[hit] = False  # those blocks are read from their copies
    owner = (hit // mb).repeat_interleave(bs)  # [h * bs]: the decode row each copy's row belongs to
    exact_valid = exact_valid.reshape(-1)[None, :] & (owner[None, :] == torch.arange(n, device=owner.device)[:, None])
    wk = pool.window.k[layer].view(-1, bs * kvh * pool.head_dim)[arena].view(-1, kvh, pool.head_dim)
    wv = pool.window.v[layer].view(-1, bs * kvh * pool.head_dim)[arena].view(-1, kvh, pool.head_dim)
    wk, wv = wk.transpose(0, 1).float(), wv.transpose(0, 1).float()  # [kvh, h * bs, D]
    exact = torch.matmul(q, wk.transpose(-1, -2)).mul_(scaling)  # [n, kvh, g, h * bs]
    scores.masked_fill_(~code_valid.view(n, -1)[:, None, None, :], float("-inf"))
    exact.masked_fill_(~exact_valid[:, None, None, :], float("-inf"))
    p = torch.softmax(torch.cat([scores, exact], dim=-1), dim=-1)
    length = scores.shape[-1]
    out = _weighted_values(pool, v_rows, p[..., :length]) + torch.matmul(p[..., length:], wv)
    return out.to(qg.dtype)
