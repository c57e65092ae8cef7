import torch

from confkv import LLM
from confkv.bench.reference import ReferenceStore, build_references
from confkv.scoring import ScoreItem, Scorer


def test_references_are_computed_once_and_reused(tiny, tmp_path):
    full = LLM("tiny-random", "full", loaded=tiny, compact_interval=16)
    tok = full.tokenizer
    gen_prompt = tok("Generate after this prompt.")["input_ids"]
    text = tok("A text scored from its tenth token on, teacher forced. " * 3)["input_ids"]
    store = ReferenceStore(full, tmp_path)
    items = [(gen_prompt, 24, None), (text, 0, 10)]
    first = build_references(full, items, store)
    assert len(list(store.folder.glob("*.safetensors"))) == 2
    gen, scored = first
    assert len(gen.continuation) <= 24 and gen.scored_ids == gen_prompt + gen.continuation
    assert gen.topk.ids.shape == (len(gen.continuation), 32)
    assert scored.continuation == [] and scored.topk.ids.shape[0] == len(text) - 10
    # a second build reads the files (a changed engine would otherwise give different numbers)
    second = build_references(full, items, store)
    for a, b in zip(first, second, strict=True):
        assert a.continuation == b.continuation and a.scored_ids == b.scored_ids
        assert torch.equal(a.topk.ids, b.topk.ids) and torch.equal(a.topk.logprobs, b.topk.logprobs)
    # the full cache has zero KL to its own reference
    (again,) = Scorer(full.engine).score([ScoreItem(scored.scored_ids, scored.score_from, scored.topk)])
    assert again.kl is not None and float(again.kl.max()) < 1e-5
