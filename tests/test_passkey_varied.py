"""Pass keys of varied length and depth (``passkey-varied``): the items a clock cannot time.

The grid of ``passkey`` puts every item's question at the same position, so a schedule fixed in advance learns when
to grow the cache (TUNING.md). These check that the varied items really vary where the question and the answer
come, that they are reproducible and keep the splits apart, and that the tuner's episodes start the answer's
segment after the question has been read.
"""

from __future__ import annotations

import pytest

from confkv.bench.workloads import make_workload
from confkv.model_loader import tiny_random_tokenizer
from envs.episodes import PROSE_CONTEXT, answer_aligned_start, build_episodes, scaled_sizes
from envs.evaluate import segments

SPEC = {"length_range": (250, 600), "depth_range": (0.1, 0.9), "filler": "repeat"}


@pytest.fixture(scope="module")
def tok():
    return tiny_random_tokenizer()


def items(tok, split: str = "train", n: int = 12, seed: int = 0, **spec):
    return make_workload("passkey-varied", tok, split=split, n=n, seed=seed, **{**SPEC, **spec})


def test_lengths_and_depths_are_drawn_within_their_ranges_and_differ(tok):
    got = items(tok)
    lengths = [it.meta["length"] for it in got]
    depths = [it.meta["depth"] for it in got]
    assert all(250 <= n <= 600 for n in lengths) and all(0.1 <= d <= 0.9 for d in depths)
    # the prompts end at several positions (a grid of one length gives one; the repeated filler makes lengths
    # step by one repetition, 90 bytes here), keys at as many depths as items
    assert len({len(it.prompt_ids) for it in got}) >= 3 and len(set(depths)) == len(got)
    for it in got:
        text = tok.decode(list(it.prompt_ids))
        assert abs(len(it.prompt_ids) - it.meta["length"]) <= 0.15 * it.meta["length"]
        assert text.endswith("The pass key is") and abs(text.index(it.answer) / len(text) - it.meta["depth"]) < 0.3


def test_items_are_reproducible_extend_as_a_prefix_and_follow_the_seed(tok):
    assert items(tok) == items(tok) and [it.meta for it in items(tok)] == [it.meta for it in items(tok)]
    assert items(tok, n=5) == items(tok)[:5]
    assert [it.prompt_ids for it in items(tok, seed=1)] != [it.prompt_ids for it in items(tok)]
    assert len({it.item_id for it in items(tok)}) == 12


def test_splits_share_no_prompt_and_no_key(tok):
    train, heldout = items(tok, "train", n=20), items(tok, "heldout", n=20)
    assert not {it.prompt_ids for it in train} & {it.prompt_ids for it in heldout}
    assert all(int(it.answer) % 2 == 0 for it in train) and all(int(it.answer) % 2 == 1 for it in heldout)
    assert {it.split for it in train} == {"train"} and {it.split for it in heldout} == {"heldout"}


@pytest.mark.parametrize(
    "spec",
    [{"length_range": (600, 250)}, {"length_range": (250,)}, {"length_range": "250-600"}, {"depth_range": (0.5, 1.5)},
     {"depth_range": (0.8, 0.2)}, {"filler": "noise"}, {"length_range": (8, 600)}],
)  # fmt: skip
def test_bad_ranges_are_refused(tok, spec):
    with pytest.raises(ValueError, match="passkey"):
        items(tok, **spec)


def test_answer_aligned_start_puts_the_answer_first_in_a_segment():
    for prompt_len in range(PROSE_CONTEXT + 2, 1200, 7):
        start = answer_aligned_start(prompt_len, 50)
        assert PROSE_CONTEXT <= start < PROSE_CONTEXT + 50
        answer = prompt_len - start  # the first answer token's scored index
        assert any(s.start == answer for s in segments(answer + 6, 50))


def test_episodes_start_the_answer_segment_at_varied_decisions():
    """On tiny-random: the answer is the first token of a segment (so the decision before it has read the
    question), that segment comes at a different decision from item to item, and the old grid keeps its layout."""
    data = build_episodes("tiny-random", workload="passkey-varied", split="train",
                          sizes=scaled_sizes("tiny-random", 3))  # fmt: skip
    chunk = data.base_policy.compact_interval
    assert len(data.episodes) == 6 and {ep.workload for ep in data.episodes} == {"passkey"}
    decisions = set()
    for ep in data.episodes:
        a, b = ep.task
        assert ep.item.score_from + a == ep.prompt_len and ep.item.score_from + b == len(ep.item.token_ids)
        starts = [s.start for s in segments(len(ep.item.token_ids) - ep.item.score_from, chunk)]
        assert a in starts  # the answer opens a segment
        decisions.add(starts.index(a))
    assert len(decisions) >= 2  # lengths step by one filler repetition (90 bytes): few distinct ones here
    grid = build_episodes("tiny-random", workload="passkey", split="train", loaded=data.loaded)
    assert all(ep.item.score_from == PROSE_CONTEXT for ep in grid.episodes)
    held = build_episodes("tiny-random", workload="passkey-varied", split="heldout", loaded=data.loaded,
                          sizes=scaled_sizes("tiny-random", 3))  # fmt: skip
    assert not {tuple(ep.item.token_ids) for ep in data.episodes} & {tuple(ep.item.token_ids) for ep in held.episodes}
