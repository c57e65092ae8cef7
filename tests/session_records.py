"""Session records built in memory for the record-format and store tests: deterministic tensors, a bit-exact
comparison, and a header rewrite that keeps the digests sound (so a test can make a record that lies)."""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from confkv.sessions import BlockKV, SessionRecord

FP = "f" * 64
EXPECT = {"model_fingerprint": FP, "block_size": 16, "dtype": "float32"}


def make_record(
    session_id: str = "s1",
    *,
    n_tokens: int = 100,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    layers: int = 2,
    heads: int = 2,
    dim: int = 8,
    dropped: tuple[int, ...] = (1,),
    seed: int = 0,
    fingerprint: str = FP,
) -> SessionRecord:
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-n_tokens // block_size)
    blocks = {
        i: BlockKV(
            k=torch.randn(layers, block_size, heads, dim, generator=g).to(dtype),
            v=torch.randn(layers, block_size, heads, dim, generator=g).to(dtype),
            score=torch.rand(block_size, generator=g),
        )
        for i in range(n_blocks)
        if i not in dropped
    }
    return SessionRecord(
        session_id=session_id,
        model_fingerprint=fingerprint,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        token_ids=torch.randint(0, 50_000, (n_tokens,), generator=g).tolist(),
        num_computed=max(0, n_tokens - 1),
        blocks=blocks,
        controller={"budget": 0.5, "steps": 7, "history": [1.5, 2.25]},
        policy={"name": "dynamic", "base": 256, "max": 1024},
        policy_version="dynamic@3",
        created_at=1_700_000_000.25,
        updated_at=1_700_000_100.5,
        meta={"user": "u1", "turns": 3},
    )


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_same(a: SessionRecord, b: SessionRecord) -> None:
    """Every field equal, every tensor bit-identical (and of the same dtype and shape)."""
    for name in ("session_id", "model_fingerprint", "block_size", "dtype", "token_ids", "num_computed", "controller"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("policy", "policy_version", "created_at", "updated_at", "meta"):
        assert getattr(a, name) == getattr(b, name), name
    assert sorted(a.blocks) == sorted(b.blocks)
    for i, blk in a.blocks.items():
        other = b.blocks[i]
        for t, u in ((blk.k, other.k), (blk.v, other.v), (blk.score, other.score)):
            assert t.dtype == u.dtype and t.shape == u.shape
            assert bits(t) == bits(u), f"block {i} differs"


def reframe(blob: bytes, **changes: object) -> bytes:
    """``blob`` with header fields changed and the header digest recomputed: a sound record that says otherwise."""
    (hlen,) = struct.unpack_from("<I", blob, 8)
    header = json.loads(blob[12 : 12 + hlen])
    header.update(changes)
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return b"".join((blob[:8], struct.pack("<I", len(hb)), hb, hashlib.sha256(hb).digest(), blob[12 + hlen + 32 :]))
