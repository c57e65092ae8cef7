"""``confkv bench``: every policy through the same workloads, measured against the full cache.

One run loads the model once, builds (or reads) the full-cache references, then for each policy measures:

* teacher-forced quality and memory (``confkv.scoring``) on natural prose, on long generations and on multi-turn
  chats (each forced along full's own continuation): perplexity, KL to full, resident KV;
* free-generation retrieval: pass-key over a grid of lengths and depths, multi-key;
* free generation of long answers: BLEU-4 and ROUGE-L against full's text, tokens/s, and a per-token trace;
* requests/s of a batch under a fixed KV pool that holds at most a third of ``max_batch_size`` full-cache
  sequences, so memory saved turns into concurrency.

The requirement's ``dynamic`` defaults (base 1024, max 4096, 512 recent) are written for contexts of several
thousand tokens; a suite's ``scale`` multiplies the sizes (not the thresholds or the scaling factor) to fit its
context lengths. The fixed baselines get a budget equal to ``dynamic``'s measured mean resident KV (rounded up to
a block), so they are compared at equal memory; their own measured fraction is reported beside it.
"""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from confkv.bench.reference import Reference, ReferenceStore, build_references
from confkv.bench.textmetrics import bleu4, rouge_l
from confkv.bench.workloads import WorkloadItem, make_workload
from confkv.config import BUILTIN_POLICIES, CachePolicy, load_policy_file
from confkv.engine.llm import LLM
from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.kv.pool import BlockPool
from confkv.model_loader import LoadedModel, load_model
from confkv.scoring import ScoreItem, Scorer


@dataclass(frozen=True)
class SuiteSpec:
    """Workload sizes of a suite; ``scale`` multiplies the requirement's dynamic sizes."""

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
    "full": SuiteSpec(
        scale=0.5,
        passkey={"n": 2, "lengths": (1000, 2000, 4000), "depths": (0.1, 0.3, 0.5, 0.7, 0.9)},
        multikey={"n": 6, "length": 2000, "num_pairs": 10},
        prose={"n": 6, "length": 2048},
        longgen={"n": 4, "max_tokens": 1024},
        chat={"n": 4, "turns": 5, "max_tokens": 192},
        free_tokens=512,
        batch={"requests": 48, "max_batch_size": 24, "prompt_tokens": 1536, "max_tokens": 128},
    ),
}

#: For ``tiny-random`` (tests, CI): the quick suite's shape at toy sizes.
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


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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
        for name in ("prose", "longgen", "chat"):
            items = getattr(wl, name)
            triples = [(list(it.prompt_ids), it.max_tokens, it.score_from if name == "prose" else None) for it in items]
            if name == "prose":
                triples = [(p, 0, max(1, s or 1)) for p, _, s in triples]
            refs[name] = build_references(full, triples, store, use_tqdm=progress)
        return cls(loaded, model, spec, wl, refs, engine, progress)

    def llm(self, policy: CachePolicy, **engine: Any) -> LLM:
        return LLM(self.model, policy, loaded=self.loaded, **{**self.engine, **engine})

    # ----------------------------------------------------------------------------------------------- measures
    def teacher_forced(self, policy: CachePolicy) -> dict[str, Any]:
        """Perplexity on prose; KL and resident KV over prose, long generations and chats."""
        llm = self.llm(policy)
        scorer = Scorer(llm.engine)
        out: dict[str, Any] = {}
        totals = {"resident": 0.0, "full": 0.0, "kl": 0.0, "n": 0.0}
        peaks: list[float] = []
        for name in ("prose", "longgen", "chat"):
            refs = self.references[name]
            results = scorer.score(
                [ScoreItem(r.scored_ids, r.score_from, r.topk) for r in refs], use_tqdm=self.progress
            )
            if name == "prose":
                out["ppl"] = math.exp(float(-torch.cat([r.token_logprobs for r in results]).mean()))
                out["ppl_full"] = math.exp(float(-torch.cat([r.token_logprobs for r in refs]).mean()))
            part = {
                "resident": sum(float(r.resident.sum()) for r in results),
                "full": sum(float(r.full.sum()) for r in results),
                "kl": sum(float(r.kl.sum()) for r in results if r.kl is not None),
                "n": sum(r.num_tokens for r in results),
            }
            out[f"{name}_kv_fraction"] = part["resident"] / part["full"]
            out[f"{name}_kl_mean"] = part["kl"] / part["n"]
            totals = {k: totals[k] + part[k] for k in totals}
            peaks.extend(r.kv["peak_resident_tokens"] / r.kv["full_tokens"] for r in results)
        out["kv_fraction_mean"] = totals["resident"] / totals["full"]
        out["kv_fraction_peak"] = max(peaks)
        out["kl_mean"] = totals["kl"] / totals["n"]
        out["ppl_delta_rel"] = out["ppl"] / out["ppl_full"] - 1.0
        return out

    def retrieval(self, policy: CachePolicy) -> dict[str, Any]:
        llm = self.llm(policy)
        out: dict[str, Any] = {}
        for name in ("passkey", "multikey"):
            items = getattr(self.workloads, name)
            outs = llm.generate(
                [list(it.prompt_ids) for it in items],
                [SamplingParams(max_tokens=it.max_tokens) for it in items],
                use_tqdm=self.progress,
            )
            correct = [bool(it.correct(o.text)) for it, o in zip(items, outs, strict=True)]
            out[f"{name}_acc"] = sum(correct) / len(correct)
            out[f"{name}_kv_fraction"] = sum(o.kv["mean_resident_tokens"] for o in outs) / sum(
                o.prompt_tokens + (o.generated_tokens - 1) / 2 for o in outs
            )
            if name == "passkey":
                out["passkey_grid"] = [
                    {"length": it.meta.get("length"), "depth": it.meta.get("depth"), "correct": c}
                    for it, c in zip(items, correct, strict=True)
                ]
        return out

    def free_generation(self, policy: CachePolicy, full_texts: list[str] | None) -> dict[str, Any]:
        """Long answers generated freely: speed, a per-token trace, and (given full's texts) BLEU/ROUGE."""
        items = self.workloads.longgen
        llm = self.llm(policy, max_batch_size=len(items))
        n = self.spec.free_tokens
        t0 = time.perf_counter()
        outs = llm.generate(
            [list(it.prompt_ids) for it in items], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=self.progress
        )
        elapsed = time.perf_counter() - t0
        tr = outs[0].trace
        out: dict[str, Any] = {
            "tokens_per_s": sum(o.generated_tokens for o in outs) / elapsed,
            "texts": [o.text for o in outs],
            "trace": {
                "resident": tr.resident,
                "budget": tr.budget,
                "entropy": tr.entropy,
                "gap": tr.gap,
                "expanded": tr.expanded,
                "full_tokens": [outs[0].prompt_tokens + i + 1 for i in range(len(tr.resident))],
            },
            "nvml_peak_bytes": _nvml_peak(llm.engine.device),
        }
        if full_texts is not None:
            out["bleu4_vs_full"] = bleu4(out["texts"], full_texts)
            out["rougeL_vs_full"] = rouge_l(out["texts"], full_texts)
        return out

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


def _policy_list(names: list[str], policy_files: list[str]) -> list[tuple[str, CachePolicy | None]]:
    out: list[tuple[str, CachePolicy | None]] = []
    for name in names:
        if name not in BUILTIN_POLICIES:
            raise ConfkvError(f"unknown policy {name!r}; choose from {', '.join(BUILTIN_POLICIES)}")
        out.append((name, None))
    for f in policy_files:
        out.append((Path(f).stem, load_policy_file(f)))
    return out


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
    spec: SuiteSpec | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every policy and return the results (the schema ``confkv.bench.report`` writes)."""
    spec = spec or (TINY if model == "tiny-random" else SUITES[suite])
    chosen = _policy_list(policies, policy_files or [])
    t_start = time.perf_counter()
    ev = Evaluator.prepare(model, spec, device=device, dtype=dtype, cache_dir=cache_dir,
                           kv_cache_memory=kv_cache_memory, seed=seed, progress=progress)  # fmt: skip
    log(f"references ready ({time.perf_counter() - t_start:.0f}s)")
    dynamic = scaled_dynamic(spec.scale)
    # dynamic first: the fixed baselines are sized to its measured memory
    order = sorted(chosen, key=lambda p: (p[0] != "dynamic", p[0] != "full"))
    matched: int | None = None
    results: dict[str, Any] = {}
    grids: dict[str, Any] = {}
    traces: dict[str, Any] = {}
    full_gen = ev.free_generation(CachePolicy(controller="full"), None)
    full_texts = full_gen["texts"]
    for name, given in order:
        t0 = time.perf_counter()
        if given is not None:
            policy = given
        elif name == "dynamic":
            policy = dynamic
        elif name == "full":
            policy = CachePolicy(controller="full")
        else:
            policy = baseline_policy(dynamic, name, matched)
        entry: dict[str, Any] = {"policy": policy.model_dump(mode="json")}
        entry.update(ev.teacher_forced(policy))
        entry.update(ev.retrieval(policy))
        grids[name] = entry.pop("passkey_grid")
        if policy.controller == "full":
            gen = dict(
                full_gen, bleu4_vs_full=bleu4(full_texts, full_texts), rougeL_vs_full=rouge_l(full_texts, full_texts)
            )
        else:
            gen = ev.free_generation(policy, full_texts)
        traces[name] = gen.pop("trace")
        gen.pop("texts")
        entry.update(gen)
        entry.update(ev.batch_throughput(policy))
        results[name] = entry
        if name == "dynamic" and given is None:
            tokens = entry["kv_fraction_mean"] * _mean_full_tokens(ev)
            matched = max(dynamic.block_size, math.ceil(tokens / dynamic.block_size) * dynamic.block_size)
        log(
            f"{name}: kv {100 * entry['kv_fraction_mean']:.1f}% ppl {entry['ppl']:.3f} "
            f"kl {entry['kl_mean']:.4f} passkey {100 * entry['passkey_acc']:.0f}% "
            f"({time.perf_counter() - t0:.0f}s)"
        )
    full_rps = results.get("full", {}).get("requests_per_s")
    for entry in results.values():
        entry["requests_per_s_vs_full"] = entry["requests_per_s"] / full_rps if full_rps else None
    return {
        "model": model,
        "suite": suite,
        "commit": git_commit(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "settings": {
            "dynamic_scale": spec.scale,
            "dynamic": dynamic.model_dump(mode="json", include={"base_size", "max_size", "min_recent"}),
            "baseline_budget_tokens": matched,
            "workloads": {
                "passkey": spec.passkey,
                "multikey": spec.multikey,
                "prose": spec.prose,
                "longgen": spec.longgen,
                "chat": spec.chat,
                "free_tokens": spec.free_tokens,
                "batch": spec.batch,
            },
            "split": "heldout",
            "seconds": round(time.perf_counter() - t_start, 1),
        },
        "policies": results,
        "passkey_grid": grids,
        "long_trace": traces,
    }


def _mean_full_tokens(ev: Evaluator) -> float:
    """Mean keys a full cache holds over the teacher-forced tokens (to turn a fraction into a token budget)."""
    total = count = 0.0
    for refs in ev.references.values():
        for r in refs:
            n = len(r.scored_ids)
            positions = torch.arange(r.score_from, n, dtype=torch.float64)
            total += float(positions.sum())
            count += n - r.score_from
    return total / count
