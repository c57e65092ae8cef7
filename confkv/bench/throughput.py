"""``confkv bench --suite throughput``: does the memory a policy saves become requests served?

One engine per policy, one fixed KV pool for all of them, sized so that ``full`` fits ``full_fits`` sequences at
once. The same stream of requests (prompts of 1,000-2,000 tokens of documentation with a task after them, output
lengths of 64-256 tokens, greedy, ``ignore_eos`` so every policy generates the same number of tokens) goes through
each, in two scenarios:

* ``burst``: every request submitted at the start (throughput);
* ``poisson``: requests arriving at a set rate with exponential gaps (latency under load).

and, where the cache grows while decoding rather than while reading (issue 34), a *long-generation* stream: short
chat prompts (100-300 tokens: a few lines of notes and a request for a story, report, documentation or code from
``workloads.longgen_prompts``) with long outputs (1,024-4,096 tokens on a GPU, ``ignore_eos``), the pool again
holding ``full_fits`` of its longest request under ``full``, so ``full`` is bound by memory:

* ``longgen``: all submitted at the start; ``longgen_poisson``: Poisson arrivals.

Each policy runs under every admission mode asked for (``reserve``, ``on_demand``; rows ``NAME:MODE`` when there
are several), and ``requests_per_s_vs_full`` is against ``full`` on demand when it ran (the baseline vLLM gives).

Measured per policy: requests/s and output tokens/s over the makespan, the time-weighted mean of running sequences,
time to first token and end-to-end latency percentiles, preemptions, peak pool use, the resident KV fraction, and the
answers' quality against ``full``'s (ROUGE-L and exact token match). Hugging Face ``generate`` on the same requests
in static batches of ``full_fits`` (left-padded, run to the batch's longest output) is what a user would otherwise
run; it is reported as ``hf_static``. The streams themselves (requests, specs, pool sizes) are ``streams.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

import numpy as np
import torch

from confkv.bench.intervals import bootstrap_mean, ratio_interval, t_interval
from confkv.bench.provenance import git_commit
from confkv.bench.stream_rows import StreamRow, stream_rows
from confkv.bench.streams import (
    SCENARIOS,
    StreamRequest,
    ThroughputSpec,
    default_spec,
    pool_bytes_for,
    stream_requests,
    with_poisson_arrivals,
)
from confkv.bench.textmetrics import rouge_l
from confkv.config import CachePolicy
from confkv.engine.params import SamplingParams
from confkv.kv.pool import BlockPool
from confkv.llm import LLM
from confkv.model_loader import LoadedModel, load_model
from confkv.progress import stage


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@dataclass
class StreamResult:
    metrics: dict[str, Any]
    token_ids: list[list[int]]
    texts: list[str]
    running: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, running sequences)


def collect_finished(step_outputs: list, outputs: dict[int, Any]) -> None:
    """Keep each finished request's output under its index; a request the engine failed ends the run (a benchmark
    row over fewer requests than asked would compare unlike with like)."""
    for o in step_outputs:
        if o.finished and o.output is not None:
            if o.output.finish_reason == "error":
                raise RuntimeError(f"request {o.request_id} failed: {o.output.error}")
            outputs[int(o.request_id)] = o.output


def run_engine_stream(llm: LLM, requests: list[StreamRequest]) -> StreamResult:
    """Submit each request at its arrival time and step the engine until every one is finished."""
    engine = llm.engine
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    outputs: dict[int, Any] = {}
    running_trace: list[tuple[float, int]] = []
    weighted_running = busy = 0.0
    peak_usage = 0.0
    submitted: dict[str, float] = {}
    t0 = time.perf_counter()
    nxt = 0
    while len(outputs) < len(requests):
        now = time.perf_counter() - t0
        while nxt < len(order) and requests[order[nxt]].arrival_s <= now:
            i = order[nxt]
            r = requests[i]
            engine.add_request(str(i), list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
            submitted[str(i)] = time.perf_counter()
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[order[nxt]].arrival_s - (time.perf_counter() - t0)))
            continue
        s0 = time.perf_counter()
        step_outputs = engine.step()
        dt = time.perf_counter() - s0
        running = len(engine.scheduler.running) + sum(1 for o in step_outputs if o.finished)
        weighted_running += running * dt
        busy += dt
        peak_usage = max(peak_usage, engine.pool.usage)
        running_trace.append((time.perf_counter() - t0, len(engine.scheduler.running)))
        collect_finished(step_outputs, outputs)
    makespan = time.perf_counter() - t0
    outs = [outputs[i] for i in range(len(requests))]
    # from the request's arrival, as for hf_static: one that arrived during a step was submitted only after it
    late = [submitted[str(i)] - (t0 + requests[i].arrival_s) for i in range(len(requests))]
    ttft = [d + o.timing["queue_s"] + o.timing["prefill_s"] for d, o in zip(late, outs, strict=True)]
    latency = [t + o.timing["decode_s"] for t, o in zip(ttft, outs, strict=True)]
    generated = sum(o.generated_tokens for o in outs)
    full_tokens = [o.prompt_tokens + (o.generated_tokens - 1) / 2 for o in outs]
    kv_fraction = [o.kv["mean_resident_tokens"] / f for o, f in zip(outs, full_tokens, strict=True)]
    auto = auto_bytes_per_token(llm)
    kv_bytes = [resident_bytes(o.kv) / (f * auto) for o, f in zip(outs, full_tokens, strict=True)]
    stats = engine.stats()
    metrics = {
        "requests": len(outs),
        "makespan_s": makespan,
        "requests_per_s": len(outs) / makespan,
        "output_tokens_per_s": generated / makespan,
        "mean_running": weighted_running / max(busy, 1e-9),
        "max_running": max((n for _, n in running_trace), default=0),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "latency_p50_s": _pct(latency, 50),
        "latency_p99_s": _pct(latency, 99),
        "preemptions": stats["preemptions"],
        "recomputed_tokens": stats["recomputed_tokens"],
        "breaker_trips": stats["breaker_trips"],
        "peak_pool_usage": peak_usage,
        "kv_fraction_mean": float(np.mean(kv_fraction)),
        "kv_fraction_per_request": [float(f) for f in kv_fraction],
        "kv_bytes_fraction_mean": float(np.mean(kv_bytes)),
        "kv_bytes_fraction_per_request": [float(f) for f in kv_bytes],
        "kv_cache_dtype": engine.pool.kv_cache_dtype,
        "pool_tokens": engine.pool.num_tokens,
        "pool_blocks": stats["pool_blocks"],
        "recalled_blocks": stats["recalled_blocks"],
    }
    texts = [o.text for o in outs]
    return StreamResult(metrics, [o.token_ids for o in outs], texts, running_trace)


class _TokenClock:
    """A ``generate`` streamer that only notes when each batch of new tokens arrives (for time to first token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf_static(loaded: LoadedModel, requests: list[StreamRequest], batch_size: int) -> StreamResult:
    """Hugging Face ``generate`` in static batches: whatever has arrived (up to ``batch_size``) runs together,
    left-padded, until its longest output is done."""
    model, tok = loaded.model, loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    results: dict[int, list[int]] = {}
    ttft: dict[int, float] = {}
    latency: dict[int, float] = {}
    running_trace: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order):
        now = time.perf_counter() - t0
        if requests[order[nxt]].arrival_s > now:
            time.sleep(requests[order[nxt]].arrival_s - now)
            now = time.perf_counter() - t0
        batch = []
        while nxt < len(order) and len(batch) < batch_size and requests[order[nxt]].arrival_s <= now:
            batch.append(order[nxt])
            nxt += 1
        width = max(len(requests[i].prompt_ids) for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            p = requests[i].prompt_ids
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(requests[i].max_tokens for i in batch)
        running_trace.append((now, len(batch)))
        clock = _TokenClock()
        with torch.inference_mode():
            out = model.generate(
                ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=pad, streamer=clock,
            )  # fmt: skip
        done = time.perf_counter()
        running_trace.append((done - t0, 0))
        t_first = clock.times[1] if len(clock.times) > 1 else done  # the first call is the prompt itself
        for row, i in enumerate(batch):
            results[i] = out[row, width : width + requests[i].max_tokens].tolist()
            ttft[i] = t_first - (t0 + requests[i].arrival_s)
            latency[i] = done - (t0 + requests[i].arrival_s)
    makespan = time.perf_counter() - t0
    token_ids = [results[i] for i in range(len(requests))]
    metrics = {
        "requests": len(requests),
        "makespan_s": makespan,
        "requests_per_s": len(requests) / makespan,
        "output_tokens_per_s": sum(len(t) for t in token_ids) / makespan,
        "batch_size": batch_size,
        "ttft_p50_s": _pct(list(ttft.values()), 50),
        "ttft_p99_s": _pct(list(ttft.values()), 99),
        "latency_p50_s": _pct(list(latency.values()), 50),
        "latency_p99_s": _pct(list(latency.values()), 99),
    }
    texts = [tok.decode(t, skip_special_tokens=True) for t in token_ids]
    return StreamResult(metrics, token_ids, texts, running_trace)


def _quality(result: StreamResult, reference: StreamResult) -> dict[str, float]:
    same = [a == b for a, b in zip(result.token_ids, reference.token_ids, strict=True)]
    return {"rougeL_vs_full": rouge_l(result.texts, reference.texts), "exact_match_vs_full": float(np.mean(same))}


def _over_runs(runs: list[StreamResult], full_rates: list[float], is_reference: bool) -> dict[str, Any]:
    """A row's rates over its repeated runs (means, per-run values, 95% intervals), its requests/s against the
    reference's, and its resident KV share's interval over the first run's requests (``intervals.py``)."""
    rates = [r.metrics["requests_per_s"] for r in runs]
    tokens = [r.metrics["output_tokens_per_s"] for r in runs]
    same = all(r.token_ids == runs[0].token_ids for r in runs[1:])
    return {
        "requests_per_s": float(np.mean(rates)),
        "output_tokens_per_s": float(np.mean(tokens)),
        "requests_per_s_runs": rates,
        "requests_per_s_ci": t_interval(rates),
        "requests_per_s_vs_full": float(np.mean(rates)) / float(np.mean(full_rates)),
        "requests_per_s_vs_full_ci": None if is_reference else ratio_interval(rates, full_rates),
        "kv_fraction_ci": bootstrap_mean(runs[0].metrics["kv_fraction_per_request"]),
        "kv_bytes_fraction_ci": bootstrap_mean(runs[0].metrics["kv_bytes_fraction_per_request"]),
        "same_answers_every_run": same,
    }


class Row(NamedTuple):
    """One engine configuration of a stream: a policy under one admission mode on a pool of ``factor`` times the
    stream's bytes, storing its KV at ``kv_cache_dtype``."""

    name: str
    policy: CachePolicy
    mode: str
    factor: int
    kv_cache_dtype: str


def _rows(chosen: list[StreamRow], admissions: tuple[str, ...], ceiling: int | None, kv_cache_dtype: str) -> list[Row]:
    """Every policy under every admission mode, named ``NAME:MODE`` when there are several modes; with
    ``ceiling``, ``full`` once more at the run's dtype with a pool that many times larger (``full:Nx``, on demand
    when that mode runs): how far any cache policy could go on this stream."""
    rows = [Row(r.name if len(admissions) == 1 else f"{r.name}:{mode}", r.policy, mode, 1, r.kv_cache_dtype)
            for r in chosen for mode in admissions]  # fmt: skip
    if ceiling:
        mode = "on_demand" if "on_demand" in admissions else admissions[0]
        rows.append(Row(f"full:{ceiling}x", CachePolicy(controller="full"), mode, ceiling, kv_cache_dtype))
    return rows


def _reference_rows(rows: list[Row], kv_cache_dtype: str) -> tuple[str, str]:
    """The rows quality is measured against (``full``'s first at the run's dtype) and requests/s against (that
    ``full`` on demand when it ran: the baseline a vLLM user compares with)."""
    full = [r for r in rows if r.policy.controller == "full" and r.factor == 1 and r.kv_cache_dtype == kv_cache_dtype]
    speed = next((r.name for r in full if r.mode == "on_demand"), full[0].name)
    return full[0].name, speed


def auto_bytes_per_token(llm: LLM) -> float:
    """Bytes one token's K and V take at the model's dtype (``full`` at ``auto``): the denominator of the byte
    shares, so a quantised row's share says what it holds against the float cache the pool was sized for."""
    pool = llm.engine.pool
    per_block = BlockPool.bytes_per_block_for(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size,
                                              pool.compute_dtype)  # fmt: skip
    return per_block / pool.block_size


def resident_bytes(kv: dict[str, Any]) -> float:
    """Mean bytes a request held on the device: its resident tokens at the pool's dtype, plus its demoted copies
    (their peak, held throughout as they must be provisioned) and its float window's copies."""
    extra = float(kv.get("demoted_peak_bytes") or 0) + float(kv.get("float_window_mean_bytes") or 0)
    return float(kv["mean_resident_bytes"]) + extra


def _stream_settings(loaded: LoadedModel, spec: ThroughputSpec, requests: list[StreamRequest], pool: int) -> dict:
    return {
        **asdict(spec),
        "kv_cache_memory_bytes": pool,
        "prompt_tokens_mean": float(np.mean([len(r.prompt_ids) for r in requests])),
        "output_tokens_mean": float(np.mean([r.max_tokens for r in requests])),
        "device": str(next(loaded.model.parameters()).device),
        "threads": torch.get_num_threads(),
    }


def run_throughput(
    model: str,
    policies: list[str],
    *,
    policy_files: list[str] | None = None,
    spec: ThroughputSpec | None = None,
    longgen_spec: ThroughputSpec | None = None,
    scenarios: tuple[str, ...] = ("burst", "poisson"),
    admissions: tuple[str, ...] = ("on_demand",),
    changes: dict[str, Any] | None = None,
    ceiling: int | None = None,
    repeats: int = 1,
    hf: bool = True,
    device: str | None = None,
    dtype: str = "auto",
    cache_dir: str | None = None,
    seed: int = 0,
    kv_cache_dtype: str = "auto",
    host_kv_dtype: str | None = None,
    kv_float_window: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every scenario (``SCENARIOS``) for every policy under every admission mode; ``spec`` and
    ``longgen_spec`` size the two streams (default: ``default_spec``), and ``changes`` (spec fields) are applied to
    both. ``ceiling`` adds ``full`` with a pool that many times larger. Every engine stores its KV at its row's
    dtype (``snapkv@128:int8``; ``kv_cache_dtype`` where the row names none) in a pool of the same bytes (sized for
    ``full`` at the model's dtype), so a quantised pool shows what its extra tokens buy in requests served; ``full``
    at ``kv_cache_dtype`` is the reference.

    ``repeats`` runs every row that many times, round-robin (each repeat runs all rows once, so a slow spell of
    the machine falls on every row alike): requests/s and output tokens/s are then the mean over the runs, with
    95% intervals (``intervals.py``); the other figures (latencies, preemptions, answers) are the first run's."""
    t_start = time.perf_counter()
    loaded = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, seed=seed)
    device_type = next(loaded.model.parameters()).device.type
    specs = {"chat": spec or default_spec(model, "chat"), "longgen": longgen_spec or default_spec(model, "longgen",
             device_type)}  # fmt: skip
    specs = {k: dataclasses.replace(v, **(changes or {})) for k, v in specs.items()}
    streams: dict[str, dict[str, Any]] = {}
    for stream in dict.fromkeys(SCENARIOS[s] for s in scenarios):
        sp = specs[stream]
        chosen = stream_rows(policies, policy_files or [], sp, kv_cache_dtype)
        pool = pool_bytes_for(loaded, sp, chosen[0].policy.block_size)
        requests = stream_requests(loaded.tokenizer, sp, seed)
        rows = _rows(chosen, admissions, ceiling, kv_cache_dtype)
        streams[stream] = {"spec": sp, "rows": rows, "pool": pool, "requests": requests,
                           "settings": {**_stream_settings(loaded, sp, requests, pool), "seed": seed}}  # fmt: skip
    first = streams[SCENARIOS[scenarios[0]]]
    out: dict[str, Any] = {
        "model": model,
        "suite": "throughput",
        "commit": git_commit(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "settings": {
            **first["settings"],
            "admissions": list(admissions),
            "kv_cache_dtype": kv_cache_dtype,
            "host_kv_dtype": host_kv_dtype,
            "kv_float_window": kv_float_window,
        },
        "policy_settings": {r.name: r.policy.model_dump(mode="json") for r in first["rows"]},
        "row_kv_cache_dtypes": {r.name: r.kv_cache_dtype for r in first["rows"]},
    }
    traces: dict[str, dict[str, list]] = {}
    runs = sum(repeats * len(streams[SCENARIOS[s]]["rows"]) + (1 if hf else 0) for s in scenarios)
    with stage(f"throughput on {model}", total=runs, unit="runs") as progress:
        for scenario in scenarios:
            st = streams[SCENARIOS[scenario]]
            sp, base, pool_bytes = st["spec"], st["requests"], st["pool"]
            poisson = scenario.endswith("poisson")
            requests = with_poisson_arrivals(base, sp.arrival_rate, seed) if poisson else base
            results: dict[str, StreamResult] = {}
            runs_of: dict[str, list[StreamResult]] = {r.name: [] for r in st["rows"]}
            for rep in range(repeats):
                for name, policy, mode, factor, row_dtype in st["rows"]:
                    t0 = time.perf_counter()
                    llm = LLM(model, policy, loaded=loaded, kv_cache_memory=factor * pool_bytes,
                              max_batch_size=sp.max_batch_size, max_num_batched_tokens=sp.max_num_batched_tokens,
                              seed=seed, admission=mode, kv_cache_dtype=row_dtype,
                              host_kv_dtype=host_kv_dtype, kv_float_window=kv_float_window)  # fmt: skip
                    progress.set_note(f"{scenario} {name}" + (f" (run {rep + 1}/{repeats})" if repeats > 1 else ""))
                    runs_of[name].append(run_engine_stream(llm, requests))
                    results.setdefault(name, runs_of[name][0])
                    progress.update(1)
                    m = runs_of[name][-1].metrics
                    log(f"{scenario} {name}: {m['requests_per_s']:.3f} req/s, {m['output_tokens_per_s']:.1f} tok/s, "
                        f"mean running {m['mean_running']:.1f}, ttft p50 {m['ttft_p50_s']:.1f}s, preemptions "
                        f"{m['preemptions']} ({time.perf_counter() - t0:.0f}s)")  # fmt: skip
            quality_ref, speed_ref = _reference_rows(st["rows"], kv_cache_dtype)
            reference = results[quality_ref]
            full_rates = [r.metrics["requests_per_s"] for r in runs_of[speed_ref]]
            section: dict[str, Any] = {"policies": {}, "quality_reference": quality_ref, "speed_reference": speed_ref,
                                       "repeats": repeats}  # fmt: skip
            for name, result in results.items():
                section["policies"][name] = {
                    **result.metrics,
                    **_quality(result, reference),
                    **_over_runs(runs_of[name], full_rates, name == speed_ref),
                }
            if hf:
                t0 = time.perf_counter()
                hf_loaded = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, seed=seed)
                progress.set_note(f"{scenario} hf_static")
                static = run_hf_static(hf_loaded, requests, sp.full_fits)
                progress.update(1)
                section["hf_static"] = {**static.metrics, **_quality(static, reference)}
                results["hf_static"] = static
                log(f"{scenario} hf_static: {static.metrics['requests_per_s']:.3f} req/s "
                    f"({time.perf_counter() - t0:.0f}s)")  # fmt: skip
            if scenario == "burst":
                out.update(section)
            else:
                if SCENARIOS[scenario] != SCENARIOS[scenarios[0]]:
                    section["settings"] = st["settings"]
                out[scenario] = {**({"arrival_rate": sp.arrival_rate} if poisson else {}), **section}
            traces[scenario] = {name: r.running for name, r in results.items()}
    out["running_trace"] = traces
    out["settings"]["seconds"] = round(time.perf_counter() - t_start, 1)
    return out
