"""``confkv bench --suite longgen``: N long answers per policy, and what each policy does along them (issue 34).

The throughput suite's long-generation requests (``streams.make_longgen_requests``: short asks for stories,
reports, documentation and code, ``ignore_eos``) go through one engine per policy, all submitted at once, from the
pool the throughput suite gives ``full`` (``full_fits`` of the longest request), on demand. Per run and per
generated position it records the resident KV, the budget, the entropy and top-1/top-2 gap the controller saw,
whether the budget expanded (a recall), and the time of the step that made the token; ``curves_report`` plots the
median and the 10-90% band of each against position, every policy on one page, with the summary beside it: requests
and tokens per second, the mean and peak resident KV as a share of what ``full`` holds at the same positions, and
BLEU-4 and ROUGE-L of the answers against ``full``'s.

``--runs N`` sets N; 1,000 is the requirement's size (a GPU run). On a CPU the stream's outputs are 256-512 tokens.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from confkv.bench.provenance import git_commit
from confkv.bench.stream_rows import stream_policies
from confkv.bench.streams import ThroughputSpec, default_spec, make_longgen_requests, pool_bytes_for
from confkv.bench.textmetrics import bleu4, rouge_l
from confkv.bench.throughput import collect_finished
from confkv.engine.params import SamplingParams
from confkv.llm import LLM
from confkv.model_loader import load_model
from confkv.progress import stage

#: What is recorded per generated position.
METRICS: tuple[str, ...] = ("resident", "budget", "entropy", "gap", "expanded", "step_s")
#: The band drawn around the median.
BAND = (10.0, 50.0, 90.0)


def run_policy(llm: LLM, requests: list) -> tuple[dict[str, list[np.ndarray]], list[Any], float]:
    """Submit every request at once and step until all are done; per request and position, every metric."""
    engine = llm.engine
    for i, r in enumerate(requests):
        engine.add_request(str(i), list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    step_s: dict[str, list[float]] = {str(i): [] for i in range(len(requests))}
    outputs: dict[int, Any] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        for o in outs:
            step_s[o.request_id].extend([dt] * len(o.new_token_ids))
        collect_finished(outs, outputs)
    makespan = time.perf_counter() - t0
    outs = [outputs[i] for i in range(len(requests))]
    per: dict[str, list[np.ndarray]] = {m: [] for m in METRICS}
    for i, o in enumerate(outs):
        t = o.trace
        budget = np.asarray(t.budget, dtype=float)
        per["resident"].append(np.asarray(t.resident, dtype=float))
        per["budget"].append(np.where(np.isfinite(budget), budget, np.nan))
        per["entropy"].append(np.asarray(t.entropy, dtype=float))
        per["gap"].append(np.asarray(t.gap, dtype=float))
        per["expanded"].append(np.asarray(t.expanded, dtype=float))
        per["step_s"].append(np.asarray(step_s[str(i)][: len(t.resident)], dtype=float))
    return per, outs, makespan


def bands(arrays: list[np.ndarray]) -> dict[str, list[float | None]]:
    """Per position, the 10th, 50th and 90th percentile over the runs that reach it (ragged runs padded)."""
    length = max((len(a) for a in arrays), default=0)
    grid = np.full((len(arrays), length), np.nan)
    for row, a in enumerate(arrays):
        grid[row, : len(a)] = a
    out: dict[str, list[float | None]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a position no run has a value at (full's budget)
        qs = np.nanpercentile(grid, BAND, axis=0) if length else np.empty((3, 0))
    for name, q in zip(("p10", "p50", "p90"), qs, strict=True):
        out[name] = [None if not np.isfinite(v) else float(v) for v in q]
    return out


def run_curves(
    model: str,
    policies: list[str],
    *,
    runs: int | None = None,
    policy_files: list[str] | None = None,
    spec: ThroughputSpec | None = None,
    changes: dict[str, Any] | None = None,
    admission: str = "on_demand",
    device: str | None = None,
    dtype: str = "auto",
    cache_dir: str | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every policy on the same ``runs`` long-generation requests; ``full`` first (the reference)."""
    t_start = time.perf_counter()
    loaded = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, seed=seed)
    sp = spec or default_spec(model, "longgen", next(loaded.model.parameters()).device.type)
    sp = dataclasses.replace(sp, **(changes or {}), **({"requests": runs} if runs else {}))
    chosen = stream_policies(policies, policy_files or [], sp)
    pool = pool_bytes_for(loaded, sp, chosen[0][1].block_size)
    requests = make_longgen_requests(loaded.tokenizer, sp, seed)
    out: dict[str, Any] = {
        "model": model,
        "suite": "longgen",
        "commit": git_commit(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "settings": {
            **dataclasses.asdict(sp),
            "runs": len(requests),
            "admission": admission,
            "kv_cache_memory_bytes": pool,
            "prompt_tokens_mean": float(np.mean([len(r.prompt_ids) for r in requests])),
            "output_tokens_mean": float(np.mean([r.max_tokens for r in requests])),
            "device": str(next(loaded.model.parameters()).device),
            "threads": torch.get_num_threads(),
            "seed": seed,
        },
        "policy_settings": {name: p.model_dump(mode="json") for name, p in chosen},
        "curves": {},
        "summary": {},
    }
    reference_texts: list[str] | None = None
    with stage(f"long generation on {model}", total=len(chosen), unit="policies") as progress:
        for name, policy in chosen:
            progress.set_note(name)
            llm = LLM(model, policy, loaded=loaded, kv_cache_memory=pool, max_batch_size=sp.max_batch_size,
                      max_num_batched_tokens=sp.max_num_batched_tokens, seed=seed, admission=admission)  # fmt: skip
            per, outs, makespan = run_policy(llm, requests)
            texts = [o.text for o in outs]
            if reference_texts is None:
                reference_texts = texts
            held = [np.asarray(o.trace.resident, dtype=float) for o in outs]
            whole = [o.prompt_tokens + np.arange(len(h), dtype=float) for o, h in zip(outs, held, strict=True)]
            share = [h / np.maximum(w, 1.0) for h, w in zip(held, whole, strict=True)]
            stats = llm.engine.stats()
            out["curves"][name] = {m: bands(per[m]) for m in METRICS}
            out["curves"][name]["kv_share"] = bands(share)
            out["summary"][name] = {
                "requests_per_s": len(outs) / makespan,
                "output_tokens_per_s": sum(o.generated_tokens for o in outs) / makespan,
                "makespan_s": makespan,
                "kv_share_mean": float(np.concatenate(held).sum() / np.concatenate(whole).sum()),
                "kv_share_peak": float(max(np.max(x) for x in share)),
                "expansions_per_1k_tokens": 1000 * float(np.concatenate(per["expanded"]).mean()),
                "step_s_median": float(np.median(np.concatenate(per["step_s"]))),
                "preemptions": stats["preemptions"],
                "bleu4_vs_full": bleu4(texts, reference_texts),
                "rougeL_vs_full": rouge_l(texts, reference_texts),
            }
            progress.update(1)
            s = out["summary"][name]
            log(f"longgen {name}: {s['requests_per_s']:.3f} req/s, KV share {s['kv_share_mean']:.2f}, BLEU-4 "
                f"{s['bleu4_vs_full']:.1f} vs full, {makespan:.0f}s")  # fmt: skip
    out["settings"]["seconds"] = round(time.perf_counter() - t_start, 1)
    return out
