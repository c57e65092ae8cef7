"""Episodes for tuning: workload items turned into teacher-forced token sequences with full-cache references.

Every episode is a fixed token sequence scored chunk by chunk (``confkv.scoring``), so an episode costs one
forward pass per segment and every policy sees exactly the same tokens:

* ``prose``: documentation text, scored from its 64th token;
* ``longgen`` and ``chat``: the prompt followed by the full cache's own greedy answer;
* ``passkey``: the prompt followed by the true key; the episode's task is solved when every key token is the
  policy's top-1 choice (what greedy decoding would have produced).

The ``mixed`` workload holds all four. Items come from ``confkv.bench.workloads`` with their train/heldout split,
and references from the on-disk store shared with ``confkv bench``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confkv.bench.reference import ReferenceStore, build_references
from confkv.bench.workloads import make_workload
from confkv.config import CachePolicy
from confkv.engine.llm import LLM
from confkv.model_loader import LoadedModel, load_model
from confkv.scoring import ScoreItem

TUNE_WORKLOADS = ("mixed", "prose", "longgen", "chat", "passkey")

#: Item sizes per model size class; "tiny" is for tiny-random (tests, CI).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "quick": {
        "prose": {"n": 3, "length": 640},
        "longgen": {"n": 2, "max_tokens": 320},
        "chat": {"n": 2, "turns": 3, "max_tokens": 96},
        "passkey": {"n": 1, "lengths": (768,), "depths": (0.2, 0.6)},
    },
    "tiny": {
        "prose": {"n": 2, "length": 200},
        "longgen": {"n": 1, "max_tokens": 48},
        "chat": {"n": 1, "turns": 2, "max_tokens": 24},
        "passkey": {"n": 1, "lengths": (240,), "depths": (0.5,)},
    },
}
PROSE_CONTEXT = 64


@dataclass
class Episode:
    workload: str
    item_id: str
    item: ScoreItem  # with its full-cache reference
    task: tuple[int, int] | None = None  # scored-token span that must be greedy-correct (pass-key answers)


@dataclass
class TuneData:
    """The model, the base policy whose knobs are tuned, and the episodes of one workload and split."""

    model: str
    loaded: LoadedModel
    base_policy: CachePolicy
    episodes: list[Episode]
    workload: str
    split: str
    #: Engine settings for every engine built on this data (``kv_cache_memory``, ``max_num_batched_tokens``).
    engine: dict[str, Any] = field(default_factory=dict)

    def llm(self, policy: CachePolicy | None = None, **engine: Any) -> LLM:
        return LLM(self.model, policy or self.base_policy, loaded=self.loaded, **{**self.engine, **engine})


def default_base_policy(model: str) -> CachePolicy:
    """The requirement's dynamic defaults, sized for the episodes' lengths (an eighth; a thirty-second on tiny)."""
    from confkv.bench.suite import scaled_dynamic

    return scaled_dynamic(1 / 32 if model == "tiny-random" else 0.125)


def build_episodes(
    model: str,
    *,
    workload: str = "mixed",
    split: str = "train",
    seed: int = 0,
    base_policy: CachePolicy | None = None,
    loaded: LoadedModel | None = None,
    device: str | None = None,
    dtype: str = "auto",
    cache_dir: str | None = None,
    kv_cache_memory: int | str | None = None,
    sizes: dict[str, dict[str, Any]] | None = None,
) -> TuneData:
    if workload not in TUNE_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(TUNE_WORKLOADS)}")
    loaded = loaded or load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, seed=seed)
    engine = {"kv_cache_memory": kv_cache_memory} if kv_cache_memory is not None else {}
    sizes = sizes or SIZES["tiny" if model == "tiny-random" else "quick"]
    names = ["prose", "longgen", "chat", "passkey"] if workload == "mixed" else [workload]
    full = LLM(model, "full", loaded=loaded, seed=seed, **engine)
    store = ReferenceStore(full)
    tok = loaded.tokenizer
    episodes: list[Episode] = []
    for name in names:
        spec = dict(sizes[name])
        n = spec.pop("n")
        items = make_workload(name, tok, split=split, n=n, seed=seed, **spec)
        if name == "prose":
            triples = [(list(it.prompt_ids), 0, min(PROSE_CONTEXT, len(it.prompt_ids) - 1)) for it in items]
            spans = [None] * len(items)
        elif name == "passkey":
            triples, spans = [], []
            for it in items:
                answer = list(tok(" " + str(it.answer), add_special_tokens=False)["input_ids"])
                triples.append((list(it.prompt_ids) + answer, 0, len(it.prompt_ids)))
                spans.append((0, len(answer)))
        else:
            triples = [(list(it.prompt_ids), it.max_tokens, None) for it in items]
            spans = [None] * len(items)
        refs = build_references(full, triples, store)
        for it, ref, span in zip(items, refs, spans, strict=True):
            episodes.append(Episode(name, it.item_id, ScoreItem(ref.scored_ids, ref.score_from, ref.topk), span))
    return TuneData(model, loaded, base_policy or default_base_policy(model), episodes, workload, split, engine)
