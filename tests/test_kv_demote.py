"""``demote_dtype``: blocks an evicting policy's budget leaves out stay on the device at int4/int2 and are attended to.

By construction: a pass key (a key one query head looks up, its value distinct) placed in a block the budget evicts
is lost to plain eviction and still found, within int4's error, when the block is demoted. On tiny-random text a
demoting ``window`` stays far closer to ``full`` than the same window evicting. A recall brings the block back at
the pool's precision and drops its demoted copy. ``int4`` copies are in the pool's int4 layout (keys per channel
within the block, values in groups of 32) and ``int2`` copies in the same layout at two bits (KIVI's): they
round-trip within those codecs' stated error, and the bytes counted are the rows held."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from confkv import LLM
from confkv.cache.manager import CacheManager
from confkv.config import CachePolicy
from confkv.controllers import make_controller
from confkv.engine.runner import ModelRunner
from confkv.errors import ConfkvError
from confkv.kv import demoted as demoted_mod
from confkv.kv.attention import PackedBatch, confkv_attention
from confkv.kv.block_keys import ChannelKeyCodec
from confkv.kv.block_table import ON_HOST
from confkv.kv.demoted import DemotedTier
from confkv.kv.host import HostTier
from confkv.kv.pool import BlockPool
from confkv.kv.quant import GroupedCodec, Int2Codec, Int4Codec
from confkv.scoring import ScoreItem, Scorer

from .conftest import fresh_tiny

L, KVH, D, BS = 2, 2, 8, 4
NEEDLE, KEY_VALUE = 2, 5.0


def _scene(demote: str):
    """Ten blocks of four tokens and the decode token's, under a window of 25 tokens: blocks 0-3 are evicted.
    Block 2 holds the pass key: in layer 1, KV head 1 its keys point along channel 1 and its values are
    ``KEY_VALUE``; every other key and value is small noise."""
    policy = CachePolicy(controller="window", max_size=24, min_recent=16, demote_dtype=demote)
    pool = BlockPool(num_layers=L, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=16, dtype=torch.float32,
                     device="cpu")  # fmt: skip
    mgr = CacheManager(pool, HostTier(1 << 20), scaling=D**-0.5)
    kv = mgr.open(0, make_controller(policy), 24)
    mgr.reserve(kv, 41)  # 40 written here, and the slot of the decode token at position 40
    g = torch.Generator().manual_seed(0)
    for pos in range(40):
        slot = kv.table.slot(pos)
        pool.k[:, slot] = 0.1 * torch.randn(L, KVH, D, generator=g)
        pool.v[:, slot] = 0.1 * torch.randn(L, KVH, D, generator=g)
        if pos // BS == NEEDLE:
            pool.k[1, slot, 1, 1] = 4.0
            pool.v[1, slot, 1] = KEY_VALUE
    mgr.evict_to(kv, 25)
    assert [i for i, e in enumerate(kv.table.entries) if e == ON_HOST] == [0, 1, 2, 3]
    return mgr, pool, kv


def _decode_output(mgr: CacheManager, pool: BlockPool, kv) -> torch.Tensor:
    """Layer 1's attention output for one decode query at position 40 whose head on KV head 1 looks the key up,
    through the runner's packing of the demoted blocks and the attention function transformers calls."""
    blocks, logical = kv.table.resident_blocks(40)
    offsets = torch.arange(BS)
    batch = PackedBatch(pool=pool, slot_mapping=torch.tensor([kv.table.slot(40)]))
    batch.num_decode = 1
    batch.decode_blocks = torch.tensor([blocks])
    batch.decode_pos = (torch.tensor(logical)[:, None] * BS + offsets).reshape(1, -1)
    batch.decode_valid = batch.decode_pos <= 40
    batch.decode_qpos = torch.tensor([40])
    demoted = mgr.demoted.gather(kv.seq_id, 41) if mgr.demoted.has_blocks(kv.seq_id) else None
    if demoted is not None:
        ModelRunner(None, pool, mgr.demoted)._pack_demoted(batch, [(0, kv.seq_id, demoted)], 1, torch.tensor([40]))
    q = torch.zeros(1, KVH, 1, D)  # [1, heads, tokens, D]: one query head per KV head
    q[0, 1, 0, 1] = 8.0
    k_new = torch.zeros(1, KVH, 1, D)
    out, _ = confkv_attention(SimpleNamespace(layer_idx=1), q, k_new, k_new.clone(), None, confkv_batch=batch)
    return out[0, 0, 1]  # [D] of the head that looks the key up


#: Bytes of a demoted token's K and V rows in one layer and KV head at this file's geometry (D 8, block 4): a key
#: row is its codes and 8 bytes of its block's channel grid (8 scales and 8 zero points, float16, over 4 rows); a
#: value row its codes and one group's scale and zero point (fp32: 32 bytes each).
ROWS = {"int4": (D // 2 + 4 * D // BS, D // 2 + 4), "int2": (D // 4 + 4 * D // BS, D // 4 + 4)}


@pytest.mark.parametrize(("demote", "rows"), [("int4", (12, 8)), ("int2", (10, 6))])
def test_a_pass_key_in_a_demoted_block_is_still_found_where_eviction_loses_it(demote: str, rows: tuple) -> None:
    mgr, pool, kv = _scene("none")
    lost = _decode_output(mgr, pool, kv)
    assert abs(float(lost[0])) < 0.5  # evicted: the head finds only noise

    mgr, pool, kv = _scene(demote)
    assert mgr.demoted.indices_of(kv.seq_id) == [0, 1, 2, 3]
    found = _decode_output(mgr, pool, kv)
    assert float(found[0]) == pytest.approx(KEY_VALUE, abs=0.5)  # the key's value, through the copies' rounding
    fmt = mgr.demoted.format(kv.seq_id)
    assert (fmt.k_row, fmt.v_row) == ROWS[demote] == rows
    assert mgr.demoted.used_bytes == 4 * BS * fmt.token_bytes(L, KVH) == 4 * BS * L * KVH * sum(rows)
    assert mgr.demoted.used_bytes == mgr.demoted.bytes_of(kv.seq_id) == mgr.demoted_block_bytes(demote) * 4


def test_a_recall_brings_the_block_back_at_full_precision_and_drops_its_copy() -> None:
    mgr, pool, kv = _scene("int4")
    kv.budget = 64
    assert mgr.restore_to_device(kv, [NEEDLE]) == 1
    assert NEEDLE not in mgr.demoted.indices_of(kv.seq_id) and kv.table.entries[NEEDLE] >= 0
    assert float(pool.k[1, kv.table.slot(NEEDLE * BS), 1, 1]) == 4.0  # exact: the host tier's copy came back
    mgr.close(kv)
    assert mgr.demoted.used_bytes == 0 and pool.num_used == 0


def test_a_demoting_window_stays_closer_to_full_than_an_evicting_one() -> None:
    text = "Teacher forcing reads the reference continuation chunk by chunk. " * 9
    full = LLM("tiny-random", "full", loaded=fresh_tiny(), compact_interval=16)
    ids = full.tokenizer(text)["input_ids"]
    (ref,) = Scorer(full.engine).score([ScoreItem(ids, 100)], keep_topk=32)
    kl, demoted = {}, {}
    for demote in ("none", "int4", "int2"):
        llm = LLM("tiny-random", "window", loaded=fresh_tiny(), compact_interval=16, max_size=64, min_recent=16,
                  demote_dtype=demote)  # fmt: skip
        (r,) = Scorer(llm.engine).score([ScoreItem(ids, 100, ref.topk)])
        kl[demote], demoted[demote] = float(r.kl.mean()), r.kv["demoted_peak_bytes"]
        assert r.kv["evicted_blocks"] > 20 and r.kv["peak_resident_tokens"] <= 100
        assert llm.engine.stats()["demoted_used_bytes"] == 0  # the finished sequence's copies are gone
    # measured: 1.94 nats evicting, 0.045 at int4 (0.076 with one int4 grid a row, before 2026-12-07), 0.90 at int2
    assert kl["int4"] < 0.1 * kl["none"] and kl["int2"] < 0.6 * kl["none"] and kl["int4"] < kl["int2"]
    assert demoted["none"] == 0 and 0 < demoted["int2"] < demoted["int4"]


def test_a_bad_demote_dtype_is_refused() -> None:
    with pytest.raises(ConfkvError, match="demote_dtype") as err:
        LLM("tiny-random", "window", loaded=fresh_tiny(), demote_dtype="int3")
    assert "\n" not in str(err.value)


def test_a_policy_swap_to_another_demote_dtype_recodes_the_sequences_copies() -> None:
    mgr, pool, kv = _scene("int4")
    before = mgr.demoted.used_bytes
    values = torch.randn(L, 1, BS, KVH, D)
    mgr.demoted.put(kv.seq_id, [4], values, values, "int2")
    assert mgr.demoted.format(kv.seq_id).name == "int2" and mgr.demoted.indices_of(kv.seq_id) == [0, 1, 2, 3, 4]
    per_token = {name: sum(rows) for name, rows in ROWS.items()}  # K and V rows
    assert before == 4 * L * BS * KVH * per_token["int4"]
    assert mgr.demoted.used_bytes == 5 * L * BS * KVH * per_token["int2"]
    assert float(_decode_output(mgr, pool, kv)[0]) == pytest.approx(KEY_VALUE, abs=0.5)  # still found at int2


@pytest.mark.parametrize(("demote", "bits", "rows"), [("int4", 4, (48, 40)), ("int2", 2, (32, 32))])
def test_copies_round_trip_in_kivis_layout_within_its_codecs_error(demote: str, bits: int, rows: tuple) -> None:
    """smollm2's geometry (head_dim 64, block 16): blocks demoted, gathered as attention reads them (several blocks
    stacked, so the key grid must be split back into blocks) and decoded, within ``ChannelKeyCodec``'s and
    ``GroupedCodec``'s stated error at the copies' bits; keys with outlier channels (as RoPE'd keys have) keep their
    small channels far finer than one grid a row would, and the bytes held are the rows' own: at int4 the pool's rows,
    at int2 16 bytes of key codes and 16 of the block's grid, and per value group of 16, 4 of codes and 4 of grid."""
    layers, kvh, dim, bs, n = 2, 3, 64, 16, 5
    g = torch.Generator().manual_seed(1)
    k = torch.randn(layers, n, bs, kvh, dim, generator=g)
    k[..., :4] *= 30.0  # outlier channels
    v = torch.randn(layers, n, bs, kvh, dim, generator=g)
    tier = DemotedTier(bs, torch.device("cpu"), dim)
    tier.put(7, [1, 3, 4, 6, 9], k, v, demote)
    d = tier.gather(7, 10 * bs)
    assert d is not None and d.pos.tolist() == [i * bs + t for i in (1, 3, 4, 6, 9) for t in range(bs)]
    fmt = tier.format(7)
    k_back = fmt.decode_k(d.k, torch.float32).reshape(k.shape[0], n, bs, kvh, dim)
    v_back = fmt.decode_v(d.v, torch.float32).reshape(v.shape)
    k_err, v_err = (k_back - k).abs(), (v_back - v).abs()
    assert bool((k_err <= ChannelKeyCodec(dim, bs, bits).max_error(k)).all())
    group = GroupedCodec.GROUP if bits == 4 else demoted_mod.INT2_VALUE_GROUP
    assert bool((v_err <= GroupedCodec(bits, group).max_error(v)).all())
    assert float(v_err.max()) > 0  # the values did go through the codec
    row = Int4Codec() if bits == 4 else Int2Codec()  # one grid a row, keys and values alike
    per_row = (k - row.decode(row.encode(k), torch.float32)).abs()
    assert float(k_err[..., 4:].mean()) < 0.1 * float(per_row[..., 4:].mean())  # the outliers set only their own step
    assert (fmt.k_row, fmt.v_row) == rows  # fp32: 256 each
    assert fmt.token_bytes(layers, kvh) == layers * kvh * sum(rows)
    assert tier.used_bytes == d.k.nbytes + d.v.nbytes == n * bs * fmt.token_bytes(layers, kvh)
    tier.drop(7, [3, 9])
    assert tier.used_bytes == 3 * bs * layers * kvh * sum(rows) and tier.indices_of(7) == [1, 4, 6]
    tier.drop_sequence(7)
    assert tier.used_bytes == 0 and tier.peak_bytes == n * bs * layers * kvh * sum(rows)


def test_int2_value_groups_of_16_hold_to_their_own_error_and_bytes() -> None:
    """The other value group measured for int2 copies: 16 channels a grid, 4 bytes of codes and 4 of grid each."""
    v = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.2, 5.0, 64)
    for group, width in ((16, 32), (32, 24)):
        codec = GroupedCodec(bits=2, group=group)
        rows = codec.encode(v)
        assert rows.shape == (3, 16, width) == (3, 16, codec.row_bytes(64))
        assert bool(((codec.decode(rows, torch.float32) - v).abs() <= codec.max_error(v)).all())
    with pytest.raises(ValueError, match="4 or 2 bits"):
        GroupedCodec(bits=3)


@pytest.mark.parametrize("demote", ["int4", "int2"])
def test_a_block_size_the_key_grid_cannot_lay_out_is_refused_where_a_policy_demotes_to_it(demote: str) -> None:
    """4 x head_dim bytes of a block's key grid must spread evenly over its rows (at int4 and int2 alike):
    tiny-random's head_dim 16 at block 24 cannot; an engine that does not demote still runs at that block size."""
    with pytest.raises(ValueError, match="block size 24"):
        DemotedTier(24, torch.device("cpu"), 16).format_named(demote)
    with pytest.raises(ConfkvError, match="demote_dtype") as err:
        LLM("tiny-random", "window", loaded=fresh_tiny(), block_size=24, demote_dtype=demote)
    assert "\n" not in str(err.value)
    LLM("tiny-random", "window", loaded=fresh_tiny(), block_size=24)
