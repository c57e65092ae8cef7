"""``confkv bench``: every policy through the same workloads, measured against the full cache.

One run loads the model once, builds (or reads) the full-cache references, then for each policy measures six things
(the *measures*, each reported on its own):

* teacher-forced quality and memory (``confkv.scoring``) on natural prose (``prose``), on long generations
  (``longgen``) and on multi-turn chats (``chat``), each forced along full's own continuation: perplexity, KL to
  full, resident KV;
* free-generation retrieval: pass-key over a grid of fillers, lengths and depths (``passkey``), multi-key
  (``multikey``);
* free generation of long answers (``longgen_free``): BLEU-4 and ROUGE-L against full's text, tokens/s, and a
  per-token trace;
* (quick suite) requests/s of a batch under a fixed KV pool that holds at most a third of ``max_batch_size``
  full-cache sequences, so memory saved turns into concurrency.

The requirement's ``dynamic`` defaults (base 1024, max 4096, 512 recent) are written for contexts of several
thousand tokens; a suite's ``scale`` multiplies the sizes (not the thresholds or the scaling factor) to fit its
context lengths.

**Equal memory.** A confidence-driven policy's memory is whatever it decides, so the fixed baselines are sized
after it: each *variant* (the built-in ``dynamic`` and every ``--policy-file`` whose budget moves, ``dynamic`` or
``learned``) is measured first, then every fixed baseline is run once per variant with, for each measure, the
budget whose predicted mean resident KV over that measure's steps equals the variant's measured mean
(``matched_budget``). Matching per measure rather than once for the suite matters because a variant spends
unevenly (little on confident prose, more on a long generation): a single suite-wide budget would give a baseline
more memory than the variant on one workload and less on another, and neither comparison would be at equal memory.
Peak memory is reported beside the mean and is not matched: ``dynamic`` reads a prompt at up to ``max_size``
before it has a signal, which is its design, and the peak columns show what that costs.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch

from confkv.bench.reference import Reference, ReferenceStore, build_references
from confkv.bench.textmetrics import bleu4, rouge_l
from confkv.bench.workloads import WorkloadItem, make_workload
from confkv.config import BUILTIN_POLICIES, CachePolicy
from confkv.engine.params import SamplingParams
from confkv.engine.sequence import RequestOutput
from confkv.errors import ConfkvError
from confkv.kv.pool import BlockPool
from confkv.llm import LLM
from confkv.model_loader import LoadedModel, load_model
from confkv.policy_source import load_policy
from confkv.scoring import ScoreItem, Scorer, ScoreResult

#: The measures of a suite, in report order; each has its own resident KV and, for baselines, its own budget.
TEACHER_FORCED: tuple[str, ...] = ("prose", "longgen", "chat")
RETRIEVAL: tuple[str, ...] = ("passkey", "multikey")
FREE_GENERATION = "longgen_free"
MEASURES: tuple[str, ...] = (*TEACHER_FORCED, *RETRIEVAL, FREE_GENERATION)
#: Built-in policies with one fixed budget: the baselines a variant is compared with.
FIXED_BASELINES: tuple[str, ...] = ("window", "streaming", "h2o", "snapkv")
#: Controllers whose budget moves with the sequence: a policy file with one of them gets its own baselines.
VARIANT_CONTROLLERS: tuple[str, ...] = ("dynamic", "learned")


@dataclass(frozen=True)
class SuiteSpec:
    """Workload sizes of a suite; ``scale`` multiplies the requirement's dynamic sizes.

    ``batch`` empty: requests/s is not measured (``confkv bench --suite throughput`` measures serving properly).
    """

    scale: float
    passkey: dict[str, Any]
    multikey: dict[str, Any]
    prose: dict[str, Any]
    longgen: dict[str, Any]
    chat: dict[str, Any]
    free_tokens: int
    batch: dict[str, Any] = field(default_factory=dict)


SUITES: dict[str, SuiteSpec] = {
    "quick": SuiteSpec(
        scale=0.125,
        passkey={"n": 1, "lengths": (1024,), "depths": (0.1, 0.5, 0.9)},
        multikey={"n": 2, "length": 768, "num_pairs": 4},
        prose={"n": 2, "length": 1024},
        longgen={"n": 2, "max_tokens": 384},
        chat={"n": 2, "turns": 3, "max_tokens": 96},
        free_tokens=320,
        batch={"requests": 6, "max_batch_size": 6, "prompt_tokens": 448, "max_tokens": 32},
    ),
    # Items of 2,000-4,000 tokens and the requirement's sizes divided by 4 (base 256, max 1024, 128 recent): every
    # item is longer than max_size, so even dynamic at its ceiling evicts, and a context 2-4x max_size is the ratio
    # the defaults (max 4096) have on contexts of 8-16k tokens. Divided by 2 (max 2048) a 2,000-token prompt would be
    # read whole and the long generations (about 1,100 tokens) would hardly evict.
    "standard": SuiteSpec(
        scale=0.25,
        passkey={"n": 1, "lengths": (2000, 4000), "depths": (0.1, 0.5, 0.9), "filler": ("repeat", "prose")},
        multikey={"n": 4, "length": 2500, "num_pairs": 6},
        prose={"n": 4, "length": 3000},
        longgen={"n": 4, "max_tokens": 1024},
        chat={"n": 4, "turns": 6, "max_tokens": 256, "length": 3000},
        free_tokens=1024,
    ),
}

#: For ``tiny-random`` (tests, CI): each suite's shape at toy sizes (max_size 128 at scale 1/32, items longer).
TINY = SuiteSpec(
    scale=1 / 32,
    passkey={"n": 1, "lengths": (400,), "depths": (0.2, 0.8)},
    multikey={"n": 1, "length": 400, "num_pairs": 4},
    prose={"n": 1, "length": 320},
    longgen={"n": 1, "max_tokens": 64},
    chat={"n": 1, "turns": 2, "max_tokens": 32},
    free_tokens=24,
    batch={"requests": 4, "max_batch_size": 3, "prompt_tokens": 256, "max_tokens": 16},
)
TINY_STANDARD = SuiteSpec(
    scale=1 / 32,
    passkey={"n": 1, "lengths": (300, 500), "depths": (0.2, 0.8), "filler": ("repeat", "prose")},
    multikey={"n": 1, "length": 400, "num_pairs": 4},
    prose={"n": 2, "length": 320},
    longgen={"n": 2, "max_tokens": 160},
    chat={"n": 1, "turns": 3, "max_tokens": 32, "length": 800},
    free_tokens=160,
)
TINY_SUITES: dict[str, SuiteSpec] = {"quick": TINY, "standard": TINY_STANDARD}


def suite_spec(model: str, suite: str) -> SuiteSpec:
    """The sizes ``confkv bench --suite`` runs: toy ones on ``tiny-random``, so CI exercises every code path."""
    table = TINY_SUITES if model == "tiny-random" else SUITES
    if suite not in table:
        raise ConfkvError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    return table[suite]


def scaled_dynamic(scale: float) -> CachePolicy:
    """The requirement's dynamic policy with its sizes multiplied by ``scale`` (thresholds unchanged)."""
    d = CachePolicy()
    bs = d.block_size
    size = lambda v: max(bs, round(v * scale / bs) * bs)  # noqa: E731
    return d.replace(base_size=size(d.base_size), max_size=size(d.max_size), min_recent=size(d.min_recent))


def baseline_policy(dynamic: CachePolicy, name: str, budget: int | None = None) -> CachePolicy:
    """A fixed baseline beside ``dynamic``: ``budget`` tokens (default twice its base), half of them recent."""
    budget = budget or 2 * dynamic.base_size
    return dynamic.replace(
        controller=name, scorer=None, base_size=budget, max_size=budget, min_recent=max(dynamic.block_size, budget // 2)
    )


def git_commit(short: bool = True, cwd: str | Path | None = None) -> str:
    """The commit HEAD names in the checkout at ``cwd`` (default: the working directory), abbreviated or in full;
    ``unknown`` outside a checkout or without git."""
    cmd = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _nvml_peak(device: torch.device) -> int | None:
    """Device memory in use now (NVML), when a GPU runs the benchmark; ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # pynvml missing or no driver: the column stays empty
        return None


# ------------------------------------------------------------------------------------------------ resident memory


@dataclass
class Usage:
    """Resident KV of one measure: the mean over the steps whose output is measured, the peak over whole items.

    ``mode`` says how those steps are computed, which is what a fixed budget's resident count depends on:
    ``chunked`` (teacher-forced, ``compact_interval`` tokens per pass) or ``decode`` (one token per step).
    ``positions`` holds, per measured step, the keys a full cache would hold: the matching solves over them.
    """

    mode: Literal["chunked", "decode"]
    resident: float = 0.0
    full: float = 0.0
    steps: int = 0
    items: int = 0
    peak_tokens: int = 0
    peak_fraction: float = 0.0
    peak_bytes: int = 0
    positions: list[torch.Tensor] = field(default_factory=list)

    def _item(self, kv: Mapping[str, Any], length: int) -> None:
        peak = int(kv.get("peak_resident_tokens") or 0)
        self.items += 1
        self.peak_tokens = max(self.peak_tokens, peak)
        self.peak_fraction = max(self.peak_fraction, peak / max(1, length))
        self.peak_bytes = max(self.peak_bytes, int(kv.get("peak_device_bytes") or 0))

    def add_scored(self, result: ScoreResult, length: int) -> None:
        """A teacher-forced item of ``length`` tokens: every scored token is a step."""
        self.resident += float(result.resident.sum())
        self.full += float(result.full.sum())
        self.steps += result.num_tokens
        self.positions.append(result.full.to(torch.float64))
        self._item(result.kv, length)

    def add_generated(self, out: RequestOutput) -> None:
        """A generated item: every token after the first is a step.

        The first token comes out of the prompt's last prefill chunk, so what it attends over is the prefill size
        (``max_size`` plus that chunk for every evicting policy), not the budget: it counts in the peak only.
        """
        resident = out.trace.resident[1:]
        positions = torch.arange(1, len(resident) + 1, dtype=torch.float64) + out.prompt_tokens
        self.resident += float(sum(resident))
        self.full += float(positions.sum())
        self.steps += len(resident)
        self.positions.append(positions)
        self._item(out.kv, out.prompt_tokens + out.generated_tokens)

    @property
    def fraction_mean(self) -> float | None:
        return self.resident / self.full if self.full else None

    def summary(self) -> dict[str, Any]:
        """The JSON fields of a measure's memory."""
        return {
            "kv_fraction_mean": self.fraction_mean,
            "kv_fraction_peak": self.peak_fraction if self.items else None,
            "kv_mean_tokens": self.resident / self.steps if self.steps else None,
            "kv_peak_tokens": self.peak_tokens if self.items else None,
            "kv_peak_device_bytes": self.peak_bytes if self.items else None,
            "steps": self.steps,
            "items": self.items,
        }

    @staticmethod
    def combine(usages: Iterable[Usage]) -> dict[str, Any]:
        """The suite-wide memory: means over every measured step, peaks over every item."""
        usages = list(usages)
        total = Usage("chunked")
        for u in usages:
            total.resident += u.resident
            total.full += u.full
            total.steps += u.steps
            total.items += u.items
            total.peak_tokens = max(total.peak_tokens, u.peak_tokens)
            total.peak_fraction = max(total.peak_fraction, u.peak_fraction)
            total.peak_bytes = max(total.peak_bytes, u.peak_bytes)
        return total.summary()


def fixed_offset(mode: str, policy: CachePolicy) -> float:
    """Mean tokens a fixed budget's policy holds above its budget at a measured step, once the sequence is longer.

    Eviction moves whole blocks when the budget is exceeded, so right after it a sequence holds between
    ``budget - block_size + 1`` and ``budget`` tokens (``(block_size - 1) / 2`` below on average). Decoding adds one
    token per step and evicts again as soon as the budget is passed (a cycle from ``budget - block_size + 2`` to
    ``budget + 1``); teacher forcing adds a chunk of ``compact_interval`` tokens, whose i-th token attends over
    ``i`` more, before the next eviction.
    """
    bs = policy.block_size
    if mode == "decode":
        return 1.5 - bs / 2
    return (policy.compact_interval + 1) / 2 - (bs - 1) / 2


def matched_budget(usages: Sequence[Usage], target: float, policy: CachePolicy) -> int:
    """The fixed budget (tokens) whose policy is predicted to hold ``target`` keys in all over ``usages``' steps.

    A fixed policy at budget ``B`` holds ``min(p, B + offset)`` keys at a step where a full cache holds ``p``
    (``fixed_offset``); the sum over the measured steps rises with ``B``, so bisection finds the ``B`` that gives the
    variant's measured total. The measured result of each baseline is reported beside the variant's, so a
    prediction that misses shows, and the report flags a gap beyond ``confkv.bench.report.MEMORY_TOLERANCE``.
    """
    pairs = [(torch.cat(u.positions), fixed_offset(u.mode, policy)) for u in usages if u.positions and u.steps]
    floor = 2 * policy.block_size
    if not pairs:
        return max(floor, 2 * policy.base_size)
    top = int(max(float(p.max()) for p, _ in pairs)) + policy.block_size

    def held(budget: int) -> float:
        return sum(float(p.clamp(max=budget + off).sum()) for p, off in pairs)

    if held(top) <= target:
        return top
    lo, hi = 1, top  # held(hi) > target; find the smallest budget that holds at least the target
    while lo < hi:
        mid = (lo + hi) // 2
        if held(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    best = lo if lo <= 1 or abs(held(lo) - target) <= abs(held(lo - 1) - target) else lo - 1
    return max(floor, best)


# ------------------------------------------------------------------------------------------------------- workloads


@dataclass
class Workloads:
    passkey: list[WorkloadItem]
    multikey: list[WorkloadItem]
    prose: list[WorkloadItem]
    longgen: list[WorkloadItem]
    chat: list[WorkloadItem]


def build_workloads(tokenizer: Any, spec: SuiteSpec, split: str, seed: int) -> Workloads:
    def make(name: str) -> list[WorkloadItem]:
        sizes = dict(getattr(spec, name))
        n = sizes.pop("n")
        return make_workload(name, tokenizer, split=split, n=n, seed=seed, **sizes)

    return Workloads(*(make(name) for name in ("passkey", "multikey", "prose", "longgen", "chat")))


@dataclass
class Evaluator:
    """Measures policies on fixed workloads against stored full-cache references (also used by the tuner)."""

    loaded: LoadedModel
    model: str
    spec: SuiteSpec
    workloads: Workloads
    references: dict[str, list[Reference]]
    #: Engine settings every measured engine gets unless a measure sets its own (``device``, ``kv_cache_memory``).
    engine: dict[str, Any] = field(default_factory=dict)
    progress: bool = False

    @classmethod
    def prepare(
        cls,
        model: str,
        spec: SuiteSpec,
        *,
        split: str = "heldout",
        seed: int = 0,
        device: str | None = None,
        dtype: str = "auto",
        cache_dir: str | None = None,
        kv_cache_memory: int | str | None = None,
        loaded: LoadedModel | None = None,
        reference_root: str | Path | None = None,
        progress: bool = False,
    ) -> Evaluator:
        """Load the model (the engine's device rule: ``--device``, else CUDA when present), build the workloads and
        the full-cache references."""
        loaded = loaded or load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, seed=seed)
        engine = {"seed": seed, **({"kv_cache_memory": kv_cache_memory} if kv_cache_memory is not None else {})}
        full = LLM(model, "full", loaded=loaded, **engine)
        wl = build_workloads(loaded.tokenizer, spec, split, seed)
        store = ReferenceStore(full, reference_root)
        refs: dict[str, list[Reference]] = {}
        for name in TEACHER_FORCED:
            items = getattr(wl, name)
            triples = [(list(it.prompt_ids), it.max_tokens, it.score_from if name == "prose" else None) for it in items]
            if name == "prose":
                triples = [(p, 0, max(1, s or 1)) for p, _, s in triples]
            refs[name] = build_references(full, triples, store, use_tqdm=progress)
        return cls(loaded, model, spec, wl, refs, engine, progress)

    def llm(self, policy: CachePolicy, **engine: Any) -> LLM:
        return LLM(self.model, policy, loaded=self.loaded, **{**self.engine, **engine})

    # ----------------------------------------------------------------------------------------------- measures
    def score_workload(self, policy: CachePolicy, name: str) -> tuple[dict[str, Any], Usage]:
        """One teacher-forced workload: KL to full per token (and perplexity on prose), and its resident KV."""
        refs = self.references[name]
        results = Scorer(self.llm(policy).engine).score(
            [ScoreItem(r.scored_ids, r.score_from, r.topk) for r in refs], use_tqdm=self.progress
        )
        usage = Usage("chunked")
        for ref, res in zip(refs, results, strict=True):
            usage.add_scored(res, len(ref.scored_ids))
        kl_sum = sum(float(r.kl.sum()) for r in results if r.kl is not None)
        tokens = sum(r.num_tokens for r in results)
        out: dict[str, Any] = {"kl_mean": kl_sum / tokens, "kl_sum": kl_sum, "tokens": tokens}
        if name == "prose":
            out["ppl"] = math.exp(float(-torch.cat([r.token_logprobs for r in results]).mean()))
            out["ppl_full"] = math.exp(float(-torch.cat([r.token_logprobs for r in refs]).mean()))
            out["ppl_delta_rel"] = out["ppl"] / out["ppl_full"] - 1.0
        return out, usage

    def retrieve(self, policy: CachePolicy, name: str) -> tuple[dict[str, Any], Usage]:
        """One retrieval workload generated freely: accuracy (per filler for pass-key), its grid, resident KV."""
        items = getattr(self.workloads, name)
        outs = self.llm(policy).generate(
            [list(it.prompt_ids) for it in items],
            [SamplingParams(max_tokens=it.max_tokens) for it in items],
            use_tqdm=self.progress,
        )
        usage = Usage("decode")
        for o in outs:
            usage.add_generated(o)
        correct = [bool(it.correct(o.text)) for it, o in zip(items, outs, strict=True)]
        out: dict[str, Any] = {
            "acc": sum(correct) / len(correct),
            # the engine's own mean (every generated token, the first included), kept for older readers
            "kv_fraction_engine": sum(o.kv["mean_resident_tokens"] for o in outs)
            / sum(o.prompt_tokens + (o.generated_tokens - 1) / 2 for o in outs),
        }
        if name == "passkey":
            out["grid"] = [
                {
                    "length": it.meta.get("length"),
                    "depth": it.meta.get("depth"),
                    "filler": it.meta.get("filler", "repeat"),
                    "correct": c,
                }
                for it, c in zip(items, correct, strict=True)
            ]
            by_filler: dict[str, list[bool]] = {}
            for cell in out["grid"]:
                by_filler.setdefault(cell["filler"], []).append(cell["correct"])
            out["acc_by_filler"] = {k: sum(v) / len(v) for k, v in by_filler.items()}
        return out, usage

    def generate_long(self, policy: CachePolicy, full_texts: list[str] | None) -> tuple[dict[str, Any], Usage]:
        """Long answers generated freely (EOS ignored, so every policy writes the same number of tokens): speed, a
        per-token trace, resident KV and, given full's texts, BLEU-4 and ROUGE-L against them."""
        items = self.workloads.longgen
        llm = self.llm(policy, max_batch_size=len(items))
        n = self.spec.free_tokens
        t0 = time.perf_counter()
        outs = llm.generate(
            [list(it.prompt_ids) for it in items], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=self.progress
        )
        elapsed = time.perf_counter() - t0
        usage = Usage("decode")
        for o in outs:
            usage.add_generated(o)
        tr = outs[0].trace
        out: dict[str, Any] = {
            "tokens_per_s": sum(o.generated_tokens for o in outs) / elapsed,
            "seconds": elapsed,
            "texts": [o.text for o in outs],
            "trace": {
                "resident": tr.resident,
                "budget": tr.budget,
                "entropy": tr.entropy,
                "gap": tr.gap,
                "expanded": tr.expanded,
                # token i is computed over the prompt and the i tokens before it (the first in the prompt's last chunk)
                "full_tokens": [outs[0].prompt_tokens + i for i in range(len(tr.resident))],
            },
            "nvml_peak_bytes": _nvml_peak(llm.engine.device),
        }
        if full_texts is not None:
            out["bleu4_vs_full"] = bleu4(out["texts"], full_texts)
            out["rougeL_vs_full"] = rouge_l(out["texts"], full_texts)
        return out, usage

    # ------------------------------------------------------------------------------------- serving measure
    def batch_throughput(self, policy: CachePolicy) -> dict[str, Any]:
        """Requests/s under a KV pool that holds at most a third of ``max_batch_size`` full-cache sequences."""
        b = self.spec.batch
        prose = self.workloads.prose
        base = [list(it.prompt_ids) for it in prose]
        prompts = []
        for i in range(b["requests"]):
            ids = base[i % len(base)]
            off = (i * 37) % max(1, len(ids) - b["prompt_tokens"])
            prompts.append(ids[off : off + b["prompt_tokens"]])
        block_bytes = BlockPool.bytes_per_block_for(
            *BlockPool.geometry(self.loaded.model.config), policy.block_size, next(self.loaded.model.parameters()).dtype
        )
        per_seq = -(-(b["prompt_tokens"] + b["max_tokens"]) // policy.block_size)
        fits = max(1, b["max_batch_size"] // 3)
        pool_bytes = (fits * per_seq + 1) * block_bytes
        llm = self.llm(policy, kv_cache_memory=pool_bytes, max_batch_size=b["max_batch_size"])
        t0 = time.perf_counter()
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=b["max_tokens"], ignore_eos=True), use_tqdm=self.progress
        )
        elapsed = time.perf_counter() - t0
        return {
            "requests_per_s": len(outs) / elapsed,
            "batch_pool_blocks": llm.engine.pool.num_blocks,
            "batch_preemptions": llm.engine.scheduler.preemptions,
        }


# ------------------------------------------------------------------------------------------------ one policy's run


@dataclass
class PolicyRun:
    """What measuring one policy gives: its results entry, the usage of each measure (to size baselines after it),
    its pass-key grid and its long-generation trace."""

    entry: dict[str, Any]
    usages: dict[str, Usage]
    grid: list[dict[str, Any]]
    trace: dict[str, Any]


def measure_policy(
    ev: Evaluator,
    policies: Mapping[str, CachePolicy],
    overall: CachePolicy,
    full_gen: tuple[dict[str, Any], Usage],
    log: Callable[[str], None] = print,
    label: str = "",
) -> PolicyRun:
    """Every measure of one policy: ``policies`` gives the policy of each measure (a baseline's budget differs per
    measure), ``overall`` the one recorded in the entry and used for the batch. ``full_gen`` is full's own long
    generation: the reference for BLEU/ROUGE, and full's measure when the policy is full."""
    work: dict[str, dict[str, Any]] = {}
    usages: dict[str, Usage] = {}
    entry: dict[str, Any] = {"policy": overall.model_dump(mode="json")}
    kl = tokens = 0.0
    for name in TEACHER_FORCED:
        t0 = time.perf_counter()
        metrics, usages[name] = ev.score_workload(policies[name], name)
        kl += metrics.pop("kl_sum")
        tokens += metrics.pop("tokens")
        work[name] = {**metrics, "seconds": time.perf_counter() - t0}
        if name == "prose":
            entry.update({k: metrics[k] for k in ("ppl", "ppl_full", "ppl_delta_rel")})
        entry[f"{name}_kv_fraction"] = usages[name].fraction_mean
        entry[f"{name}_kl_mean"] = metrics["kl_mean"]
    entry["kl_mean"] = kl / tokens if tokens else None
    grid: list[dict[str, Any]] = []
    for name in RETRIEVAL:
        t0 = time.perf_counter()
        metrics, usages[name] = ev.retrieve(policies[name], name)
        grid = metrics.pop("grid", grid)
        metrics.pop("kv_fraction_engine")
        work[name] = {**metrics, "seconds": time.perf_counter() - t0}
        entry[f"{name}_acc"] = metrics["acc"]
        entry[f"{name}_kv_fraction"] = usages[name].fraction_mean
    free_policy = policies[FREE_GENERATION]
    if free_policy.controller == "full":  # full's own generation is the reference: measured once, before any policy
        gen, usages[FREE_GENERATION] = dict(full_gen[0]), full_gen[1]
        texts = gen["texts"]
        gen.update(bleu4_vs_full=bleu4(texts, texts), rougeL_vs_full=rouge_l(texts, texts))
    else:
        gen, usages[FREE_GENERATION] = ev.generate_long(free_policy, full_gen[0]["texts"])
    trace = gen.pop("trace")
    gen.pop("texts")
    work[FREE_GENERATION] = {k: gen.get(k) for k in ("bleu4_vs_full", "rougeL_vs_full", "tokens_per_s")}
    work[FREE_GENERATION]["seconds"] = gen.pop("seconds")
    entry.update(gen)
    t0 = time.perf_counter()
    if ev.spec.batch:
        entry.update(ev.batch_throughput(overall))
    else:
        entry.update(requests_per_s=None, batch_pool_blocks=None, batch_preemptions=None)
    batch_seconds = time.perf_counter() - t0
    total = Usage.combine(usages.values())
    entry.update({k: total[k] for k in ("kv_fraction_mean", "kv_fraction_peak", "kv_mean_tokens", "kv_peak_tokens")})
    entry["kv_peak_device_bytes"] = total["kv_peak_device_bytes"]
    entry["workloads"] = {name: {**usages[name].summary(), **work[name]} for name in MEASURES}
    entry["seconds"] = sum(w["seconds"] for w in work.values()) + batch_seconds
    log(
        f"{label}: kv mean {100 * (entry['kv_fraction_mean'] or 0):.1f}% peak "
        f"{100 * (entry['kv_fraction_peak'] or 0):.1f}%, ppl {entry['ppl']:.3f}, kl {entry['kl_mean']:.4f}, "
        f"pass-key {100 * entry['passkey_acc']:.0f}%, multi-key {100 * entry['multikey_acc']:.0f}%, BLEU-4 "
        f"{entry['bleu4_vs_full']:.1f} ({entry['seconds']:.0f}s)"
    )
    return PolicyRun(entry, usages, grid, trace)


@dataclass(frozen=True)
class PlannedPolicy:
    """One row of a run: its name, the policy, and (for a baseline) the variant whose memory it is matched to."""

    name: str
    policy: CachePolicy
    matched_to: str | None = None


def row_name(stem: str, taken: set[str]) -> str:
    """A policy file's row name: its stem, numbered when taken (``dynamic.yaml`` beside the built-in ``dynamic``,
    or the same file twice, keeps both rows); added to ``taken``."""
    name, i = stem, 2
    while name in taken:
        name, i = f"{stem}-{i}", i + 1
    taken.add(name)
    return name


def plan_policies(names: list[str], policy_files: list[str], dynamic: CachePolicy) -> list[PlannedPolicy]:
    """The run's policies in order: ``full``; each variant followed by its fixed baselines; fixed policy files.

    A variant is the built-in ``dynamic`` (when named) or a policy file whose controller moves its budget. The
    baselines named in ``names`` run once per variant: under their own name for the built-in ``dynamic``, as
    ``window@tuned`` for a file ``tuned.yaml``. Without any variant they run at the default budget (twice
    dynamic's base), as they always did.
    """
    for name in names:
        if name not in BUILTIN_POLICIES:
            raise ConfkvError(f"unknown policy {name!r}; choose from {', '.join(BUILTIN_POLICIES)}")
    taken = set(names)
    files = [(row_name(Path(f).stem, taken), load_policy(f)) for f in policy_files]
    plan: list[PlannedPolicy] = []
    if "full" in names:
        plan.append(PlannedPolicy("full", CachePolicy(controller="full")))
    variants = [("dynamic", dynamic, True)] if "dynamic" in names else []
    variants += [(n, p, False) for n, p in files if p.controller in VARIANT_CONTROLLERS]
    baselines = [n for n in names if n in FIXED_BASELINES]
    for vname, vpolicy, builtin in variants:
        plan.append(PlannedPolicy(vname, vpolicy))
        for b in baselines:
            plan.append(PlannedPolicy(b if builtin else f"{b}@{vname}", baseline_policy(vpolicy, b), vname))
    if not variants:
        plan += [PlannedPolicy(b, baseline_policy(dynamic, b)) for b in baselines]
    plan += [PlannedPolicy(n, p) for n, p in files if p.controller not in VARIANT_CONTROLLERS]
    return plan


def run_suite(
    model: str,
    suite: str,
    policies: list[str],
    *,
    policy_files: list[str] | None = None,
    device: str | None = None,
    dtype: str = "auto",
    cache_dir: str | None = None,
    kv_cache_memory: int | str | None = None,
    seed: int = 0,
    split: str = "heldout",
    spec: SuiteSpec | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every policy and return the results (the schema ``confkv.bench.report`` writes)."""
    from confkv.bench.report import equal_memory_comparisons

    spec = spec or suite_spec(model, suite)
    dynamic = scaled_dynamic(spec.scale)
    plan = plan_policies(policies, policy_files or [], dynamic)
    est = estimate_seconds(spec, len(plan))
    if model != "tiny-random":
        log(f"estimated run time on a 2-core CPU: {est['low'] / 60:.0f}-{est['high'] / 60:.0f} min")
    t_start = time.perf_counter()
    ev = Evaluator.prepare(model, spec, device=device, dtype=dtype, cache_dir=cache_dir,
                           kv_cache_memory=kv_cache_memory, seed=seed, split=split, progress=progress)  # fmt: skip
    t_refs = time.perf_counter() - t_start
    log(f"references ready ({t_refs:.0f}s)")
    full_gen = ev.generate_long(CachePolicy(controller="full"), None)
    runs: dict[str, PolicyRun] = {}
    budgets: dict[str, dict[str, int]] = {}
    for planned in plan:
        policy, per_measure = planned.policy, None
        if planned.matched_to is not None:
            variant = runs[planned.matched_to]
            vpolicy = next(p.policy for p in plan if p.name == planned.matched_to)
            if planned.matched_to not in budgets:
                all_usages = list(variant.usages.values())
                budgets[planned.matched_to] = {
                    m: matched_budget([variant.usages[m]], variant.usages[m].resident, vpolicy) for m in MEASURES
                } | {"overall": matched_budget(all_usages, sum(u.resident for u in all_usages), vpolicy)}
                log(
                    f"baselines of {planned.matched_to}, matched to its mean resident KV: {budgets[planned.matched_to]}"
                )
            b = budgets[planned.matched_to]
            controller = planned.policy.controller
            per_measure = {m: baseline_policy(vpolicy, controller, b[m]) for m in MEASURES}
            policy = baseline_policy(vpolicy, controller, b["overall"])
        run = measure_policy(
            ev, per_measure or dict.fromkeys(MEASURES, policy), policy, full_gen, log=log, label=planned.name
        )
        run.entry["matched_to"] = planned.matched_to
        run.entry["budgets"] = {m: budgets[planned.matched_to][m] for m in MEASURES} if per_measure else None
        for m in MEASURES:
            run.entry["workloads"][m]["budget_tokens"] = run.entry["budgets"][m] if per_measure else None
        runs[planned.name] = run
    results: dict[str, Any] = {name: run.entry for name, run in runs.items()}
    full_rps = results.get("full", {}).get("requests_per_s")
    for entry in results.values():
        rps = entry.get("requests_per_s")
        entry["requests_per_s_vs_full"] = rps / full_rps if full_rps and rps is not None else None
    seconds = time.perf_counter() - t_start
    out: dict[str, Any] = {
        "model": model,
        "suite": suite,
        "commit": git_commit(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "settings": {
            "dynamic_scale": spec.scale,
            "dynamic": dynamic.model_dump(mode="json", include={"base_size", "max_size", "min_recent"}),
            "baseline_budget_tokens": budgets.get("dynamic", {}).get("overall"),
            "baseline_budgets": budgets,
            "workloads": {
                "passkey": spec.passkey,
                "multikey": spec.multikey,
                "prose": spec.prose,
                "longgen": spec.longgen,
                "chat": spec.chat,
                "free_tokens": spec.free_tokens,
                "batch": spec.batch,
            },
            "split": split,
            "seconds": round(seconds, 1),
            "seconds_references": round(t_refs, 1),
            "seconds_per_policy": {name: round(run.entry["seconds"], 1) for name, run in runs.items()},
            # what the suite was sized by: the estimate holds for smollm2-135m on the 2-core CPU only
            "estimated_seconds_smollm2_cpu": {k: round(est[k]) for k in ("low", "high")}
            if model == "smollm2-135m"
            else None,
        },
        "policies": results,
        "passkey_grid": {name: run.grid for name, run in runs.items()},
        "long_trace": {name: run.trace for name, run in runs.items()},
    }
    out["comparisons"] = equal_memory_comparisons(out)
    return out


# ----------------------------------------------------------------------------------------------- run-time estimate

#: Speeds of the engine on this repository's 2-core CPU with smollm2-135m in fp32: prompt tokens read per second,
#: and tokens decoded per second by batch size (the whole batch's tokens).
CPU_PREFILL_TOKENS_PER_S = 400.0
CPU_DECODE_TOKENS_PER_S: tuple[tuple[int, float], ...] = ((1, 15.0), (4, 40.0), (16, 100.0))
#: The quick suite's measured run time with cached references (BENCHMARKS.md, six policies): it calibrates the
#: overheads the rates leave out (engine set-up, per-chunk Python work, recall and recomputation).
QUICK_MEASURED_SECONDS = 500.0
_LONGGEN_PROMPT_TOKENS = 70  # the chat template plus one request
_SHORT_CHAT_TOKENS_PER_TURN = 45  # a small-talk pair with its template tokens


def _decode_rate(batch: int) -> float:
    """Decode tokens/s at ``batch``, interpolated on log2(batch) between the measured points (flat beyond)."""
    pts = CPU_DECODE_TOKENS_PER_S
    if batch <= pts[0][0]:
        return pts[0][1]
    for (b0, r0), (b1, r1) in itertools.pairwise(pts):
        if batch <= b1:
            w = (math.log2(batch) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return r0 + w * (r1 - r0)
    return pts[-1][1]


def _raw_seconds(spec: SuiteSpec) -> tuple[float, float]:
    """(seconds per policy, seconds for the references) from the rates alone."""
    pk, mk, pr, lg, ch = spec.passkey, spec.multikey, spec.prose, spec.longgen, spec.chat
    fillers = pk.get("filler", "repeat")
    n_fillers = 1 if isinstance(fillers, str) else len(fillers)
    pk_items = pk["n"] * n_fillers * len(pk["lengths"]) * len(pk["depths"])
    pk_tokens = pk["n"] * n_fillers * len(pk["depths"]) * sum(pk["lengths"])
    chat_prompt = ch.get("length") or ch["turns"] * _SHORT_CHAT_TOKENS_PER_TURN
    prefill = (
        pk_tokens  # pass-key prompts
        + mk["n"] * mk["length"]  # multi-key prompts
        + pr["n"] * pr["length"]  # prose, teacher-forced
        + lg["n"] * (_LONGGEN_PROMPT_TOKENS + lg["max_tokens"])  # full's answers, teacher-forced
        + ch["n"] * (chat_prompt + ch["max_tokens"])  # chats read, then full's answers teacher-forced
    )
    decode = 8 * pk_items / _decode_rate(min(32, pk_items)) + 8 * mk["n"] / _decode_rate(mk["n"])
    decode += spec.free_tokens * lg["n"] / _decode_rate(lg["n"])
    b = spec.batch
    if b:
        prefill += b["requests"] * b["prompt_tokens"]
        decode += b["requests"] * b["max_tokens"] / _decode_rate(b["max_batch_size"])
    per_policy = prefill / CPU_PREFILL_TOKENS_PER_S + decode
    refs = lg["n"] * lg["max_tokens"] / _decode_rate(lg["n"]) + ch["n"] * ch["max_tokens"] / _decode_rate(ch["n"])
    refs += (ch["n"] * chat_prompt + pr["n"] * pr["length"]) / CPU_PREFILL_TOKENS_PER_S
    refs += (lg["n"] * (_LONGGEN_PROMPT_TOKENS + lg["max_tokens"]) + ch["n"] * (chat_prompt + ch["max_tokens"])) / (
        CPU_PREFILL_TOKENS_PER_S
    )
    return per_policy, refs


def estimate_seconds(spec: SuiteSpec, num_policies: int, *, references: bool = True) -> dict[str, float]:
    """How long a suite takes on this repository's 2-core CPU with smollm2-135m: a range, not a promise.

    ``low`` is the measured token rates applied to the suite's sizes; ``high`` scales that by how far the quick
    suite's measured run time exceeded the same estimate (overheads the rates leave out). ``references``: include
    building the full-cache references, which a second run reads from disk.
    """
    per_policy, refs = _raw_seconds(spec)
    quick_per_policy, _ = _raw_seconds(SUITES["quick"])
    factor = max(1.0, QUICK_MEASURED_SECONDS / (6 * quick_per_policy))
    low = num_policies * per_policy + (refs if references else 0.0)
    return {
        "per_policy": per_policy,
        "references": refs,
        "calibration": factor,
        "low": low,
        "high": low * factor,
    }
