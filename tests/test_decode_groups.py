"""Decode rows attended in groups by width (``runner._decode_groups``): the same attention, recorded mass and
captured log-sum-exp as one padded batch, and the same greedy tokens from the engine, on less padding."""

from __future__ import annotations

import pytest
import torch

from confkv import LLM, SamplingParams
from confkv.engine import runner
from confkv.kv.attention import PackedBatch, _decode_attention
from tests.conftest import fresh_tiny
from tests.test_kv import BS, KVH, D, make_pool


def _batch(pool, widths: list[int], track: bool) -> PackedBatch:
    """Decode rows of ``widths`` blocks each (distinct blocks, the last one half filled), padded to the widest."""
    width, n = max(widths), len(widths)
    ids = iter(torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(0)).tolist())
    rows = [[next(ids) for _ in range(w)] for w in widths]
    blocks = torch.tensor([r + r[-1:] * (width - len(r)) for r in rows])
    pos = torch.arange(width * BS).repeat(n, 1)
    qpos = torch.tensor([w * BS - BS // 2 for w in widths])
    valid = (pos < torch.tensor(widths)[:, None] * BS) & (pos <= qpos[:, None])
    batch = PackedBatch(pool=pool, slot_mapping=torch.empty(0, dtype=torch.long), num_decode=n, decode_blocks=blocks,
                        decode_valid=valid, decode_pos=pos, decode_qpos=qpos, capture_decode=True)  # fmt: skip
    if track:
        batch.decode_slots = (blocks[:, :, None] * BS + torch.arange(BS)).reshape(n, width * BS)
        batch.decode_track = torch.ones(n, 1)
        batch.score = torch.zeros_like(pool.score)
    return batch


@pytest.mark.parametrize("track", [False, True])
def test_grouped_decode_attention_equals_the_padded_batch(track: bool) -> None:
    """Two wide rows among narrow ones: split into two groups, the output, the per-slot attention mass and the
    captured query and log-sum-exp are those of the padded batch (in the rows' order)."""
    torch.manual_seed(0)
    pool = make_pool(num_blocks=64)
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    widths = [2, 9, 1, 3, 8, 2]
    q = torch.randn(len(widths), 2 * KVH, D)
    results = []
    for split in (False, True):
        batch = _batch(pool, widths, track)
        if split:
            batch.decode_groups = runner._decode_groups(batch, widths, BS)
            assert [g.rows.tolist() for g in batch.decode_groups] == [[1, 4], [0, 2, 3, 5]]
            assert [g.blocks.shape[1] for g in batch.decode_groups] == [9, 3]
        captures: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        out = _decode_attention(batch, 1, q, 0.35, None, captures)
        results.append((out, captures[0][0], captures[1][0], batch.score))
    (out, cq, lse, score), (g_out, g_cq, g_lse, g_score) = results
    torch.testing.assert_close(g_out, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_cq, cq, rtol=0, atol=0)
    torch.testing.assert_close(g_lse, lse, rtol=1e-6, atol=1e-6)
    if track:
        torch.testing.assert_close(g_score, score, rtol=1e-6, atol=1e-6)
        assert score.sum() > 0


def test_rows_of_like_width_stay_one_padded_batch() -> None:
    """A split that spares under a quarter of the padded keys is not worth a group's extra kernel calls."""
    pool = make_pool(num_blocks=64)
    batch = _batch(pool, [8, 7, 8, 6], track=False)
    assert runner._decode_groups(batch, [8, 7, 8, 6], BS) == []
    assert runner._decode_groups(batch, [8, 2, 2, 2], BS) != []


def _answers(monkeypatch: pytest.MonkeyPatch, min_saving: float) -> tuple[list[list[int]], int]:
    """Greedy answers of the per-token confidence rule (decayed scorer, stale recompute) to prompts of different
    lengths, and how many forward passes attended their decode rows in groups."""
    monkeypatch.setattr(runner, "DECODE_SPLIT_MIN_SAVING", min_saving)
    split = 0
    make = runner._decode_groups

    def counted(*args, **kwargs):
        nonlocal split
        groups = make(*args, **kwargs)
        split += bool(groups)
        return groups

    monkeypatch.setattr(runner, "_decode_groups", counted)
    llm = LLM("tiny-random", "dynamic", loaded=fresh_tiny(), base_size=32, max_size=256, min_recent=16,
              sink_tokens=4, scaling_factor=0.05, entropy_threshold=4.0358, compact_interval=1, scorer="decayed",
              attention_decay=0.98, recompute="stale", kv_cache_memory="8MiB")  # fmt: skip
    text = "Budgets move with confidence; the cache follows the budget. "
    prompts = [text * k for k in (1, 6, 2, 9)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert llm.engine.num_reruns > 0  # the rule expanded and recalled: rows of different widths
    return [o.token_ids for o in outs], split


def test_the_engine_gives_the_same_greedy_tokens_with_rows_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    padded, never = _answers(monkeypatch, 2.0)  # above 1: never split
    grouped, split = _answers(monkeypatch, 0.0)  # any saving: split
    assert never == 0 and split > 0
    assert grouped == padded
