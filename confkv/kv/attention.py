"""Attention over the block pool, plugged into unmodified Hugging Face models.

``register()`` adds a ``"confkv"`` entry to transformers' ``AttentionInterface`` (and a mask function under the
same name that returns ``None``, so the model builds no dense mask and this function owns masking). The runner
packs every scheduled token of every sequence into one row (``[1, tokens]``) and passes a ``PackedBatch`` as the
``confkv_batch`` keyword of the model's forward; transformers forwards it here. Each layer then:

1. writes the new keys (after RoPE) and values into their pool slots;
2. decode tokens: gathers each sequence's resident blocks (whole blocks, one contiguous copy each; the unfilled
   tail and the padding are masked) into a padded batch; one fused SDPA call when no attention mass is recorded
   (on CPU the same kernel also returns each head's log-sum-exp, what a recall needs to score host blocks against
   the current query), else explicit attention, which yields the per-slot attention mass (block importance);
3. prefill chunks: one SDPA call per chunk, causal by true positions; explicit only where the policy records
   prefill attention (H2O's accumulated attention, SnapKV's observation window).

Tokens keep their true positions, so evicting or recalling a block never needs re-rotation. Sliding-window layers
(Mistral, Qwen2 with ``use_sliding_window``) mask keys more than ``sliding_window`` positions back, by true position.
Attention mass is accumulated into the batch's own buffer and added to the pool by the runner only once the whole
forward pass has succeeded, so a failed step leaves block importance untouched.

``probe()`` runs one tiny forward pass when an engine loads a model and refuses, with one line naming it, anything
this function does not implement (soft-capping, attention sinks, a layer layout it cannot map to the pool).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from confkv.kv import folded, kernel
from confkv.kv.demoted import DemotedKeys, DemoteFormat
from confkv.kv.pool import BlockPool

ATTN_IMPLEMENTATION = "confkv"

#: Rows of a tensor that have float-window copies and the copies' rows in the window's arena (both on the device).
WindowPlan = tuple[torch.Tensor, torch.Tensor]


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
    #: The sequence's demoted blocks (``confkv/kv/demoted.py``) and their format, attended beside the pool's keys.
    demoted: tuple[DemoteFormat, DemotedKeys] | None = None
    #: Which of ``key_slots`` have float-window copies and the copies' rows (``FloatWindow.rows_of``).
    window: WindowPlan | None = None


@dataclass
class PackedBatch:
    """Everything the attention function needs for one forward pass, built by the runner."""

    pool: BlockPool
    slot_mapping: torch.Tensor  # [tokens] pool slot of every packed token
    num_decode: int = 0
    decode_blocks: torch.Tensor | None = None  # [num_decode, max_blocks] pool blocks, padded with a block of the row
    decode_slots: torch.Tensor | None = None  # [num_decode, max_blocks * block_size] slots (with decode_track)
    decode_valid: torch.Tensor | None = None  # [num_decode, max_blocks * block_size] bool: resident and computed
    decode_pos: torch.Tensor | None = None  # [num_decode, max_blocks * block_size] true positions of the keys
    decode_qpos: torch.Tensor | None = None  # [num_decode] the decode tokens' positions
    decode_track: torch.Tensor | None = None  # [num_decode, 1] float: 1 where decode attention counts
    capture_decode: bool = False
    prefills: list[PrefillSpan] = field(default_factory=list)
    #: Attention mass recorded by this pass, per pool slot; the runner adds it to ``pool.score`` on success.
    score: torch.Tensor | None = None
    #: Slots whose previously recorded mass this pass scales by ``decay_factors`` before adding its own: 0 for
    #: scorers that keep only the newest query's attention, between 0 and 1 for decayed accumulation.
    decay_slots: torch.Tensor | None = None
    decay_factors: torch.Tensor | None = None
    #: Set by ``probe``: what every layer call received, to check the model against what is implemented.
    probe: list[dict[str, Any]] | None = None
    #: Filled per layer when capture is on: decode rows then capturing prefill spans, in that order.
    captured_q: list[torch.Tensor] = field(default_factory=list)  # [rows, kv_heads, groups, head_dim]
    captured_lse: list[torch.Tensor] = field(default_factory=list)  # [rows, kv_heads, groups]
    #: Demoted blocks of the decode rows, grouped by format: (format, decode rows [g], keys and values
    #: ``[layers, g, width, kv_heads, row]``, zero-padded whole blocks, K and V rows each their own width); their keys
    #: follow the pool's in each row.
    decode_demoted: list[tuple[DemoteFormat, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    decode_demoted_valid: torch.Tensor | None = None  # [num_decode, width] bool
    decode_demoted_pos: torch.Tensor | None = None  # [num_decode, width] true positions
    #: Float window (``confkv/kv/window.py``): which packed tokens write copies, and which of the decode rows'
    #: gathered blocks (flattened ``[num_decode * max_blocks]``) read them; None where none does.
    window_store: WindowPlan | None = None
    decode_window: WindowPlan | None = None
    #: With ``decode_window``: each decode row's gathered block's arena block (``FloatWindow.index``), ``[num_decode,
    #: max_blocks]`` on the device, ``-1`` where its codes are read (what the C++ decode kernel takes).
    decode_arena: torch.Tensor | None = None


#: PyTorch's fused CPU attention (flash), called directly where its log-sum-exp is needed as well as its output.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

#: The SDPA kernels a forward pass may use on CUDA: cuDNN's is left out. cuDNN builds an execution graph for every new
#: shape, and a decode batch's key count changes as sequences grow. ``benchmarks/decode_step.py --allow-cudnn`` puts
#: it back, to compare both in one run; neither choice is measured yet (BENCHMARKS.md, "On a GPU").
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


#: Decode attention over an int8 or fp8 pool without a float window reads the codes with the scales folded in
#: (``confkv/kv/folded.py``) where it records nothing; False decodes every gathered row and runs SDPA (what the tests
#: compare it with).
FOLD_DECODE = True

#: Decode attention over an int8, fp8 or int4 pool, where it records no attention mass, runs the C++ kernel over the
#: codes (``confkv/kv/kernel.py``) on the CPU, reading a float32 float window's copies where a block has one and
#: returning the log-sum-exp a recall's capture keeps; False (or ``CONFKV_DECODE_KERNEL=0`` in the environment) keeps
#: the torch paths above, as does a kernel that could not be built.
DECODE_KERNEL = kernel.enabled_by_env()


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The kernels the attention function's SDPA calls may take during one forward pass on ``device``."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[..., heads, D]`` -> ``[..., kv_heads, groups, D]`` (GQA: consecutive query heads share a KV head)."""
    *lead, heads, dim = q.shape
    return q.reshape(*lead, num_kv_heads, heads // num_kv_heads, dim)


Captures = tuple[list[torch.Tensor], list[torch.Tensor]]


def _in_window(batch: PackedBatch, valid: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``valid`` less the keys a sliding-window layer of ``window`` tokens no longer sees from each decode query."""
    return valid if window is None else valid & (key_pos > batch.decode_qpos[:, None] - window)


def _decode_attention(
    batch: PackedBatch, layer: int, q: torch.Tensor, scaling: float, window: int | None, captures: Captures
) -> torch.Tensor:
    """``q``: ``[num_decode, heads, D]`` -> output ``[num_decode, heads, D]``."""
    pool = batch.pool
    plain = batch.decode_track is None and not batch.capture_decode and not batch.decode_demoted
    if DECODE_KERNEL and batch.decode_track is None and not batch.decode_demoted and kernel.supported(pool):
        # int8/fp8/int4, no attention mass to record: one fused pass over the codes, and over the float window's
        # copies where a block has one; a recall's query and log-sum-exp come out of the same pass (None if the
        # kernel could not be built)
        qg = _grouped(q, pool.num_kv_heads)
        valid = _in_window(batch, batch.decode_valid, batch.decode_pos, window)
        both = kernel.decode_attention_lse(pool, layer, batch.decode_blocks, qg, valid, scaling, batch.decode_arena)
        if both is not None:
            if batch.capture_decode:
                captures[0].append(qg)
                captures[1].append(both[1])
            return both[0].reshape(q.shape)
    if FOLD_DECODE and plain and batch.decode_window is None and pool.codec is not None and folded.supported(pool):
        # int8/fp8, nothing to record: attention straight over the codes, scales folded into scores and probabilities
        valid = _in_window(batch, batch.decode_valid, batch.decode_pos, window)
        out = folded.decode_attention(pool, layer, batch.decode_blocks, _grouped(q, pool.num_kv_heads), valid, scaling)
        return out.reshape(q.shape)
    n, bs = batch.decode_blocks.shape[0], pool.block_size
    flat = batch.decode_blocks.reshape(-1)
    # whole blocks, [n, kvh, keys, D]: one contiguous copy per block rather than one per token; the source is viewed
    # as 2-D because index_select copies rows of a 2-D tensor with memcpy but walks a 4-D one element by element
    by_block = (pool.num_blocks, bs * pool.num_kv_heads * pool.head_dim)
    unpacked = (n, -1, pool.num_kv_heads, pool.head_dim)
    if pool.codec is None:
        keys = pool.k[layer].view(by_block).index_select(0, flat).view(unpacked).transpose(1, 2)
        values = pool.v[layer].view(by_block).index_select(0, flat).view(unpacked).transpose(1, 2)
    else:  # the same block copies of the stored rows, then one dequantisation of what was gathered
        kvh, k_row, v_row = pool.num_kv_heads, pool.k_row, pool.v_row
        k_rows = pool.gather_blocks(pool.k[layer], flat).view(n, -1, bs, kvh, k_row)
        v_rows = pool.gather_blocks(pool.v[layer], flat).view(n, -1, kvh, v_row)
        keys, values = pool.dequant_k(k_rows), pool.dequant(v_rows)
        if batch.decode_window is not None:  # the newest tokens' exact rows instead of their codes, block by block
            blocks = (-1, bs, pool.num_kv_heads, pool.head_dim)
            pool.window.read_into(layer, batch.decode_window, keys.view(blocks), values.view(blocks))
        keys, values = keys.view(unpacked).transpose(1, 2), values.transpose(1, 2)
    valid, key_pos, pool_keys = batch.decode_valid, batch.decode_pos, keys.shape[2]
    if batch.decode_demoted:
        keys, values = _with_demoted(batch, layer, keys, values)
        valid = torch.cat([valid, batch.decode_demoted_valid], dim=1)
        key_pos = torch.cat([key_pos, batch.decode_demoted_pos], dim=1)
    valid = _in_window(batch, valid, key_pos, window)
    # GQA as plain attention: a KV head's query heads are the rows of one [groups, keys] problem
    qg = _grouped(q, pool.num_kv_heads)  # [n, kvh, g, D]
    if batch.decode_track is None and not batch.capture_decode:
        # nothing to record: one fused kernel, no explicit weights
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=valid[:, None, None, :], scale=scaling)
        return out.reshape(q.shape)
    if batch.decode_track is None and _FLASH_CPU is not None and q.device.type == "cpu":
        # a recall needs only the query and its log-sum-exp, which the fused CPU kernel returns beside the output
        # (the kernel F.scaled_dot_product_attention dispatches to; it takes an additive mask of the query's dtype)
        mask = torch.zeros(valid.shape, dtype=qg.dtype, device=q.device).masked_fill_(~valid, float("-inf"))
        out, lse = _FLASH_CPU(qg, keys, values, 0.0, False, attn_mask=mask[:, None, None, :], scale=scaling)
        captures[0].append(qg)
        captures[1].append(lse.float())
        return out.reshape(q.shape)
    scores = torch.matmul(qg, keys.contiguous().transpose(-1, -2)).float() * scaling  # [n, kvh, g, keys]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = (scores - lse).exp()
    out = torch.matmul(weights.to(values.dtype), values)
    if batch.decode_track is not None and batch.score is not None:
        mass = weights[..., :pool_keys].sum(dim=(1, 2)) * batch.decode_track  # [n, keys]: the pool's slots only
        batch.score.index_add_(0, batch.decode_slots.reshape(-1), mass.reshape(-1))
    if batch.capture_decode:
        captures[0].append(qg)
        captures[1].append(lse.squeeze(-1))
    return out.reshape(q.shape)


def _with_demoted(
    batch: PackedBatch, layer: int, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' keys and values ``[n, kvh, keys, D]`` followed by their demoted blocks', dequantised."""
    n, kvh, _, dim = keys.shape
    width = batch.decode_demoted_valid.shape[1]
    dk = keys.new_zeros(n, width, kvh, dim)
    dv = values.new_zeros(n, width, kvh, dim)
    for fmt, rows, k, v in batch.decode_demoted:
        dk[rows] = fmt.decode_k(k[layer], dk.dtype)
        dv[rows] = fmt.decode_v(v[layer], dv.dtype)
    return torch.cat([keys, dk.transpose(1, 2)], dim=2), torch.cat([values, dv.transpose(1, 2)], dim=2)


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
    window: int | None,
    captures: Captures,
) -> torch.Tensor:
    """``q``: ``[heads, n, D]``; ``k``/``v``: the chunk's own ``[kv_heads, n, D]``. Returns ``[n, heads, D]``.

    The output always comes from SDPA; attention mass (importance) and the captured last query are computed
    explicitly for the few query rows that need them.
    """
    pool = batch.pool
    if span.fresh:
        keys, values, key_slots, key_pos = k, v, span.key_slots, span.q_pos
    else:
        keys = pool.keys_at(layer, span.key_slots)  # [L, kvh, D]
        values = pool.dequant(pool.v[layer][span.key_slots])
        if span.window is not None:  # the newest tokens' exact rows instead of their codes
            pool.window.read_into(layer, span.window, keys, values)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kvh, L, D]
        key_slots, key_pos = span.key_slots, span.key_pos
        if span.demoted is not None:
            fmt, d = span.demoted
            keys = torch.cat([keys, fmt.decode_k(d.k[layer], keys.dtype).transpose(0, 1)], dim=1)
            values = torch.cat([values, fmt.decode_v(d.v[layer], values.dtype).transpose(0, 1)], dim=1)
            key_pos = torch.cat([key_pos, d.pos])

    def allowed(q_pos: torch.Tensor) -> torch.Tensor:  # [rows, L]
        ok = key_pos[None, :] <= q_pos[:, None]
        if window is not None:
            ok &= key_pos[None, :] > q_pos[:, None] - window
        return ok

    if span.fresh and (window is None or window >= span.q_len):
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], is_causal=True, scale=scaling, enable_gqa=True
        )[0]
    else:
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=allowed(span.q_pos), scale=scaling, enable_gqa=True
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
        scores.masked_fill_(~allowed(span.q_pos[voters]), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        if span.track != "none" and batch.score is not None:
            weights = (scores - lse).exp()[..., : key_slots.numel()]  # the pool's slots (demoted keys come after)
            batch.score.index_add_(0, key_slots, weights.sum(dim=(0, 1, 2)))
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
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer; shapes ``[1, heads, tokens, D]``."""
    batch = confkv_batch
    if batch is None:
        raise RuntimeError("confkv attention was called without a packed batch; run the model through the engine")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if batch.probe is not None:
        batch.probe.append(
            {
                "layer": getattr(module, "layer_idx", None),
                "scaling": float(scaling),
                "dropout": dropout,
                "key_shape": tuple(key.shape),
                "extra": {k: v for k, v in kwargs.items() if v is not None},
            }
        )
    layer = module.layer_idx
    pool = batch.pool
    q = query[0].transpose(0, 1)  # [tokens, heads, D]
    k = key[0].transpose(0, 1)  # [tokens, kvh, D]
    v = value[0].transpose(0, 1)
    pool.store(layer, batch.slot_mapping, k, v)
    if batch.window_store is not None:
        pool.window.write(layer, batch.window_store, k, v)

    out = torch.empty_like(q)
    captures: Captures = ([], [])
    window = sliding_window
    if batch.num_decode:
        out[: batch.num_decode] = _decode_attention(batch, layer, q[: batch.num_decode], scaling, window, captures)
    for span in batch.prefills:
        sl = slice(span.q_start, span.q_start + span.q_len)
        qs, ks, vs = q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)
        out[sl] = _prefill_attention(batch, layer, span, qs, ks, vs, scaling, window, captures)
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


#: Keyword arguments transformers passes that change nothing here (positions come from the packed batch).
_HARMLESS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "is_causal"})
#: What a keyword means when a model passes it and this function does not implement it.
_UNSUPPORTED = {"softcap": "attention logit soft-capping", "s_aux": "attention sinks", "sinks": "attention sinks"}


#: Layer types whose masks this function implements (by true positions); others (Llama 4's chunked attention)
#: exist only in the dense mask transformers would build, which confkv does not use.
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def config_refusal(config: Any) -> str | None:
    """What in a model config the packed, chunked batch cannot reproduce, though no attention argument shows it."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    entries = [rope]
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        entries = list(rope.values())  # one entry per attention layer type
    for r in entries:
        kind = str((r or {}).get("rope_type") or (r or {}).get("type") or "") if isinstance(r, dict) else ""
        if "dynamic" in kind or kind == "longrope":
            return (f"RoPE scaling {kind!r}: its frequencies follow the longest position in a forward pass, which "
                    "the other sequences of a batch and the chunking of a prompt change")  # fmt: skip
    bad = sorted(set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES)
    if bad:
        return f"attention layer types {bad} (only {sorted(_LAYER_TYPES)} are implemented)"
    if getattr(config, "attn_temperature_tuning", False):
        return "attention temperature tuning (computed from a token's index in the batch, not its position)"
    return None


def probe(model: torch.nn.Module, pool: BlockPool, vocab_size: int) -> float:
    """Run two tokens through the model with one borrowed block and check every attention call against what
    ``confkv_attention`` implements; raise ``UnsupportedModelError`` naming the first thing it does not. Returns
    the layers' attention scaling (what recall scoring needs).

    Checking the calls themselves (rather than a list of model types) also covers models loaded from any local
    folder: a layer that passes soft-capping or sinks, has no ``layer_idx``, or whose keys do not have the pool's
    shape is refused before it can produce silently wrong text.
    """
    from confkv.errors import UnsupportedModelError

    if (refused := config_refusal(getattr(model, "config", None))) is not None:
        raise UnsupportedModelError(f"{refused} is not implemented by confkv's attention")
    block = pool.allocate(1)
    try:
        slots = pool.slots_of(block)[:2]
        batch = PackedBatch(pool=pool, slot_mapping=slots, probe=[])
        batch.prefills.append(
            PrefillSpan(
                q_start=0,
                q_len=2,
                key_slots=slots,
                key_pos=torch.arange(2, device=pool.device),
                q_pos=torch.arange(2, device=pool.device),
                fresh=True,
            )
        )
        ids = torch.tensor([[min(1, vocab_size - 1), min(2, vocab_size - 1)]], device=pool.device)
        with torch.inference_mode():
            try:
                model(input_ids=ids, position_ids=torch.arange(2, device=pool.device)[None], use_cache=False,
                      logits_to_keep=1, confkv_batch=batch)  # fmt: skip
            except (AttributeError, TypeError, IndexError, RuntimeError) as err:
                raise UnsupportedModelError(
                    f"the model's attention layers cannot run on the confkv KV pool ({type(err).__name__}: {err})"
                ) from None
    finally:
        pool.free(block)
    calls = batch.probe or []
    layers = [c["layer"] for c in calls]
    if sorted(x for x in layers if x is not None) != list(range(pool.num_layers)) or None in layers:
        raise UnsupportedModelError(
            f"non-standard layer layout: attention calls came from layers {layers}, expected each of "
            f"0..{pool.num_layers - 1} once"
        )
    for c in calls:
        for name, value in c["extra"].items():
            if name in _HARMLESS or name == "confkv_batch":
                continue
            what = _UNSUPPORTED.get(name, f"the attention argument {name!r}")
            raise UnsupportedModelError(f"{what} ({name}={_short(value)}) is not implemented by confkv's attention")
        if c["key_shape"][1:2] != (pool.num_kv_heads,) or c["key_shape"][-1] != pool.head_dim:
            raise UnsupportedModelError(
                f"layer {c['layer']} has keys shaped {c['key_shape']}, not [1, {pool.num_kv_heads}, tokens, "
                f"{pool.head_dim}] as the config says"
            )
    scalings = {round(c["scaling"], 9) for c in calls}
    if len(scalings) != 1:
        raise UnsupportedModelError(f"layers use different attention scalings {sorted(scalings)}")
    return calls[0]["scaling"]


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return repr(value)[:40]
