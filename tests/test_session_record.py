"""The session record format: round trips, refusals of damaged or foreign records, the model fingerprint."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from confkv.sessions import (
    CorruptRecord,
    ForeignRecord,
    decode,
    decode_tokens,
    encode,
    encode_tokens,
    model_fingerprint,
    read_header,
)
from confkv.sessions.record import RECORD_MAGIC
from tests.session_records import EXPECT, FP, assert_same, make_record, reframe

# ------------------------------------------------------------------------------------------------ the record format


def with_payload(blob: bytes, payload: bytes) -> bytes:
    """``blob`` with its payload replaced and the header's payload fields made to match: checksums all pass."""
    head = reframe(blob, payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
    (hlen,) = struct.unpack_from("<I", head, 8)
    return head[: 12 + hlen + 32] + payload


def test_a_frame_larger_than_its_header_says_is_refused_unopened() -> None:
    """A payload whose frame inflates past the header's ``raw_bytes`` (a bomb, or a header edited with its
    checksum) is refused before anything is allocated for it."""
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(bytes(256 * 2**20))  # 256 MiB of zeros in a few KiB
    assert len(bomb) < 2**20
    with pytest.raises(CorruptRecord, match="frame's size"):
        decode(with_payload(encode(make_record()), bomb))


def test_decode_refuses_what_encode_refuses() -> None:
    """The engine trusts a restored record's geometry: block indices past the computed tokens, a repeated index or
    more computed tokens than token ids are corrupt records, not a crash on the engine thread."""
    blob = encode(make_record(n_tokens=100, dropped=(1,)))  # blocks 0, 2..6 of 7
    for changes in ({"block_indices": [0, 2, 3, 4, 5, 600]}, {"block_indices": [0, 2, 3, 4, 5, 5]},
                    {"num_computed": 10**6}):  # fmt: skip
        with pytest.raises(CorruptRecord):
            decode(reframe(blob, **changes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_record_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    rec = make_record(dtype=dtype)
    blob = encode(rec)
    assert blob.startswith(RECORD_MAGIC)
    back = decode(blob, expect={**EXPECT, "dtype": dtype})
    assert_same(rec, back)
    header = read_header(blob)
    assert header["format_version"] == 1 and header["codec"] == "zstd"
    assert header["block_indices"] == [0, 2, 3, 4, 5, 6]  # block 1 was dropped for good
    assert header["tensors"]["k"]["shape"] == [6, 2, 16, 2, 8]


def test_record_without_blocks_or_tokens() -> None:
    rec = make_record(n_tokens=0, dropped=())
    assert rec.blocks == {}
    back = decode(encode(rec), expect=EXPECT)
    assert back.token_ids == [] and back.blocks == {} and back.num_computed == 0


def test_tokens_object_is_small_and_readable_alone() -> None:
    rec = make_record(n_tokens=2_000)
    tokens_blob, record_blob = encode_tokens(rec), encode(rec)
    assert len(tokens_blob) < len(record_blob) / 10
    tokens = decode_tokens(tokens_blob, expect={"model_fingerprint": FP})
    assert tokens.token_ids == rec.token_ids and tokens.session_id == "s1" and tokens.updated_at == rec.updated_at
    with pytest.raises(CorruptRecord, match="tokens-only object"):
        decode(tokens_blob)  # one object kind is never mistaken for the other
    with pytest.raises(CorruptRecord):
        decode_tokens(record_blob)


def test_inconsistent_records_are_refused_at_encode() -> None:
    rec = make_record()
    rec.blocks[0].k = rec.blocks[0].k.to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        encode(rec)
    rec = make_record()
    rec.blocks[9] = rec.blocks[0]  # past the computed tokens
    with pytest.raises(ValueError, match="outside"):
        encode(rec)
    rec = make_record()
    rec.controller = {"x": object()}
    with pytest.raises(ValueError, match="JSON"):
        encode(rec)


@pytest.mark.parametrize("keep", [0, 5, 11, 40, 300, -200, -1])
def test_truncated_record_is_corrupt(keep: int) -> None:
    blob = encode(make_record())
    with pytest.raises(CorruptRecord):
        decode(blob[:keep], expect=EXPECT)


@pytest.mark.parametrize("where", ["magic", "length", "header", "digest", "payload", "last"])
def test_flipped_byte_is_corrupt(where: str) -> None:
    blob = bytearray(encode(make_record()))
    (hlen,) = struct.unpack_from("<I", blob, 8)
    pos = {"magic": 3, "length": 9, "header": 12 + hlen // 2, "digest": 12 + hlen + 5}.get(where)
    pos = {"payload": 12 + hlen + 32 + 100, "last": len(blob) - 1}.get(where, pos)
    blob[pos] ^= 0x10
    with pytest.raises(CorruptRecord):
        decode(bytes(blob), expect=EXPECT)


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_fingerprint", "0" * 64), ("block_size", 32), ("dtype", "bfloat16"), ("dtype", torch.float16)],
)
def test_record_for_another_model_is_foreign(field: str, value: object) -> None:
    blob = encode(make_record())
    with pytest.raises(ForeignRecord, match=field):
        decode(blob, expect={**EXPECT, field: value})
    decode(blob, expect=EXPECT)  # and the same bytes are fine for the model they were made for


def test_other_format_version_is_foreign_and_bad_expect_is_a_bug() -> None:
    blob = encode(make_record())
    with pytest.raises(ForeignRecord, match="format version 2"):
        decode(reframe(blob, format_version=2), expect=EXPECT)
    with pytest.raises(ForeignRecord, match="codec"):
        decode(reframe(blob, codec="lz4"))
    with pytest.raises(CorruptRecord, match="tensors"):  # a header that lies about the payload
        decode(reframe(blob, tensors={}))
    with pytest.raises(ValueError, match="expect may only name"):
        decode(blob, expect={"model": "x"})


def test_model_fingerprint_tells_weights_apart_and_ignores_load_details() -> None:
    from confkv.model_loader import tiny_random_model, tiny_random_tokenizer

    tok = tiny_random_tokenizer()
    a, a_again, b = tiny_random_model(0), tiny_random_model(0), tiny_random_model(1)
    fp = model_fingerprint(a, tok)
    assert len(fp) == 64
    assert model_fingerprint(a_again, tok) == fp
    assert model_fingerprint(b, tok) != fp  # same config, other weights: the config alone would not see it
    a_again.config._name_or_path = "/somewhere/else"
    a_again.set_attn_implementation("sdpa")
    assert model_fingerprint(a_again, tok) == fp
    assert model_fingerprint(a.to(torch.bfloat16), tok) != fp
    tok.add_tokens(["<extra>"])
    assert model_fingerprint(tiny_random_model(0), tok) != fp
