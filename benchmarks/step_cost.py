"""Where each policy's decode step goes on the long-generation stream, timed step by step without a profiler
(issue 34: why the confidence rule's step is dearer than a fixed baseline's at the same running count).

    python benchmarks/step_cost.py --policies snapkv@144 \
        --policy-file docs/bench/policies/dynamic-128-512-decayed-r75-d98-per-token-stale.yaml \
        --json docs/bench/headline-longgen/step-cost.json --md docs/bench/headline-longgen/step-cost.md
    python benchmarks/step_cost.py --policies full:int8,snapkv@320:int8 --policy-file RULE.yaml:int8 ...

Rows are chosen as the throughput suite chooses them (``confkv/bench/stream_rows.py``): an entry may name its pool's
KV dtype (``snapkv@320:int8``, ``--policy-file PATH:int8``), ``--kv-cache-dtype`` is the dtype of the rows that name
none, and every pool has the same bytes (sized for ``full`` at the model's dtype), so an int8 row holds more tokens.

The throughput suite's own stream and loop (``run_engine_stream``), at the operating point of the headline
(``--requests`` of the CPU long-generation stream, the pool of ``--full-fits`` copies of its longest request under
``full``, ``--max-batch-size``), one policy after another. The engine's methods are wrapped on the instance with
``perf_counter`` timers that keep *exclusive* time (a callee's time is not its caller's), so a step splits into:

* ``forward``: ``ModelRunner.run`` (packing the batch and the model's forward pass);
* ``commit``: adding the pass's recorded attention to what the scorers read;
* ``decode``: confidence signals, the controllers' budgets, sampling and stop checks (recalls excluded);
* ``recall_score`` / ``copy_in``: ranking host blocks for a recall, and writing them back into the pool;
* ``evict_score`` / ``copy_out``: ranking blocks to evict, and moving them to the host tier (preemption swaps too);
* ``other``: the rest of the step (scheduling, bookkeeping).

Per step it also records what the pass computed: running sequences, generated tokens, rerun tokens (a recalled
sequence's second pass, its stale tokens under ``recompute: stale``), prompt tokens, recalled and evicted blocks,
and the decode attention's keys: the batch is padded to its widest row, so ``padded`` against ``valid`` keys says
how much of the attention is spent on padding (grouping the rows by width took it from 51% to 16% for the
confidence rule and saved no time: BENCHMARKS.md, "2026-12-06, third session"). Policies are compared on decode
steps (no prompt chunk in the batch) at equal running counts: every running count every row reached on at least
``--min-steps`` steps counts once, whatever how often each spent there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from confkv import LLM
from confkv.bench.provenance import git_commit
from confkv.bench.specs import parse_dtype_suffix
from confkv.bench.stream_rows import StreamRow, is_reference, stream_rows
from confkv.bench.streams import LONGGEN_CPU, ThroughputSpec, pool_bytes_for, stream_requests
from confkv.bench.throughput import run_engine_stream
from confkv.config import MIN_BATCHED_TOKENS
from confkv.engine.engine import LLMEngine
from confkv.errors import ConfkvError
from confkv.model_loader import load_model

PARTS = ("forward", "commit", "decode", "recall_score", "copy_in", "evict_score", "copy_out", "other")
COUNTS = ("running", "generated", "rerun_tokens", "reruns", "prompt_tokens", "recalled_blocks", "evicted_blocks",
          "padded_keys", "valid_keys", "decode_rows", "left_out", "rerun_steps")  # fmt: skip


class StepClock:
    """Exclusive wall time per part of the current step, and the step's counts; ``steps`` holds one dict per step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.current: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # time spent in callees, per open call

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                inner = self._stack.pop()
                self.current[part] += elapsed - inner
                if self._stack:
                    self._stack[-1] += elapsed

        return wrapper


def instrument(engine: LLMEngine, clock: StepClock) -> None:
    """Wrap the engine's step and the methods it calls (on the instances: nothing else is touched)."""
    runner, manager = engine.runner, engine.manager
    run = clock.timed("forward", runner.run)

    def counted_run(chunks: list, **kwargs: Any) -> Any:
        res = run(chunks, **kwargs)
        cur = clock.current
        for ch in chunks:
            if ch.rerun:
                cur["rerun_tokens"] += ch.num_tokens
                cur["reruns"] += 1
            elif ch.start < ch.seq.num_prompt_tokens:
                cur["prompt_tokens"] += ch.num_tokens
        cur["chunks"] += len(chunks)
        cur["rerun_steps"] = 1.0 if cur["reruns"] else 0.0
        batch = res.batch
        if batch.num_decode:  # the keys attended: the padded batch's
            cur["decode_rows"] += batch.num_decode
            cur["padded_keys"] += batch.decode_valid.numel()
            cur["valid_keys"] += int(batch.decode_valid.sum())
        return res

    runner.run = counted_run
    runner.commit = clock.timed("commit", runner.commit)
    engine.decoder.step = clock.timed("decode", engine.decoder.step)
    manager.recall = clock.timed("recall_score", manager.recall)
    manager._to_device = clock.timed("copy_in", manager._to_device)
    manager.evict_to = clock.timed("evict_score", manager.evict_to)
    manager._to_host = clock.timed("copy_out", manager._to_host)
    step = engine.step

    def timed_step() -> list:
        clock.current = defaultdict(float)
        recalled, evicted = manager.recalled_blocks, manager.evicted_blocks
        t0 = time.perf_counter()
        outputs = step()
        total = time.perf_counter() - t0
        cur = clock.current
        if "forward" not in cur:  # nothing was scheduled: not a step
            return outputs
        cur["total"] = total
        cur["other"] = total - sum(cur[p] for p in PARTS if p != "other")
        cur["running"] = len(engine.scheduler.running) + sum(1 for o in outputs if o.finished)
        # running sequences given no row this step: a second pass (or a prompt chunk) took the step's tokens
        cur["left_out"] = max(0.0, cur["running"] - cur.pop("chunks", 0.0))
        cur["generated"] = sum(len(o.new_token_ids) for o in outputs)
        cur["recalled_blocks"] = manager.recalled_blocks - recalled
        cur["evicted_blocks"] = manager.evicted_blocks - evicted
        clock.steps.append(dict(cur))
        return outputs

    engine.step = timed_step


def summarise(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the run and means per step of every part and count."""
    n = len(steps)
    keys = ("total", *PARTS, *COUNTS)
    totals = {k: sum(s.get(k, 0.0) for s in steps) for k in keys}
    out: dict[str, Any] = {"steps": n, "seconds": totals["total"]}
    out["per_step_ms"] = {k: 1000 * totals[k] / n for k in ("total", *PARTS)}
    out["per_step"] = {k: totals[k] / n for k in COUNTS}
    gen = max(1.0, totals["generated"])
    out["per_generated_token"] = {
        "computed_tokens": (totals["generated"] + totals["rerun_tokens"]) / gen,  # decode rows and reruns
        "rerun_tokens": totals["rerun_tokens"] / gen,
        "recalled_blocks": totals["recalled_blocks"] / gen,
        "evicted_blocks": totals["evicted_blocks"] / gen,
        "ms": 1000 * totals["total"] / gen,
    }
    out["padding_share"] = 1 - totals["valid_keys"] / max(1.0, totals["padded_keys"])
    out["seconds_by_part"] = {k: totals[k] for k in ("total", *PARTS)}
    with_rerun = [s for s in steps if s.get("reruns")]
    out["rerun_steps"] = {  # the steps that ran a second pass, against the others
        "steps": len(with_rerun),
        "ms": 1000 * sum(s["total"] for s in with_rerun) / max(1, len(with_rerun)),
        "generated": sum(s.get("generated", 0.0) for s in with_rerun) / max(1, len(with_rerun)),
        "other_steps_ms": 1000 * (totals["total"] - sum(s["total"] for s in with_rerun)) / max(1, n - len(with_rerun)),
        "other_steps_generated": (totals["generated"] - sum(s.get("generated", 0.0) for s in with_rerun))
        / max(1, n - len(with_rerun)),
    }
    out["totals"] = {k: totals[k] for k in COUNTS if k != "running"}
    return out


def decode_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in steps if not s.get("prompt_tokens")]


def matched(runs: dict[str, list[dict[str, Any]]], min_steps: int) -> dict[str, Any]:
    """Each policy's decode steps at the running counts every policy reached on ``min_steps`` steps or more, each
    count weighted once (so a policy that spent longer at larger counts is not charged for it)."""
    by_count = {name: defaultdict(list) for name in runs}
    for name, steps in runs.items():
        for s in decode_steps(steps):
            by_count[name][int(s["running"])].append(s)
    common = sorted(set.intersection(*(
        {c for c, group in groups.items() if len(group) >= min_steps} for groups in by_count.values()
    )))  # fmt: skip
    out: dict[str, Any] = {"running_counts": common, "policies": {}, "by_running": {
        name: {c: summarise(groups[c]) for c in sorted(groups) if len(groups[c]) >= min_steps}
        for name, groups in by_count.items()
    }}  # fmt: skip
    for name, groups in by_count.items():
        per = [summarise(groups[c]) for c in common]
        if not per:
            continue
        out["policies"][name] = {
            "steps": sum(p["steps"] for p in per),
            "per_step_ms": {k: sum(p["per_step_ms"][k] for p in per) / len(per) for k in per[0]["per_step_ms"]},
            "per_step": {k: sum(p["per_step"][k] for p in per) / len(per) for k in per[0]["per_step"]},
            "padding_share": sum(p["padding_share"] for p in per) / len(per),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    """The two tables: the whole run per policy, and the decode steps at matched running counts."""
    names = list(result["policies"])
    lines = [f"# Step cost on the long-generation stream ({result['settings']['requests']} requests, commit "
             f"`{result['commit']}`)", "", "## The whole run", "",
             "| | " + " | ".join(f"`{n}`" for n in names) + " |", "|:---|" + "---:|" * len(names)]  # fmt: skip
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("KV dtype (pool tokens)", lambda r: f"{r['kv_cache_dtype']} ({r['pool_tokens']:,})"),
        ("steps", lambda r: f"{r['steps']:,}"),
        ("makespan s", lambda r: f"{r['makespan_s']:.1f}"),
        ("mean step ms", lambda r: f"{r['per_step_ms']['total']:.1f}"),
        ("mean running", lambda r: f"{r['per_step']['running']:.1f}"),
        ("generated tokens", lambda r: f"{r['totals']['generated']:,.0f}"),
        ("computed tokens per generated (decode + rerun)",
         lambda r: f"{r['per_generated_token']['computed_tokens']:.3f}"),
        ("reruns per step", lambda r: f"{r['per_step']['reruns']:.2f}"),
        ("rerun tokens per step", lambda r: f"{r['per_step']['rerun_tokens']:.2f}"),
        ("recalled blocks per step", lambda r: f"{r['per_step']['recalled_blocks']:.2f}"),
        ("evicted blocks per step", lambda r: f"{r['per_step']['evicted_blocks']:.2f}"),
        ("decode attention on padding", lambda r: f"{100 * r['padding_share']:.0f}%"),
        ("running rows left out per step", lambda r: f"{r['per_step']['left_out']:.2f}"),
        ("steps with a second pass", lambda r: f"{r['rerun_steps']['steps']:,}"),
        ("ms, generated per step with a second pass",
         lambda r: f"{r['rerun_steps']['ms']:.1f}, {r['rerun_steps']['generated']:.2f}"),
        ("ms, generated per step without one",
         lambda r: f"{r['rerun_steps']['other_steps_ms']:.1f}, {r['rerun_steps']['other_steps_generated']:.2f}"),
        ("ms per generated token", lambda r: f"{r['per_generated_token']['ms']:.2f}"),
        ("requests/s", lambda r: f"{r['requests_per_s']:.3f}"),
    ]  # fmt: skip
    rows += [(f"{part} s (whole run)", lambda r, part=part: f"{r['seconds_by_part'][part]:.1f}")
             for part in ("total", *PARTS)]  # fmt: skip
    for label, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(result["policies"][n]) for n in names) + " |")
    m = result["matched"]
    counts = m["running_counts"]
    span = f"{counts[0]}-{counts[-1]}" if counts else "none"
    lines += ["", f"## Decode steps at matched running counts ({span}, each count weighted once)", "",
              "| per step | " + " | ".join(f"`{n}`" for n in m["policies"]) + " |",
              "|:---|" + "---:|" * len(m["policies"])]  # fmt: skip
    pol = m["policies"]
    lines.append("| steps | " + " | ".join(f"{p['steps']:,}" for p in pol.values()) + " |")
    for part in ("total", *PARTS):
        lines.append(f"| {part} ms | " + " | ".join(f"{p['per_step_ms'][part]:.1f}" for p in pol.values()) + " |")
    for count in ("running", "generated", "reruns", "rerun_tokens", "rerun_steps", "left_out", "recalled_blocks",
                  "evicted_blocks", "valid_keys", "padded_keys"):  # fmt: skip
        lines.append(f"| {count} | " + " | ".join(f"{p['per_step'][count]:.2f}" for p in pol.values()) + " |")
    lines.append("| decode attention on padding | " + " | ".join(
        f"{100 * p['padding_share']:.0f}%" for p in pol.values()) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def chosen_rows(
    names: list[str], policy_files: list[str], spec: ThroughputSpec, kv_cache_dtype: str
) -> list[StreamRow]:
    """The throughput suite's rows for these entries, less the reference ``full`` that ``stream_rows`` adds when
    no entry asked for it (this benchmark compares steps, not quality)."""
    parse_dtype_suffix([kv_cache_dtype], f"--kv-cache-dtype {kv_cache_dtype}")
    rows = stream_rows(names, policy_files, spec, kv_cache_dtype)
    return [r for r in rows if not (is_reference(r, kv_cache_dtype) and r.name == "full" and "full" not in names)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--policies", default="snapkv@144",
        help="built-in policies at the stream's sizes, comma-separated: POLICY[@SIZE][:KV_DTYPE] (snapkv@320:int8)",
    )  # fmt: skip
    ap.add_argument("--policy-file", action="append", default=[], help="also a YAML policy, PATH[:KV_DTYPE]")
    ap.add_argument(
        "--kv-cache-dtype", default="auto",
        help="the pool's KV dtype for rows that name none (auto, int8, fp8, int4); every pool has full's bytes",
    )  # fmt: skip
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--full-fits", type=int, default=LONGGEN_CPU.full_fits)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=LONGGEN_CPU.max_num_batched_tokens,
        help="tokens per engine step (the throughput suite's --max-num-batched-tokens)",
    )  # fmt: skip
    ap.add_argument("--min-steps", type=int, default=10, help="steps a running count needs to be compared")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--md", type=Path, help="write the tables here")
    args = ap.parse_args()
    if min(args.requests, args.full_fits, args.max_batch_size, args.min_steps) < 1:
        raise SystemExit("--requests, --full-fits, --max-batch-size and --min-steps take positive numbers")
    if args.max_num_batched_tokens < MIN_BATCHED_TOKENS:
        raise SystemExit(f"--max-num-batched-tokens takes a whole number of at least {MIN_BATCHED_TOKENS}")
    t_start = time.perf_counter()
    spec = dataclasses.replace(LONGGEN_CPU, requests=args.requests, full_fits=args.full_fits,
                               max_batch_size=args.max_batch_size,
                               max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    try:  # a bad entry or dtype is one line before the model loads
        chosen = chosen_rows(names, args.policy_file, spec, args.kv_cache_dtype)
    except ConfkvError as err:  # exit 2, as the throughput suite and the fidelity script refuse an entry
        print(f"step_cost.py: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    loaded = load_model(args.model, device="cpu")
    requests = stream_requests(loaded.tokenizer, spec)
    pool = pool_bytes_for(loaded, spec, chosen[0].policy.block_size)
    result: dict[str, Any] = {"commit": git_commit(), "settings": {**dataclasses.asdict(spec), "pool_bytes": pool,
                              "kv_cache_dtype": args.kv_cache_dtype}, "policies": {}}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {}
    for row in chosen:
        name = row.name
        llm = LLM(args.model, row.policy, loaded=loaded, kv_cache_memory=pool, max_batch_size=spec.max_batch_size,
                  max_num_batched_tokens=spec.max_num_batched_tokens, kv_cache_dtype=row.kv_cache_dtype)  # fmt: skip
        clock = StepClock()
        instrument(llm.engine, clock)
        stream = run_engine_stream(llm, requests)
        runs[name] = clock.steps
        result["policies"][name] = {**summarise(clock.steps), "makespan_s": stream.metrics["makespan_s"],
                                    "requests_per_s": stream.metrics["requests_per_s"],
                                    "kv_cache_dtype": stream.metrics["kv_cache_dtype"],
                                    "pool_tokens": stream.metrics["pool_tokens"],
                                    "kv_bytes_fraction_mean": stream.metrics["kv_bytes_fraction_mean"]}  # fmt: skip
        r = result["policies"][name]
        print(f"{name}: {r['steps']} steps, {r['per_step_ms']['total']:.1f} ms/step, makespan "
              f"{r['makespan_s']:.1f} s, {r['requests_per_s']:.3f} req/s", flush=True)  # fmt: skip
    result["matched"] = matched(runs, args.min_steps)
    result["settings"]["seconds"] = round(time.perf_counter() - t_start, 1)
    md = markdown(result)
    print(md)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        args.md.write_text(md)


if __name__ == "__main__":
    main()
