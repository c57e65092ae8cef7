"""Evaluation workloads: deterministic, disjoint between splits, of the asked size, and strict about their inputs.

Only the tiny byte-level tokenizer is used (one token per byte), so sizes are checked exactly and quickly.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from confkv.bench.corpus import SPLITS, split_passage, split_text, topic_splits
from confkv.bench.workloads import WORKLOADS, WorkloadItem, longgen_prompts, make_workload
from confkv.model_loader import tiny_random_tokenizer

SIZES: dict[str, dict[str, Any]] = {
    "passkey": {"lengths": (300, 500), "depths": (0.2, 0.8)},
    "passkey-varied": {"length_range": (300, 500), "depth_range": (0.2, 0.8)},
    "multikey": {"length": 500, "num_pairs": 4},
    "prose": {"length": 300, "context": 50},
    "longgen": {"max_tokens": 64},
    "chat": {"turns": 3, "max_tokens": 32},
}
RETRIEVAL = ("passkey", "passkey-varied", "multikey")
COMMON_WORDS = {"the", "of", "and", "is", "are", "to", "a", "be", "for", "in", "that", "it", "with"}


@pytest.fixture(scope="module")
def tok():
    return tiny_random_tokenizer()


def make(tok, name: str, split: str = "heldout", n: int = 3, seed: int = 0, **sizes: Any) -> list[WorkloadItem]:
    return make_workload(name, tok, split=split, n=n, seed=seed, **{**SIZES[name], **sizes})


def text_of(tok, item: WorkloadItem) -> str:
    return tok.decode(list(item.prompt_ids))


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_items(tok, name):
    a, b = make(tok, name, seed=3), make(tok, name, seed=3)
    assert a == b
    assert [it.meta for it in a] == [it.meta for it in b]


@pytest.mark.parametrize("name", WORKLOADS)
def test_other_seed_other_items(tok, name):
    a, b = make(tok, name, seed=0), make(tok, name, seed=1)
    assert [it.prompt_ids for it in a] != [it.prompt_ids for it in b]


@pytest.mark.parametrize("name", WORKLOADS)
def test_splits_share_no_item(tok, name):
    n = 40 if name == "longgen" else 8  # longgen: a split's whole pool of requests
    train, heldout = make(tok, name, "train", n=n), make(tok, name, "heldout", n=n)
    assert not {it.prompt_ids for it in train} & {it.prompt_ids for it in heldout}
    if name in RETRIEVAL:
        assert not {it.answer for it in train} & {it.answer for it in heldout}
        assert all(int(it.answer) % 2 == 0 for it in train) and all(int(it.answer) % 2 == 1 for it in heldout)
    assert {it.split for it in train} == {"train"} and {it.split for it in heldout} == {"heldout"}


@pytest.mark.parametrize("name", WORKLOADS)
def test_item_ids_unique_and_stable(tok, name):
    items = make(tok, name, "train", n=4)
    assert len({it.item_id for it in items}) == len(items) > 0
    assert all(re.fullmatch(rf"{name}-train-\d{{4}}", it.item_id) for it in items)
    assert all(it.workload == name and it.prompt_ids and all(isinstance(t, int) for t in it.prompt_ids) for it in items)
    assert make(tok, name, "train", n=2) == items[: len(make(tok, name, "train", n=2))]  # a prefix of a larger n


@pytest.mark.parametrize("name", RETRIEVAL)
def test_retrieval_correct(tok, name):
    for it in make(tok, name):
        assert it.max_tokens == 8 and it.answer and it.answer.isdigit()
        assert it.correct(f"The answer is {it.answer}.") is True
        assert it.correct(it.answer) is True
        assert it.correct("I do not remember it.") is False
        assert it.correct(f"1{it.answer}") is False  # part of a longer number is not the answer
        assert it.answer in text_of(tok, it)


@pytest.mark.parametrize("name", ["prose", "longgen", "chat"])
def test_items_without_answer(tok, name):
    assert all(it.answer is None and it.correct("anything") is None for it in make(tok, name))


def test_passkey_grid_and_length(tok):
    lengths, depths = (300, 600), (0.1, 0.5, 0.9)
    items = make(tok, "passkey", n=2, lengths=lengths, depths=depths)
    assert len(items) == 2 * len(lengths) * len(depths)
    cells = [(it.meta["length"], it.meta["depth"]) for it in items]
    assert sorted(set(cells)) == sorted(itertools.product(lengths, depths))
    assert all(cells.count(c) == 2 for c in set(cells))
    for it in items:
        assert abs(len(it.prompt_ids) - it.meta["length"]) <= 0.1 * it.meta["length"]
        text = text_of(tok, it)
        assert text.endswith("The pass key is") and "<|im_start|>" not in text
    # the key sits at the asked depth of the haystack
    for it in items:
        text = text_of(tok, it)
        assert abs(text.index(it.answer) / len(text) - it.meta["depth"]) < 0.3


def test_passkey_prose_filler(tok):
    items = make(tok, "passkey", n=1, lengths=(400,), depths=(0.5,), filler="prose")
    assert " the " in text_of(tok, items[0]) and items[0].meta["filler"] == "prose"


def test_passkey_fillers_grid(tok):
    """Both fillers in one grid; the repeated filler's items are those it gives alone (its seeds did not move)."""
    both = make(tok, "passkey", n=1, lengths=(300, 500), depths=(0.2, 0.8), filler=("repeat", "prose"))
    alone = make(tok, "passkey", n=1, lengths=(300, 500), depths=(0.2, 0.8), filler="repeat")
    assert len(both) == 8 and [it.meta["filler"] for it in both] == ["repeat"] * 4 + ["prose"] * 4
    assert [it.prompt_ids for it in both[:4]] == [it.prompt_ids for it in alone]
    assert len({it.answer for it in both}) == 8  # each cell draws its own key
    assert len({it.item_id for it in both}) == 8
    for it in both[4:]:
        assert abs(len(it.prompt_ids) - it.meta["length"]) <= 0.1 * it.meta["length"]


@pytest.mark.parametrize("split", SPLITS)
def test_passkey_prose_filler_stays_in_its_split(tok, split):
    """A held-out pass-key haystack is held-out documentation: a tuned policy never reads it."""
    other = SPLITS[1 - SPLITS.index(split)]
    for it in make(tok, "passkey", split=split, n=1, lengths=(600,), depths=(0.3, 0.7), filler="prose"):
        lines = [ln for ln in text_of(tok, it).splitlines() if len(ln) >= 40 and "pass key" not in ln][1:-1]
        assert lines
        assert all(ln in split_text(split) for ln in lines)
        assert not any(ln in split_text(other) for ln in lines if len(ln) >= 60)


def test_long_chat_items(tok):
    items = make(tok, "chat", n=4, turns=4, max_tokens=40, length=1200)
    assert len({it.meta["scenario"] for it in items}) == 4  # long chats take the split's scenarios in turn
    for it in items:
        text = text_of(tok, it)
        assert 0.85 * 1200 <= len(it.prompt_ids) <= 1200
        assert it.meta["length"] == 1200 and it.max_tokens == 40
        assert text.count("<|im_start|>user\n") == 4 and text.count("<|im_start|>assistant\n") == 4
        assert text.endswith("<|im_start|>assistant\n")
        turns = text.split("<|im_start|>user\n")[2:4]  # the two pasted passages
        for turn in turns:
            body = turn.split("\n\n", 1)[1].split("<|im_end|>")[0]
            assert len(body) > 100 and body in split_text("heldout")


def test_long_chat_splits_disjoint(tok):
    train = make(tok, "chat", "train", n=6, turns=3, length=900)
    heldout = make(tok, "chat", "heldout", n=6, turns=3, length=900)
    lines = [
        {ln for it in items for ln in text_of(tok, it).splitlines() if len(ln) >= 50} for items in (train, heldout)
    ]
    assert not lines[0] & lines[1]


def test_short_chats_unchanged_by_length_zero(tok):
    assert make(tok, "chat", n=3) == make(tok, "chat", n=3, length=0)


def test_multikey_items(tok):
    for it in make(tok, "multikey", n=4, length=600, num_pairs=5):
        text = text_of(tok, it)
        assert abs(len(it.prompt_ids) - 600) <= 60
        records = re.findall(r"The value for key ([a-z]+-[a-z]+) is (\d{5})\.", text)
        assert len(records) == 5
        assert dict(records[:5])[it.meta["key"]] == it.answer
        assert text.count(it.answer) == 1
        assert text.endswith(f"What is the value for key {it.meta['key']}? The value for key {it.meta['key']} is")
        assert it.meta["num_pairs"] == 5


def test_multikey_too_short(tok):
    with pytest.raises(ValueError, match="too short for 20 pairs"):
        make(tok, "multikey", length=200, num_pairs=20)


def test_prose_items(tok):
    items = make(tok, "prose", n=3, length=400, context=100)
    for it in items:
        assert it.score_from == 100 < len(it.prompt_ids) == 400
        text = text_of(tok, it)
        assert len(COMMON_WORDS & set(re.findall(r"[a-z]+", text.lower()))) >= 3 and "<|im_start|>" not in text
    assert make(tok, "prose", n=1, length=50, context=0)[0].score_from == 0


def test_prose_splits_use_disjoint_text():
    """No paragraph is in both splits (topics that quote each other stay together), and passages stay inside."""
    paragraphs = [{p.strip() for p in split_text(s).split("\n\n") if len(p.strip()) >= 40} for s in SPLITS]
    assert not paragraphs[0] & paragraphs[1]
    assert set(topic_splits().values()) == set(SPLITS)
    sizes = [len(split_text(s)) for s in SPLITS]
    assert min(sizes) > 0.4 * sum(sizes)
    for s in SPLITS:
        assert split_passage(500, 7, s) in split_text(s)


def test_longgen_items(tok):
    items = make(tok, "longgen", n=5, max_tokens=200)
    for it in items:
        text = text_of(tok, it)
        assert it.max_tokens == 200
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
        assert "Aim for about 150 words." in text
    assert len({it.prompt_ids for it in items}) == len(items)
    train, heldout = longgen_prompts("train"), longgen_prompts("heldout")
    assert len(set(train) | set(heldout)) >= 30
    assert not {t for _, t, _ in train} & {t for _, t, _ in heldout}  # no template in both
    assert not {t for _, _, t in train} & {t for _, _, t in heldout}  # no topic in both


@pytest.mark.parametrize("turns", [2, 3, 6])
def test_chat_items(tok, turns):
    for it in make(tok, "chat", n=3, turns=turns, max_tokens=48):
        text = text_of(tok, it)
        assert it.max_tokens == 48 and it.meta["turns"] == turns
        assert text.count("<|im_start|>user\n") == turns
        assert text.count("<|im_start|>assistant\n") == turns  # a canned reply per earlier turn + the generation prompt
        assert text.endswith("<|im_start|>assistant\n")


class _DictChatTokenizer:
    """A tokenizer whose ``apply_chat_template`` returns a mapping, as newer transformers versions do."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> dict[str, list[int]]:
        out = self.inner.apply_chat_template(*args, **kwargs)
        return {"input_ids": list(out["input_ids"] if hasattr(out, "keys") else out)}


@pytest.mark.parametrize("name", ["longgen", "chat"])
def test_chat_template_output_forms(tok, name):
    assert make(tok, name) == make(_DictChatTokenizer(tok), name)


def test_seeds_are_stable_across_processes(tok):
    """Pinned answers: the draws come from SHA-256-seeded generators, never from the per-process ``hash()``."""
    assert make(tok, "passkey", n=1, lengths=(300,), depths=(0.5,))[0].answer == PINNED_PASSKEY
    assert make(tok, "multikey", n=1)[0].answer == PINNED_MULTIKEY


PINNED_PASSKEY = "82245"
PINNED_MULTIKEY = "22357"


@pytest.mark.parametrize(
    ("name", "split", "sizes", "message"),
    [
        ("needle", "heldout", {}, "unknown workload 'needle'"),
        ("passkey", "test", {}, "unknown split 'test'"),
        ("passkey", "heldout", {"length": 100}, "unknown size keyword.*length"),
        ("chat", "heldout", {"turns": 3, "max_token": 5}, "unknown size keyword.*max_token"),
        ("passkey", "heldout", {"depths": (1.5,)}, "depths"),
        ("passkey", "heldout", {"filler": "noise"}, "filler"),
        ("passkey", "heldout", {"filler": ("repeat", "noise")}, "filler"),
        ("passkey", "heldout", {"filler": ("prose", "prose")}, "filler"),
        ("chat", "heldout", {"turns": 6, "length": 300}, "too short for 6 turns"),
        ("chat", "heldout", {"turns": 2, "length": 900}, "turns >= 3"),
        ("passkey", "heldout", {"lengths": 300}, "lengths"),
        ("multikey", "heldout", {"num_pairs": 0}, "num_pairs"),
        ("prose", "heldout", {"length": 100, "context": 100}, "context"),
        ("longgen", "heldout", {"max_tokens": 8}, "max_tokens"),
        ("longgen", "heldout", {"max_tokens": 5000}, "max_tokens"),
        ("chat", "heldout", {"turns": 1}, "turns"),
    ],
)
def test_errors(tok, name, split, sizes, message):
    with pytest.raises(ValueError, match=message):
        make_workload(name, tok, split=split, n=1, **sizes)


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_bad_n(tok, n):
    with pytest.raises(ValueError, match="n must be"):
        make_workload("prose", tok, n=n)
