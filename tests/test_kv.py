import pytest
import torch

from confkv.cache.manager import CacheManager
from confkv.config import CachePolicy
from confkv.controllers import make_controller
from confkv.kv.block_table import ON_HOST
from confkv.kv.host import HostTier
from confkv.kv.pool import BlockPool

L, KVH, D, BS = 2, 2, 8, 4


def make_pool(num_blocks: int = 32, dtype: torch.dtype = torch.float32) -> BlockPool:
    return BlockPool(
        num_layers=L, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=num_blocks, dtype=dtype, device="cpu"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_accounting_matches_tensors(dtype):
    pool = make_pool(10, dtype)
    assert pool.total_bytes == pool.k.numel() * pool.k.element_size() + pool.v.numel() * pool.v.element_size()
    assert pool.bytes_per_block * pool.num_blocks == pool.total_bytes
    a = pool.allocate(3)
    b = pool.allocate(4)
    assert len(set(a) | set(b)) == 7 and pool.num_used == 7 and pool.num_free == 3
    assert pool.used_bytes == pool.k[:, pool.slots_of(a + b)].nbytes * 2
    pool.free(a)
    assert pool.num_used == 4 and pool.usage == pytest.approx(0.4)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(7)


def test_pool_read_write_round_trip_and_score_reset():
    pool = make_pool(8)
    ids = pool.allocate(2)
    k = torch.randn(L, 2, BS, KVH, D)
    v = torch.randn(L, 2, BS, KVH, D)
    s = torch.rand(2, BS)
    pool.write_blocks(ids, k, v, s)
    k2, v2, s2 = pool.read_blocks(ids)
    assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(s, s2)
    pool.free(ids)
    again = pool.allocate(8)
    assert float(pool.score[pool.slots_of(again)].abs().sum()) == 0.0


def test_host_tier_lru_bytes_and_drop():
    host = HostTier(capacity_bytes=3 * (2 * L * BS * KVH * D * 4 + BS * 4))
    block = lambda n: (torch.randn(L, n, BS, KVH, D), torch.randn(L, n, BS, KVH, D), torch.rand(n, BS))  # noqa: E731
    assert host.put(0, [1, 2], *block(2)) == []
    assert host.used_bytes == 2 * host._lru[(0, 1)].nbytes
    dropped = host.put(1, [5, 6], *block(2))
    assert dropped == [(0, 1)]  # least recently stored goes first
    assert host.blocks_of(0) == [2] and host.blocks_of(1) == [5, 6]
    k, _, _ = host.take(1, [6])
    assert k.shape == (L, 1, BS, KVH, D) and host.blocks_of(1) == [5]
    host.drop_sequence(1)
    assert not host.has_blocks(1) and len(host) == 1
    assert host.peak_bytes >= host.used_bytes


def _manager(policy: CachePolicy, num_blocks: int = 64) -> tuple[CacheManager, BlockPool, HostTier]:
    pool = make_pool(num_blocks)
    host = HostTier(1 << 30)
    return CacheManager(pool, host, scaling=D**-0.5), pool, host


def _fill(pool: BlockPool, mgr: CacheManager, kv, n_tokens: int) -> None:
    mgr.reserve(kv, n_tokens)
    for pos in range(n_tokens):  # token t's keys are all t, so positions can be checked after moves
        slot = kv.table.slot(pos)
        pool.k[:, slot] = float(pos)
        pool.v[:, slot] = -float(pos)


def test_eviction_keeps_sinks_and_recent_and_recall_restores_data():
    policy = CachePolicy(controller="dynamic", base_size=16, max_size=64, min_recent=8, sink_tokens=4)
    mgr, pool, host = _manager(policy)
    kv = mgr.open(0, make_controller(policy), 16)
    _fill(pool, mgr, kv, 40)  # 10 blocks
    used_before = pool.num_used
    moved = mgr.evict_to(kv, 16)
    assert moved == 6 and pool.num_used == used_before - 6
    assert kv.table.resident_tokens() == 16
    entries = kv.table.entries
    assert entries[0] >= 0 and entries[-2] >= 0 and entries[-1] >= 0  # sink block and recent window stay
    assert host.blocks_of(0) == [i for i, e in enumerate(entries) if e == ON_HOST]
    # recall with a query aligned to large keys: the latest host blocks (largest values) score highest
    kv.budget = 24
    q = torch.ones(L, KVH, 1, D)
    slots, _ = kv.table.resident_slots(kv.table.num_tokens, torch.device("cpu"))
    lse = torch.logsumexp(torch.einsum("lkgd,lnkd->lkgn", q, pool.k[:, slots].float()) * D**-0.5, dim=-1)
    back = mgr.recall(kv, q, lse)
    assert back == [5, 6]  # host holds blocks 1..6; 5 and 6 have the largest keys
    assert kv.table.resident_tokens() == 24
    for i in back:
        for off in range(BS):
            pos = i * BS + off
            assert torch.all(pool.k[:, kv.table.slot(pos)] == pos)
            assert torch.all(pool.v[:, kv.table.slot(pos)] == -pos)
    assert kv.stats.evicted_blocks == 6 and kv.stats.recalled_blocks == 2
    mgr.close(kv)
    assert pool.num_used == 0 and len(host) == 0


def test_attention_ranking_evicts_least_attended():
    policy = CachePolicy(controller="h2o", max_size=16, min_recent=4, sink_tokens=0)
    mgr, pool, _ = _manager(policy)
    kv = mgr.open(0, make_controller(policy), 16)
    _fill(pool, mgr, kv, 32)
    for i, mass in enumerate([5, 0, 9, 1, 7, 0.5, 3, 2]):
        pool.score[pool.slots_of([kv.table.entries[i]])] = mass
    mgr.evict_to(kv, 16)
    assert [i for i, e in enumerate(kv.table.entries) if e >= 0] == [0, 2, 4, 7]  # heavy hitters + recent block


def test_circuit_breaker_floor():
    policy = CachePolicy(controller="dynamic", base_size=32, max_size=64, min_recent=8, sink_tokens=4)
    mgr, pool, _ = _manager(policy)
    kv = mgr.open(0, make_controller(policy), 64)
    _fill(pool, mgr, kv, 64)
    mgr.shrink(kv, 0.0)
    assert mgr.floor_tokens(kv) == 12
    assert kv.budget == 12  # the breaker lowers the budget itself, so nothing regrows into what it freed
    assert kv.table.resident_tokens() <= mgr.floor_tokens(kv) + BS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_capture_by_the_fused_kernel_equals_explicit_attention(dtype):
    """A recall's query log-sum-exp taken from the fused kernel equals the one explicit attention computes, and so
    does the output (rows of different lengths, padding masked)."""
    from confkv.kv.attention import PackedBatch, _decode_attention

    torch.manual_seed(0)
    pool = make_pool(num_blocks=16, dtype=dtype)
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    blocks = torch.tensor([[3, 7, 1], [5, 2, 2]])  # the second row has two blocks, padded with its last
    valid = torch.ones(2, 3 * BS, dtype=torch.bool)
    valid[0, -1] = False  # unfilled tail
    valid[1, 2 * BS :] = False  # padding
    heads = 2 * KVH
    q = torch.randn(2, heads, D, dtype=dtype)

    def run(track: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        batch = PackedBatch(pool=pool, slot_mapping=torch.empty(0, dtype=torch.long), num_decode=2,
                            decode_blocks=blocks, decode_valid=valid, decode_track=track,
                            capture_decode=True)  # fmt: skip
        captures: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        out = _decode_attention(batch, 1, q, 0.35, None, captures)
        return out, captures[1][0]

    fused_out, fused_lse = run(None)
    explicit_out, explicit_lse = run(torch.zeros(2, 1))  # recording (with nowhere to add) forces explicit attention
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_out, explicit_out, **tol)
    torch.testing.assert_close(fused_lse, explicit_lse.float(), **tol)
    assert fused_lse.shape == (2, KVH, heads // KVH)


def _needle_scene(ramp: torch.Tensor, **policy_kw):
    """Ten blocks of four tokens: block 0 holds the sinks, 8-9 the recent window; layer 1, KV head 1 of the query
    looks block 2 up, every other head mildly prefers blocks by ``ramp``. The chunks' votes (records) rank block 2
    last and later blocks higher, and a contraction to 24 tokens has sent 1-4 to the host tier."""
    policy = CachePolicy(controller="dynamic", base_size=16, max_size=64, min_recent=8, sink_tokens=4, **policy_kw)
    mgr, pool, host = _manager(policy)
    kv = mgr.open(0, make_controller(policy), 64)
    _fill(pool, mgr, kv, 40)
    for pos in range(40):
        slot = kv.table.slot(pos)
        pool.k[:, slot] = 0.0
        pool.k[:, slot, :, 0] = ramp[pos // BS]
        if pos // BS == 2:
            pool.k[1, slot, 1, 1] = 4.0
        pool.score[slot] = 0.0 if pos // BS == 2 else 1.0 + pos
    mgr.evict_to(kv, 24)
    assert [i for i in range(1, 8) if kv.table.entries[i] >= 0] == [5, 6, 7]
    q = torch.zeros(L, KVH, 1, D)
    q[..., 0] = 4.0
    q[1, 1, 0] = 0.0
    q[1, 1, 0, 1] = 8.0
    return mgr, pool, host, kv, q


#: blocks 5, 6, 7 preferred in that order by every head but the one that looks block 2 up
LATE_RAMP = torch.tensor([0, 0, 0, 1, 1.5, 3, 2.5, 2, 0, 0])


def test_the_prompts_last_query_reselects_a_block_one_head_looks_up_from_the_host_tier():
    """After the prompt, ``reselect`` ranks device and host blocks alike by the largest share any one head gives a
    block: a record that one head looks up comes back from the host tier, though the heads that spread their
    attention over other blocks outweigh it in a summed score (what ``recall`` ranks by)."""
    needle, ramp = 2, torch.tensor([0, 0, 0, 1, 1.5, 2, 2.5, 3, 0, 0])  # every head but one prefers later blocks
    mgr, pool, host, kv, q = _needle_scene(ramp)
    assert kv.table.entries[needle] == ON_HOST

    candidates = list(range(1, 8))  # between the sink block and the recent window
    share = torch.zeros(L, KVH, len(candidates))
    for j, i in enumerate(candidates):  # every candidate's key, wherever it is, as written above
        k = torch.zeros(L, KVH, D)
        k[..., 0] = ramp[i]
        if i == needle:
            k[1, 1, 1] = 4.0
        share[:, :, j] = torch.exp((q[:, :, 0] * k).sum(-1) * D**-0.5) * BS
    share = share / share.sum(-1, keepdim=True)
    assert candidates[int(share.sum(dim=(0, 1)).argmax())] != needle  # a sum would rank another block first
    assert candidates[int(share.amax(dim=(0, 1)).argmax())] == needle

    back = mgr.reselect(kv, q, 16.0)
    entries = kv.table.entries
    assert kv.budget == 16 and kv.table.resident_tokens() == 16
    assert back == 1 and entries[needle] >= 0  # the one block that fits beside the sinks and the recent window
    assert entries[0] >= 0 and entries[8] >= 0 and entries[9] >= 0
    assert [i for i, e in enumerate(entries) if e >= 0] == [0, needle, 8, 9]
    for off in range(BS):
        assert float(pool.k[1, kv.table.slot(needle * BS + off), 1, 1]) == 4.0
    assert mgr.reselections == 1 and kv.stats.recalled_blocks == 1
    assert sorted(host.blocks_of(0)) == [i for i, e in enumerate(entries) if e == ON_HOST]
    mgr.close(kv)
    assert pool.num_used == 0 and len(host) == 0


@pytest.mark.parametrize("scorer", ["snapkv", "decayed", "h2o"])
def test_a_reselected_block_is_not_the_next_contractions_first_victim(scorer: str) -> None:
    """A block the question brought back from the host tier carried the low record that had evicted it. The blocks
    the question picks are recorded above every resident block, in the order it ranked them, so a contraction right
    after evicts the block it ranked last, not the one it just brought back, whatever the scorer."""
    mgr, _pool, _host, kv, q = _needle_scene(LATE_RAMP, scorer=scorer, reselect_share=1.0)
    assert mgr.reselect(kv, q, 24.0) == 1
    assert [i for i in range(1, 8) if kv.table.entries[i] >= 0] == [2, 5, 6]  # the needle, then what others prefer
    mgr.evict_to(kv, 20)
    assert [i for i in range(1, 8) if kv.table.entries[i] >= 0] == [2, 5]
    mgr.close(kv)


def test_reselect_share_leaves_the_rest_to_the_scorers_ranking() -> None:
    """``reselect_share``: the query picks that share of the blocks that fit (here one of three: the needle); the
    others are the resident blocks the chunks' votes rank highest (7, then 6), not the query's next choices (5, 6)."""
    mgr, _pool, _host, kv, q = _needle_scene(LATE_RAMP, scorer="snapkv", reselect_share=0.33)
    assert mgr.reselect(kv, q, 24.0) == 1
    assert [i for i in range(1, 8) if kv.table.entries[i] >= 0] == [2, 6, 7]
    mgr.close(kv)
