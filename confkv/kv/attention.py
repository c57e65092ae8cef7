"""Attention over the block pool, plugged into unmodified Hugging Face models.

``register()`` adds a ``"confkv"`` entry to transformers' ``AttentionInterface`` (and a mask function under the
same name that returns ``None``, so the model builds no dense mask and this function owns masking). The runner
packs every scheduled token of every sequence into one row (``[1, tokens]``) and passes a ``PackedBatch`` as the
``confkv_batch`` keyword of the model's forward; transformers forwards it here. Each layer then:

1. writes the new keys (after RoPE) and values into their pool slots;
2. decode tokens: gathers each sequence's resident slots into a padded batch and computes attention explicitly,
   which yields for free the per-slot attention mass (block importance) and each head's log-sum-exp (what a
   recall needs to score host blocks against the current query);
3. prefill chunks: one SDPA call per chunk, causal by true positions; explicit only where the policy records
   prefill attention (H2O's accumulated attention, SnapKV's observation window).

Tokens keep their true positions, so evicting or recalling a block never needs re-rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from confkv.kv.pool import BlockPool

ATTN_IMPLEMENTATION = "confkv"


@dataclass
class PrefillSpan:
    """One sequence's chunk of consecutive tokens inside the packed row."""

    q_start: int
    q_len: int
    key_slots: torch.Tensor  # [keys] resident slots including the chunk's own
    key_pos: torch.Tensor  # [keys] their true positions
    q_pos: torch.Tensor  # [q_len]
    fresh: bool  # no earlier KV: plain causal attention over the chunk
    track: str = "none"  # "none" | "all" | "window": which queries' attention mass to record
    window_start: int = 0  # with track == "window": queries at positions >= this vote
    capture: bool = False  # keep the last query and its log-sum-exp (for recall scoring)


@dataclass
class PackedBatch:
    """Everything the attention function needs for one forward pass, built by the runner."""

    pool: BlockPool
    slot_mapping: torch.Tensor  # [tokens] pool slot of every packed token
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decode, max_keys], padded with a valid slot of the row
    decode_valid: torch.Tensor | None = None  # [num_decode, max_keys] bool
    decode_track: torch.Tensor | None = None  # [num_decode, 1] float: 1 where decode attention counts
    capture_decode: bool = False
    prefills: list[PrefillSpan] = field(default_factory=list)
    #: Filled per layer when capture is on: decode rows then capturing prefill spans, in that order.
    captured_q: list[torch.Tensor] = field(default_factory=list)  # [rows, kv_heads, groups, head_dim]
    captured_lse: list[torch.Tensor] = field(default_factory=list)  # [rows, kv_heads, groups]


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[..., heads, D]`` -> ``[..., kv_heads, groups, D]`` (GQA: consecutive query heads share a KV head)."""
    *lead, heads, dim = q.shape
    return q.reshape(*lead, num_kv_heads, heads // num_kv_heads, dim)


Captures = tuple[list[torch.Tensor], list[torch.Tensor]]


def _decode_attention(
    batch: PackedBatch, layer: int, q: torch.Tensor, scaling: float, captures: Captures
) -> torch.Tensor:
    """``q``: ``[num_decode, heads, D]`` -> output ``[num_decode, heads, D]``."""
    pool = batch.pool
    slots = batch.decode_slots
    keys = pool.k[layer][slots]  # [n, L, kvh, D]
    values = pool.v[layer][slots]
    if batch.decode_track is None and not batch.capture_decode:
        # nothing to record: one fused kernel, no explicit weights
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=batch.decode_valid[:, None, None, :],
            scale=scaling,
            enable_gqa=True,
        )
        return out.reshape(q.shape)
    qg = _grouped(q, pool.num_kv_heads)  # [n, kvh, g, D]
    scores = torch.einsum("nkgd,nlkd->nkgl", qg, keys).float() * scaling
    scores.masked_fill_(~batch.decode_valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = (scores - lse).exp()
    out = torch.einsum("nkgl,nlkd->nkgd", weights.to(values.dtype), values)
    if batch.decode_track is not None:
        mass = weights.sum(dim=(1, 2)) * batch.decode_track  # [n, L]
        pool.score.index_add_(0, slots.reshape(-1), mass.reshape(-1))
    if batch.capture_decode:
        captures[0].append(qg)
        captures[1].append(lse.squeeze(-1))
    return out.reshape(q.shape)


#: With ``track == "all"``, every this-many-th query of a prefill chunk votes (plus the chunk's last): an unbiased
#: sample of H2O's accumulated prefill attention at an eighth of the cost of the full attention matrix.
PREFILL_VOTE_STRIDE = 8


def _prefill_attention(
    batch: PackedBatch,
    layer: int,
    span: PrefillSpan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    captures: Captures,
) -> torch.Tensor:
    """``q``: ``[heads, n, D]``; ``k``/``v``: the chunk's own ``[kv_heads, n, D]``. Returns ``[n, heads, D]``.

    The output always comes from SDPA; attention mass (importance) and the captured last query are computed
    explicitly for the few query rows that need them.
    """
    pool = batch.pool
    if span.fresh:
        keys, values, key_slots, key_pos = k, v, span.key_slots, span.q_pos
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], is_causal=True, scale=scaling, enable_gqa=True
        )[0]
    else:
        keys = pool.k[layer][span.key_slots].transpose(0, 1)  # [kvh, L, D]
        values = pool.v[layer][span.key_slots].transpose(0, 1)
        key_slots, key_pos = span.key_slots, span.key_pos
        allowed = key_pos[None, :] <= span.q_pos[:, None]  # [n, L]
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=allowed, scale=scaling, enable_gqa=True
        )[0]
    if span.track == "all":
        voters = (span.q_pos % PREFILL_VOTE_STRIDE == PREFILL_VOTE_STRIDE - 1) | (span.q_pos == span.q_pos[-1])
    elif span.track == "window":
        voters = span.q_pos >= span.window_start
    else:
        voters = span.q_pos == span.q_pos[-1] if span.capture else None
    if voters is not None and bool(voters.any()):
        kvh = pool.num_kv_heads
        qv = q[:, voters]  # [heads, nv, D]
        qg = qv.reshape(kvh, qv.shape[0] // kvh, *qv.shape[1:])  # [kvh, g, nv, D]
        scores = torch.einsum("kgnd,kld->kgnl", qg, keys).float() * scaling
        scores.masked_fill_(key_pos[None, :] > span.q_pos[voters][:, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        if span.track != "none":
            weights = (scores - lse).exp()
            pool.score.index_add_(0, key_slots, weights.sum(dim=(0, 1, 2)))
        if span.capture:
            captures[0].append(qg[None, :, :, -1])
            captures[1].append(lse[None, :, :, -1, 0])
    return out.transpose(0, 1)


def confkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    confkv_batch: PackedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer; shapes ``[1, heads, tokens, D]``."""
    batch = confkv_batch
    if batch is None:
        raise RuntimeError("confkv attention was called without a packed batch; run the model through the engine")
    layer = module.layer_idx
    pool = batch.pool
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [tokens, heads, D]
    k = key[0].transpose(0, 1)  # [tokens, kvh, D]
    v = value[0].transpose(0, 1)
    pool.k[layer].index_copy_(0, batch.slot_mapping, k.to(pool.dtype))
    pool.v[layer].index_copy_(0, batch.slot_mapping, v.to(pool.dtype))

    out = torch.empty_like(q)
    captures: Captures = ([], [])
    if batch.num_decode:
        out[: batch.num_decode] = _decode_attention(batch, layer, q[: batch.num_decode], scaling, captures)
    for span in batch.prefills:
        sl = slice(span.q_start, span.q_start + span.q_len)
        out[sl] = _prefill_attention(
            batch, layer, span, q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), scaling, captures
        )
    if captures[0]:
        batch.captured_q.append(torch.cat(captures[0]))
        batch.captured_lse.append(torch.cat(captures[1]))
    return out[None], None


def _no_mask(*args: object, **kwargs: object) -> None:
    """The attention function masks by true positions itself; transformers need not build a dense mask."""
    return None


def register() -> str:
    """Make ``"confkv"`` a valid ``attn_implementation``; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, confkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
