"""Episodes for tuning: workload items turned into teacher-forced token sequences with full-cache references.

Every episode is a fixed token sequence scored chunk by chunk (``confkv.scoring``), so an episode costs one
forward pass per segment and every policy sees exactly the same tokens:

* ``prose``: documentation text, scored from its 64th token;
* ``longgen`` and ``chat``: the prompt followed by the full cache's own greedy answer;
* ``passkey`` and ``multikey`` (retrieval): the prompt followed by the true answer, scored from the prompt's 64th
  token like prose, so the agent acts segment by segment while the haystack and the question are read, and before
  the answer; the episode's task is solved when every answer token is the policy's top-1 choice (what greedy
  decoding would have produced);
* ``passkey-varied``: pass keys as above, each item's length and key depth drawn from ranges (384-1024 tokens,
  depths 0.1-0.9), so the question comes at a different decision in every item and a schedule fixed in advance
  cannot know when. Scoring starts 64 to 113 tokens in, so that the answer starts a segment and the decision
  before it has read the question (``answer_aligned_start``). Its episodes are scored and counted as pass keys
  (``Episode.workload`` is ``passkey``).

The ``mixed`` workload holds all five. Items come from ``confkv.bench.workloads`` with their train/heldout split,
and references from the on-disk store shared with ``confkv bench``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from confkv.bench.reference import ReferenceStore, build_references
from confkv.bench.workloads import make_workload
from confkv.config import CachePolicy
from confkv.controllers.learned import KnobSpace
from confkv.llm import LLM
from confkv.model_loader import LoadedModel, load_model
from confkv.progress import stage
from confkv.scoring import ScoreItem

TUNE_WORKLOADS = ("mixed", "prose", "longgen", "chat", "passkey", "multikey", "passkey-varied")
RETRIEVAL = ("passkey", "multikey", "passkey-varied")
#: Retrieval kinds whose answer starts a segment (``answer_aligned_start``); the others keep their first items' layout.
ALIGNED = ("passkey-varied",)
#: The task an item kind's episodes count as, where it is not the kind's own name (accuracy, reward terms).
TASK_OF = {"passkey-varied": "passkey"}

#: Item sizes per model size class; "tiny" is for tiny-random (tests, CI).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "quick": {
        "prose": {"n": 3, "length": 640},
        "longgen": {"n": 2, "max_tokens": 320},
        "chat": {"n": 2, "turns": 3, "max_tokens": 96},
        "passkey": {"n": 1, "lengths": (768,), "depths": (0.2, 0.6)},
        "multikey": {"n": 1, "length": 768, "num_pairs": 4},
        "passkey-varied": {"n": 2, "length_range": (384, 1024), "depth_range": (0.1, 0.9), "filler": "repeat"},
    },
    "tiny": {
        "prose": {"n": 2, "length": 200},
        "longgen": {"n": 1, "max_tokens": 48},
        "chat": {"n": 1, "turns": 2, "max_tokens": 24},
        "passkey": {"n": 1, "lengths": (240,), "depths": (0.5,)},
        "multikey": {"n": 1, "length": 320, "num_pairs": 2},
        "passkey-varied": {"n": 2, "length_range": (240, 560), "depth_range": (0.1, 0.9), "filler": "repeat"},
    },
}
#: Tokens read as a prompt before scoring starts (prose and retrieval episodes): the first decision comes early.
PROSE_CONTEXT = 64


@dataclass
class Episode:
    workload: str
    item_id: str
    item: ScoreItem  # with its full-cache reference
    task: tuple[int, int] | None = None  # scored-token span that must be greedy-correct (retrieval answers)
    #: Tokens of ``item`` that are the request's prompt (what free decoding is given; the rest is the answer).
    prompt_len: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_len:
            self.prompt_len = self.item.score_from


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
    #: The policy whose size bounds the agents' knob space takes (None: ``base_policy``'s). Set when an agent is
    #: warm-started from a tuned policy: the space stays the one searched around the original base.
    bounds_of: CachePolicy | None = None
    #: The observation layout the agents see (``confkv.controllers.observation.OBS_VERSIONS``; ``--observation``)
    obs_version: int = 1

    def knob_space(self) -> KnobSpace:
        """The space the agents act in, centred on ``base_policy`` (an action of 0 is that policy)."""
        return KnobSpace.for_policy(self.base_policy, bounds_of=self.bounds_of)

    def llm(self, policy: CachePolicy | None = None, **engine: Any) -> LLM:
        return LLM(self.model, policy or self.base_policy, loaded=self.loaded, **{**self.engine, **engine})


def hold_out(data: TuneData, fraction: float) -> tuple[TuneData, TuneData]:
    """Split the training episodes into those an agent trains on and those that choose which of its checkpoints is
    exported: a checkpoint chosen on the episodes it trained on is chosen partly for their luck, and on held-out
    items it may trail the policy it started from (TUNING.md).

    Every kind of item with two or more episodes gives about ``fraction`` of them (at least one), evenly spaced in
    item order, so the choice is deterministic and each kind is represented on both sides.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1) (got {fraction})")
    by_kind: dict[str, list[Episode]] = {}
    for ep in sorted(data.episodes, key=lambda e: e.item_id):
        by_kind.setdefault(ep.workload, []).append(ep)
    chosen: set[str] = set()
    for eps in by_kind.values():
        k = min(len(eps) - 1, max(1, round(len(eps) * fraction)))
        chosen.update(eps[int((i + 0.5) * len(eps) / k)].item_id for i in range(k))
    if not chosen:
        raise ValueError("too few training items to hold any out (every kind has one): raise --items-scale")
    fit = [ep for ep in data.episodes if ep.item_id not in chosen]
    select = [ep for ep in data.episodes if ep.item_id in chosen]
    return replace(data, episodes=fit), replace(data, episodes=select)


def answer_aligned_start(prompt_len: int, chunk: int, context: int = PROSE_CONTEXT) -> int:
    """The scoring start, at least ``context`` tokens in, that makes the answer (token ``prompt_len``) the first
    token of a segment (``envs.evaluate.segments``: the first scored token alone, then ``chunk`` at a time).

    So the decision before the answer's segment comes after the question has been read, as a served request's
    first decode decision comes after its prompt, whatever the item's length: otherwise the question falls inside
    the answer's segment in most items, and no controller can see it before it must decide.
    """
    if prompt_len <= context + 1:
        return min(context, prompt_len)
    return prompt_len - 1 - chunk * ((prompt_len - 1 - context) // chunk)


def scaled_sizes(model: str, scale: int = 1) -> dict[str, dict[str, Any]]:
    """The model's size class with ``scale`` times as many items of every kind.

    At scale 1 the ``mixed`` split holds 10 episodes, two of them pass keys: one item moves a policy's mean reward
    by several percent, so a search or an agent's best evaluation can pick an item's luck rather than a better
    policy. More items cost proportionally more per evaluation and nothing per PPO update.
    """
    if scale < 1:
        raise ValueError(f"items scale must be at least 1 (got {scale})")
    base = SIZES["tiny" if model == "tiny-random" else "quick"]
    return {name: {**spec, "n": spec["n"] * scale} for name, spec in base.items()}


def default_base_policy(model: str) -> CachePolicy:
    """The requirement's dynamic defaults, sized for the episodes' lengths (an eighth; a thirty-second on tiny)."""
    from confkv.bench.specs import scaled_dynamic

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
    engine = {"kv_cache_memory": kv_cache_memory} if kv_cache_memory is not None else {}
    sizes = sizes or scaled_sizes(model)
    base = base_policy or default_base_policy(model)
    names = ["prose", "longgen", "chat", "passkey", "multikey"] if workload == "mixed" else [workload]
    episodes: list[Episode] = []
    with stage(f"episodes of {workload}, {split} split", total=len(names), unit="workloads") as progress:
        if loaded is None:
            progress.set_note(f"loading {model}")
            loaded = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, seed=seed)
            progress.set_note("")
        full = LLM(model, "full", loaded=loaded, seed=seed, **engine)
        store = ReferenceStore(full)
        tok = loaded.tokenizer
        for name in names:
            spec = dict(sizes[name])
            n = spec.pop("n")
            items = make_workload(name, tok, split=split, n=n, seed=seed, **spec)
            prompt_lens: list[int] = [0] * len(items)
            if name == "prose":
                triples = [(list(it.prompt_ids), 0, min(PROSE_CONTEXT, len(it.prompt_ids) - 1)) for it in items]
                spans = [None] * len(items)
            elif name in RETRIEVAL:
                triples, spans = [], []
                for i, it in enumerate(items):
                    answer = list(tok(" " + str(it.answer), add_special_tokens=False)["input_ids"])
                    n = len(it.prompt_ids)
                    start = answer_aligned_start(n, base.compact_interval) if name in ALIGNED else min(PROSE_CONTEXT, n)
                    triples.append((list(it.prompt_ids) + answer, 0, start))
                    spans.append((n - start, n - start + len(answer)))
                    prompt_lens[i] = n
            else:
                triples = [(list(it.prompt_ids), it.max_tokens, None) for it in items]
                spans = [None] * len(items)
            refs = build_references(full, triples, store, label=f"references: {name}")
            for it, ref, span, plen in zip(items, refs, spans, prompt_lens, strict=True):
                item = ScoreItem(ref.scored_ids, ref.score_from, ref.topk)
                episodes.append(Episode(TASK_OF.get(name, name), it.item_id, item, span, plen))
            progress.update(1)
    return TuneData(model, loaded, base, episodes, workload, split, engine)
