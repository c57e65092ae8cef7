"""A session's complete state as one versioned, checksummed, compressed object, and its binary encoding.

A ``SessionRecord`` is everything needed to continue a conversation without re-reading it: the token ids, how many
of them have KV, the KV blocks the cache policy kept (from every tier: device and host blocks alike; a block that is
absent was dropped for good and is recomputed or simply not attended to, as the policy decided), the controller's
state and the policy that produced them. Records are for one model, one block geometry and one KV dtype; ``decode``
refuses any other (``ForeignRecord``) instead of restoring keys that would silently be wrong.

Encoding (format version 1)::

    magic      8 bytes   b"\\x89CKVREC\\n" (a record) or b"\\x89CKVTOK\\n" (a tokens-only object); the high byte and
                         the newline catch 7-bit and text-mode transfers, as PNG's signature does
    length     4 bytes   little-endian uint32: N, the header's length
    header     N bytes   UTF-8 JSON (sorted keys): format_version, kind, every scalar field, the controller, policy and
                         meta dicts, block_indices (ascending), tensors {name: {dtype, shape}}, codec, codec_level,
                         raw_bytes, payload_bytes, payload_sha256
    digest    32 bytes   sha256 of the header bytes, so a flipped digit in ``num_computed`` is caught too
    payload    the rest  zstd frame of a safetensors blob (``safetensors.torch.save``) holding
                         ``token_ids`` int64 [T], and when blocks exist ``k``/``v`` [n_blocks, layers, block_size,
                         kv_heads, head_dim] in the record's dtype (a packed record: uint8 [..., kv_heads, row bytes],
                         the quantised rows as the pool holds them) and ``score`` float32 [n_blocks, block_size]

The header is checked first (digest, then version, then ``expect``), so a foreign record is refused without
decompressing its payload; the payload's sha256 is checked before zstd touches it, so the decompressor only ever
sees authentic bytes. The tokens-only object (same framing, no ``k``/``v``/``score``) is what the store writes
first: it is small, and it is all that recomputation needs if the full record never lands.

Codec: zstd (``zstandard``) at level 3; levels 1 and 9 compress about as well. Float KV compresses little: its
mantissas are close to random, and what compresses is the sign and exponent bits (a larger share of each bfloat16
value, hence its higher ratio) and the token ids. ``benchmarks/session_codec.py`` measures the ratio and the encode
and decode times on a model's real KV (BENCHMARKS.md, "Sessions").
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from confkv.kv.kv_format import RECORD_DTYPES
from confkv.sessions.errors import CorruptRecord, ForeignRecord

FORMAT_VERSION = 1
CODEC = "zstd"
DEFAULT_LEVEL = 3
RECORD_MAGIC = b"\x89CKVREC\n"
TOKENS_MAGIC = b"\x89CKVTOK\n"
#: the keys ``decode(..., expect=...)`` checks; anything else in ``expect`` is a caller bug (ValueError).
EXPECT_KEYS: tuple[str, ...] = ("model_fingerprint", "block_size", "dtype")

_LEN = struct.Struct("<I")
_DIGEST = 32
_PREFIX = len(RECORD_MAGIC) + _LEN.size
#: a header is small JSON; a length field claiming more than this is garbage, not a reason to allocate.
_MAX_HEADER = 64 << 20


@dataclass
class BlockKV:
    """One logical block's KV as it leaves (or re-enters) the cache: keys after RoPE, values, attention mass."""

    k: torch.Tensor  # [layers, block_size, kv_heads, head_dim]
    v: torch.Tensor  # same shape and dtype as k
    score: torch.Tensor  # [block_size] float32: the attention mass each token had received (eviction importance)


@dataclass
class SessionRecord:
    """A session's complete state. ``blocks`` maps logical block index -> KV; missing indices were dropped for good."""

    session_id: str
    model_fingerprint: str
    block_size: int
    dtype: str  # the KV dtype: "float32", "bfloat16", "float16" (torch's spelling) or a packed one, "kv-int8"...
    token_ids: list[int]  # the whole conversation so far
    num_computed: int  # tokens whose KV was computed (the first num_computed of token_ids)
    blocks: dict[int, BlockKV] = field(default_factory=dict)
    controller: dict[str, Any] = field(default_factory=dict)  # JSON-able controller state (budget, steps, ...)
    policy: dict[str, Any] = field(default_factory=dict)  # the cache policy, as JSON
    policy_version: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V held (what the record costs before compression, scores and tokens aside)."""
        return sum(b.k.nbytes + b.v.nbytes for b in self.blocks.values())


@dataclass
class SessionTokens:
    """The tokens-only object: what recomputation needs when the full record is missing, corrupt or unreachable."""

    session_id: str
    model_fingerprint: str
    block_size: int
    dtype: str
    token_ids: list[int]
    updated_at: float


#: Record dtypes of quantised pools (``kv_cache_dtype`` int8, fp8, int4): the blocks are the pool's packed rows, bytes
#: of data and per-row scales (``confkv/kv/quant.py``), kept as ``uint8`` tensors. Each is foreign to the others and
#: to a float pool, as one float dtype is to another.
PACKED_DTYPES: dict[str, str] = {name: "uint8" for name in RECORD_DTYPES.values()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` or ``"bfloat16"`` -> ``"bfloat16"`` (the record's spelling); a
    packed dtype (``"kv-int8"``) is its own spelling."""
    if isinstance(dtype, str) and dtype in PACKED_DTYPES:
        return dtype
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return name


# ---------------------------------------------------------------------------------------------------- encoding


def encode(record: SessionRecord, *, level: int = DEFAULT_LEVEL) -> bytes:
    """The record as bytes (see the module docstring). Raises ``ValueError`` for an inconsistent record: a bug in
    the caller, never a store fault. CPU cost is about one zstd pass over the KV: call it off the engine thread."""
    _check_record(record)
    indices = sorted(record.blocks)
    tensors: dict[str, torch.Tensor] = {"token_ids": torch.tensor(record.token_ids, dtype=torch.int64)}
    if indices:
        # Stack on the tensors' own device, then one transfer: a GPU record costs one copy, not one per block.
        tensors["k"] = torch.stack([record.blocks[i].k.detach() for i in indices]).cpu().contiguous()
        tensors["v"] = torch.stack([record.blocks[i].v.detach() for i in indices]).cpu().contiguous()
        tensors["score"] = torch.stack([record.blocks[i].score.detach() for i in indices]).cpu().contiguous()
    header = _scalars(record, kind="record")
    header.update(
        controller=record.controller,
        policy=record.policy,
        meta=record.meta,
        block_indices=indices,
        created_at=float(record.created_at),
    )
    return _frame(RECORD_MAGIC, header, tensors, level)


def encode_tokens(record: SessionRecord, *, level: int = DEFAULT_LEVEL) -> bytes:
    """The tokens-only object of ``record``: a few KiB, written before the full record (see ``SessionStore.put``)."""
    _check_ids(record)
    tensors = {"token_ids": torch.tensor(record.token_ids, dtype=torch.int64)}
    return _frame(TOKENS_MAGIC, _scalars(record, kind="tokens"), tensors, level)


def _scalars(record: SessionRecord, *, kind: str) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "session_id": record.session_id,
        "model_fingerprint": record.model_fingerprint,
        "block_size": int(record.block_size),
        "dtype": dtype_name(record.dtype),
        "num_tokens": len(record.token_ids),
        "num_computed": int(record.num_computed),
        "policy_version": record.policy_version,
        "updated_at": float(record.updated_at),
    }


def _frame(magic: bytes, header: dict[str, Any], tensors: dict[str, torch.Tensor], level: int) -> bytes:
    raw = st_save(tensors)
    payload = zstandard.ZstdCompressor(level=level).compress(raw)  # writes the content size into the frame
    header.update(
        tensors={name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for name, t in tensors.items()},
        codec=CODEC,
        codec_level=level,
        raw_bytes=len(raw),
        payload_bytes=len(payload),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
    )
    try:
        hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"session {header['session_id']!r}: controller, policy or meta is not JSON-able: {err}"
        ) from err
    return b"".join((magic, _LEN.pack(len(hb)), hb, hashlib.sha256(hb).digest(), payload))


def tensor_dtype_name(record_dtype: str) -> str:
    """The dtype of a record's block tensors: its own for a float record, ``uint8`` for a packed one."""
    return PACKED_DTYPES.get(record_dtype, record_dtype)


def _check_ids(record: SessionRecord) -> None:
    if not isinstance(record.session_id, str) or not record.session_id:
        raise ValueError("a session record needs a non-empty session_id")
    if not isinstance(record.block_size, int) or record.block_size < 1:
        raise ValueError(f"session {record.session_id!r}: block_size must be a positive int, got {record.block_size!r}")
    if not 0 <= record.num_computed <= len(record.token_ids):
        raise ValueError(
            f"session {record.session_id!r}: num_computed {record.num_computed} is outside 0..{len(record.token_ids)}"
        )
    dtype_name(record.dtype)


def _check_record(record: SessionRecord) -> None:
    """Every block has the same geometry, the record's dtype, and holds computed tokens only."""
    _check_ids(record)
    sid, bs, want = record.session_id, record.block_size, tensor_dtype_name(dtype_name(record.dtype))
    n_blocks = -(-record.num_computed // bs)
    shape: tuple[torch.Size, torch.Size] | None = None
    for idx, blk in record.blocks.items():
        if not isinstance(idx, int) or not 0 <= idx < n_blocks:
            raise ValueError(f"session {sid!r}: block {idx!r} is outside the {n_blocks} blocks of computed tokens")
        if blk.k.dim() != 4 or blk.k.shape[1] != bs:
            raise ValueError(f"session {sid!r}: block {idx} k is {tuple(blk.k.shape)}, want [layers, {bs}, heads, dim]")
        # a packed record's key and value rows may differ in width (int4: keys per channel, values per token)
        if blk.v.shape[:-1] != blk.k.shape[:-1] or (shape is not None and (blk.k.shape, blk.v.shape) != shape):
            raise ValueError(f"session {sid!r}: block {idx} k/v shapes differ from the others")
        shape = (blk.k.shape, blk.v.shape)
        if dtype_name(blk.k.dtype) != want or dtype_name(blk.v.dtype) != want:
            raise ValueError(f"session {sid!r}: block {idx} is {blk.k.dtype}/{blk.v.dtype}, the record says {want}")
        if blk.score.shape != (bs,) or blk.score.dtype != torch.float32:
            raise ValueError(f"session {sid!r}: block {idx} score must be float32 [{bs}]")


# ---------------------------------------------------------------------------------------------------- decoding


def read_header(data: bytes | memoryview, *, magic: bytes = RECORD_MAGIC) -> dict[str, Any]:
    """The verified header alone (no payload work): for inspection, listings, and the checks ``decode`` runs first.

    Raises ``CorruptRecord`` (not this kind of object, truncated, header checksum, not JSON) or ``ForeignRecord``
    (another format version).
    """
    header, _ = _unframe(memoryview(data), magic)
    return header


def decode(data: bytes | memoryview, *, expect: Mapping[str, Any] | None = None) -> SessionRecord:
    """Bytes -> ``SessionRecord``, refusing anything that is not exactly what ``expect`` describes.

    ``expect`` may name ``model_fingerprint``, ``block_size`` and ``dtype`` (a ``torch.dtype`` or its name); each one
    given must match or ``ForeignRecord`` is raised. ``None`` checks nothing beyond integrity (tools, tests).
    Block tensors come back as views into one stacked tensor per kind, bit-identical to what was encoded.
    """
    view = memoryview(data)
    header, payload = _unframe(view, RECORD_MAGIC)
    sid = header.get("session_id")
    _check_expect(header, expect, sid)
    tensors = _payload(header, payload, sid)
    try:
        indices = [int(i) for i in header["block_indices"]]
        blocks: dict[int, BlockKV] = {}
        if indices:
            k, v, score = tensors["k"], tensors["v"], tensors["score"]
            bs = int(header["block_size"])
            if (
                not (len(indices) == k.shape[0] == v.shape[0] == score.shape[0])
                or k.shape[2] != bs
                or dtype_name(k.dtype) != tensor_dtype_name(header["dtype"])
            ):
                raise CorruptRecord(f"session {sid!r}: block tensors do not match the header", session_id=sid)
            blocks = {i: BlockKV(k=k[n], v=v[n], score=score[n]) for n, i in enumerate(indices)}
            if len(blocks) != len(indices):
                raise CorruptRecord(f"session {sid!r}: a block index is repeated", session_id=sid)
        record = SessionRecord(
            session_id=str(sid),
            model_fingerprint=str(header["model_fingerprint"]),
            block_size=int(header["block_size"]),
            dtype=str(header["dtype"]),
            token_ids=tensors["token_ids"].tolist(),
            num_computed=int(header["num_computed"]),
            blocks=blocks,
            controller=dict(header["controller"]),
            policy=dict(header["policy"]),
            policy_version=header["policy_version"],
            created_at=float(header["created_at"]),
            updated_at=float(header["updated_at"]),
            meta=dict(header["meta"]),
        )
        _check_record(record)  # what encode refuses is refused here too: the engine trusts the geometry
        return record
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise CorruptRecord(f"session {sid!r}: undecodable record ({err!r})", session_id=sid) from err


def decode_tokens(data: bytes | memoryview, *, expect: Mapping[str, Any] | None = None) -> SessionTokens:
    """Bytes of a tokens-only object -> ``SessionTokens``; the same checks and errors as ``decode``."""
    header, payload = _unframe(memoryview(data), TOKENS_MAGIC)
    sid = header.get("session_id")
    _check_expect(header, expect, sid)
    tensors = _payload(header, payload, sid)
    try:
        return SessionTokens(
            session_id=str(sid),
            model_fingerprint=str(header["model_fingerprint"]),
            block_size=int(header["block_size"]),
            dtype=str(header["dtype"]),
            token_ids=tensors["token_ids"].tolist(),
            updated_at=float(header["updated_at"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptRecord(f"session {sid!r}: undecodable tokens object ({err!r})", session_id=sid) from err


def _unframe(view: memoryview, magic: bytes) -> tuple[dict[str, Any], memoryview]:
    if len(view) < _PREFIX:
        raise CorruptRecord(f"truncated: {len(view)} bytes is shorter than the frame prefix")
    got = bytes(view[: len(magic)])
    if got != magic:
        what = {RECORD_MAGIC: "a full record", TOKENS_MAGIC: "a tokens-only object"}.get(got, "not a session record")
        raise CorruptRecord(f"wrong object: {what} where {'a record' if magic == RECORD_MAGIC else 'tokens'} was due")
    (hlen,) = _LEN.unpack_from(view, len(magic))
    end = _PREFIX + hlen
    if hlen > _MAX_HEADER or end + _DIGEST > len(view):
        raise CorruptRecord(f"truncated: a {hlen}-byte header does not fit in {len(view)} bytes")
    hb = view[_PREFIX:end]
    if hashlib.sha256(hb).digest() != view[end : end + _DIGEST]:
        raise CorruptRecord("header checksum mismatch")
    try:
        header = json.loads(bytes(hb))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CorruptRecord(f"header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise CorruptRecord("header is not a JSON object")
    sid = header.get("session_id")
    if header.get("format_version") != FORMAT_VERSION:
        raise ForeignRecord(
            f"session {sid!r}: format version {header.get('format_version')!r}, this build reads {FORMAT_VERSION}",
            session_id=sid,
        )
    if header.get("codec") != CODEC:
        raise ForeignRecord(f"session {sid!r}: codec {header.get('codec')!r}, this build reads {CODEC}", session_id=sid)
    return header, view[end + _DIGEST :]


def _check_expect(header: Mapping[str, Any], expect: Mapping[str, Any] | None, sid: Any) -> None:
    if not expect:
        return
    unknown = set(expect) - set(EXPECT_KEYS)
    if unknown:
        raise ValueError(f"expect may only name {EXPECT_KEYS}, got {sorted(unknown)}")
    for key in EXPECT_KEYS:
        if key not in expect:
            continue
        want = dtype_name(expect[key]) if key == "dtype" else expect[key]
        if header.get(key) != want:
            raise ForeignRecord(
                f"session {sid!r}: record has {key}={header.get(key)!r}, expected {want!r}", session_id=sid
            )


def _payload(header: Mapping[str, Any], payload: memoryview, sid: Any) -> dict[str, torch.Tensor]:
    """Verify, decompress and load the payload, and check its tensors against the header's list."""
    if len(payload) != header.get("payload_bytes"):
        raise CorruptRecord(
            f"session {sid!r}: payload is {len(payload)} bytes, the header says {header.get('payload_bytes')}"
            " (truncated or appended to)",
            session_id=sid,
        )
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CorruptRecord(f"session {sid!r}: payload checksum mismatch", session_id=sid)
    try:
        raw_bytes = header["raw_bytes"]
        # what the frame says it holds must be what the header says, before anything is allocated for it: a frame
        # that inflates past the header's size (a bomb, or a header edited with its checksum) is refused, not tried
        if not isinstance(raw_bytes, int) or zstandard.frame_content_size(payload) not in (-1, raw_bytes):
            raise CorruptRecord(f"session {sid!r}: the frame's size differs from the header's", session_id=sid)
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_bytes)
        if len(raw) != raw_bytes:
            raise CorruptRecord(f"session {sid!r}: decompressed size differs from the header", session_id=sid)
        tensors = st_load(raw)
        declared = header["tensors"]
    except (zstandard.ZstdError, SafetensorError, KeyError, TypeError, MemoryError) as err:
        raise CorruptRecord(f"session {sid!r}: undecodable payload ({err!r})", session_id=sid) from err
    actual = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for name, t in tensors.items()}
    if actual != declared:
        raise CorruptRecord(f"session {sid!r}: payload tensors {actual} differ from the header's", session_id=sid)
    return tensors


# ---------------------------------------------------------------------------------------------------- fingerprint

#: config keys that change with the software or the load path, not with what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "name_or_path", "dtype", "torch_dtype"})
_SAMPLES_PER_TENSOR = 16


def _stable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            str(k): _stable(v) for k, v in obj.items() if not str(k).startswith("_") and k not in _VOLATILE_CONFIG_KEYS
        }
    if isinstance(obj, list | tuple):
        return [_stable(v) for v in obj]
    return obj


def model_fingerprint(model: torch.nn.Module, tokenizer: Any) -> str:
    """A sha256 (hex) that changes whenever a stored KV block would mean something else under ``model``.

    A token's keys and values are a function of the architecture (the config: layers, heads, RoPE, norms), the
    weights, the dtype they were computed in, and what each token id means (the tokenizer's vocabulary). The
    config alone is not enough: ``tiny-random`` with another seed, or any fine-tune of the same base, has the same
    config and different KV. So the hash also covers a strided sample of 16 values from every parameter tensor
    (with names and shapes): any real change of weights moves nearly every value of the tensors it touches, so it
    moves the sample; a change confined to values between the samples (one edited row) would escape, a limit
    accepted for a check that costs one small gather per tensor rather than hashing ~0.5 GB. Config keys that vary
    with the transformers version or the load path (``_name_or_path``, ``transformers_version``, private ``_*``
    keys such as the attention implementation) are left out, so reloading the same model keeps its fingerprint.
    """
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    cfg = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    h.update(json.dumps(_stable(cfg), sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    dtype = getattr(model, "dtype", None) or (params[0][1].dtype if params else None)
    h.update(f"dtype={dtype}".encode())
    samples = []
    with torch.no_grad():
        for name, p in params:
            h.update(f"{name}:{list(p.shape)}:{p.dtype};".encode())
            if p.device.type == "meta" or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            samples.append(flat[:: max(1, flat.numel() // _SAMPLES_PER_TENSOR)][:_SAMPLES_PER_TENSOR].float())
    if samples:
        # one transfer, not one per tensor (a GPU model has a few hundred parameter tensors)
        h.update(torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes())
    h.update(f"vocab_size={len(tokenizer)}".encode())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    h.update(json.dumps(sorted(vocab.items())).encode())
    return h.hexdigest()
