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

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from confkv.bench.evaluator import Evaluator
from confkv.bench.memory import Usage, matched_budget
from confkv.bench.provenance import git_commit
from confkv.bench.specs import (
    FIXED_BASELINES,
    FREE_GENERATION,
    MEASURES,
    RETRIEVAL,
    TEACHER_FORCED,
    VARIANT_CONTROLLERS,
    RowSpec,
    SuiteSpec,
    baseline_policy,
    estimate_seconds,
    parse_row,
    scaled_dynamic,
    suite_spec,
)
from confkv.bench.tables import equal_memory_comparisons
from confkv.bench.textmetrics import bleu4, rouge_l
from confkv.config import BUILTIN_POLICIES, CachePolicy
from confkv.policy_source import load_policy
from confkv.progress import Stage, stage


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
    full_is_reference: bool = True,
) -> PolicyRun:
    """Every measure of one policy: ``policies`` gives the policy of each measure (a baseline's budget differs per
    measure), ``overall`` the one recorded in the entry and used for the batch. ``full_gen`` is full's own long
    generation: the reference for BLEU/ROUGE, and full's measure when the policy is full. The measures are a
    progress stage (``confkv.progress``) named after the policy. ``full_is_reference``: a ``full`` row reuses
    ``full_gen`` as its own long generation (true at ``auto``; a quantised ``full`` generates its own)."""
    steps = len(MEASURES) + (1 if ev.spec.batch else 0)
    with stage(f"policy {label}".strip(), total=steps, unit="measures") as progress:
        return _measure(ev, policies, overall, full_gen, log, label, progress, full_is_reference)


def _measure(
    ev: Evaluator,
    policies: Mapping[str, CachePolicy],
    overall: CachePolicy,
    full_gen: tuple[dict[str, Any], Usage],
    log: Callable[[str], None],
    label: str,
    progress: Stage,
    full_is_reference: bool = True,
) -> PolicyRun:
    work: dict[str, dict[str, Any]] = {}
    usages: dict[str, Usage] = {}
    entry: dict[str, Any] = {"policy": overall.model_dump(mode="json")}
    kl = tokens = 0.0
    for name in TEACHER_FORCED:
        progress.set_note(name)
        t0 = time.perf_counter()
        metrics, usages[name] = ev.score_workload(policies[name], name)
        progress.update(1)
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
        progress.set_note(name)
        t0 = time.perf_counter()
        metrics, usages[name] = ev.retrieve(policies[name], name)
        progress.update(1)
        grid = metrics.pop("grid", grid)
        metrics.pop("kv_fraction_engine")
        work[name] = {**metrics, "seconds": time.perf_counter() - t0}
        entry[f"{name}_acc"] = metrics["acc"]
        entry[f"{name}_kv_fraction"] = usages[name].fraction_mean
    free_policy = policies[FREE_GENERATION]
    progress.set_note("free long generation")
    if free_policy.controller == "full" and full_is_reference:  # the reference itself: measured once, before any row
        gen, usages[FREE_GENERATION] = dict(full_gen[0]), full_gen[1]
        texts = gen["texts"]
        gen.update(bleu4_vs_full=bleu4(texts, texts), rougeL_vs_full=rouge_l(texts, texts))
    else:
        gen, usages[FREE_GENERATION] = ev.generate_long(free_policy, full_gen[0]["texts"])
    progress.update(1)
    trace = gen.pop("trace")
    gen.pop("texts")
    work[FREE_GENERATION] = {k: gen.get(k) for k in ("bleu4_vs_full", "rougeL_vs_full", "tokens_per_s")}
    work[FREE_GENERATION]["seconds"] = gen.pop("seconds")
    entry.update(gen)
    t0 = time.perf_counter()
    if ev.spec.batch:
        progress.set_note("batch throughput")
        entry.update(ev.batch_throughput(overall))
        progress.update(1)
    else:
        entry.update(requests_per_s=None, batch_pool_blocks=None, batch_preemptions=None)
    batch_seconds = time.perf_counter() - t0
    total = Usage.combine(usages.values())
    keys = ("kv_fraction_mean", "kv_fraction_peak", "kv_mean_tokens", "kv_peak_tokens", "kv_bytes_fraction_mean")
    entry.update({k: total[k] for k in keys})
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
    """One row of a run: its name, the policy, the variant whose memory it is matched to (a baseline), and the
    ``kv_cache_dtype`` of its pool (None: the run's ``--kv-cache-dtype``)."""

    name: str
    policy: CachePolicy
    matched_to: str | None = None
    kv_cache_dtype: str | None = None


def row_name(stem: str, taken: set[str]) -> str:
    """A policy file's row name: its stem, numbered when taken (``dynamic.yaml`` beside the built-in ``dynamic``,
    or the same file twice, keeps both rows); added to ``taken``."""
    name, i = stem, 2
    while name in taken:
        name, i = f"{stem}-{i}", i + 1
    taken.add(name)
    return name


def plan_policies(names: list[str], policy_files: list[str], dynamic: CachePolicy) -> list[PlannedPolicy]:
    """The run's policies in order: ``full`` rows; each variant followed by its fixed baselines; fixed policy files.

    ``names`` are ``--policies`` entries, ``POLICY[:KV_DTYPE[:demote=DTYPE]]`` (``confkv.bench.specs.parse_row``).
    A variant is a ``dynamic`` entry (at any dtype, demoting or not) or a policy file whose controller moves its
    budget. The plain baselines named (``window``, ...) run once per variant at the variant's pool dtype: under
    their own name beside the plain built-in ``dynamic``, else as ``window@tuned`` (a file ``tuned.yaml``) or
    ``window:int8@dynamic:int8:demote=int4`` (an entry with a dtype). Without any variant they run at the default
    budget (twice dynamic's base), as they always did. Baseline entries with a dtype (``window:int8``) are rows of
    their own at that default budget.
    """
    rows = [parse_row(n, BUILTIN_POLICIES) for n in names]
    taken = {r.label for r in rows}
    files = [(row_name(Path(f).stem, taken), load_policy(f)) for f in policy_files]

    def policy_of(row: RowSpec) -> CachePolicy:
        base = dynamic if row.policy == "dynamic" else baseline_policy(dynamic, row.policy)
        if row.policy == "full":
            base = CachePolicy(controller="full")
        return base.replace(demote_dtype=row.demote_dtype) if row.demote_dtype else base

    plan = [PlannedPolicy(r.label, policy_of(r), None, r.kv_cache_dtype) for r in rows if r.policy == "full"]
    plain = {"dynamic", *FIXED_BASELINES}
    variants = [(r.label, policy_of(r), r.label == "dynamic", r.kv_cache_dtype) for r in rows if r.policy == "dynamic"]
    variants += [(n, p, False, None) for n, p in files if p.controller in VARIANT_CONTROLLERS]
    baselines = [r.label for r in rows if r.policy in FIXED_BASELINES and r.label in plain]
    for vname, vpolicy, builtin, kv in variants:
        plan.append(PlannedPolicy(vname, vpolicy, None, kv))
        for b in baselines:
            name = b if builtin else f"{b}{':' + kv if kv else ''}@{vname}"
            plan.append(PlannedPolicy(name, baseline_policy(vpolicy, b), vname, kv))
    if not variants:
        plan += [PlannedPolicy(b, baseline_policy(dynamic, b)) for b in baselines]
    fixed = [r for r in rows if r.policy in FIXED_BASELINES and r.label not in plain]
    plan += [PlannedPolicy(r.label, policy_of(r), None, r.kv_cache_dtype) for r in fixed]
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
    kv_cache_dtype: str = "auto",
    host_kv_dtype: str | None = None,
    kv_float_window: int = 0,
    seed: int = 0,
    split: str = "heldout",
    spec: SuiteSpec | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every policy and return the results (the schema ``confkv.bench.report`` writes)."""
    spec = spec or suite_spec(model, suite)
    dynamic = scaled_dynamic(spec.scale)
    plan = plan_policies(policies, policy_files or [], dynamic)
    est = estimate_seconds(spec, len(plan))
    if model != "tiny-random":
        log(f"estimated run time on a 2-core CPU: {est['low'] / 60:.0f}-{est['high'] / 60:.0f} min")
    expected = est["high"] if model == "smollm2-135m" else None  # the estimate holds for smollm2 on 2 CPU cores
    with stage(f"bench {suite} on {model}", total=len(plan), unit="policies", expected_s=expected) as bench:
        t_start = time.perf_counter()
        ev = Evaluator.prepare(model, spec, device=device, dtype=dtype, cache_dir=cache_dir,
                               kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype, seed=seed, split=split,
                               host_kv_dtype=host_kv_dtype, kv_float_window=kv_float_window,
                               progress=progress)  # fmt: skip
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
                    # matched on bytes: the baseline runs at the variant's pool dtype, so the tokens that hold the
                    # variant's bytes (its resident KV plus any demoted copies) at that dtype's bytes per token
                    all_usages = list(variant.usages.values())
                    bpt = {m: variant.usages[m].bytes_per_token for m in MEASURES}
                    budgets[planned.matched_to] = {
                        m: matched_budget([variant.usages[m]], variant.usages[m].tokens_at(bpt[m]), vpolicy)
                        for m in MEASURES
                    }
                    overall = sum(u.tokens_at(bpt[m]) for m, u in variant.usages.items())
                    budgets[planned.matched_to]["overall"] = matched_budget(all_usages, overall, vpolicy)
                    matched = budgets[planned.matched_to]
                    log(f"baselines of {planned.matched_to}, matched to its mean resident KV bytes: {matched}")
                b = budgets[planned.matched_to]
                controller = planned.policy.controller
                per_measure = {m: baseline_policy(vpolicy, controller, b[m]) for m in MEASURES}
                policy = baseline_policy(vpolicy, controller, b["overall"])
            row_ev = ev.at(planned.kv_cache_dtype)
            exact = row_ev.engine.get("kv_cache_dtype", "auto") == "auto"  # full there is the reference itself
            run = measure_policy(
                row_ev, per_measure or dict.fromkeys(MEASURES, policy), policy, full_gen, log=log,
                label=planned.name, full_is_reference=exact,
            )  # fmt: skip
            run.entry["matched_to"] = planned.matched_to
            run.entry["kv_cache_dtype"] = row_ev.engine.get("kv_cache_dtype", "auto")
            run.entry["budgets"] = {m: budgets[planned.matched_to][m] for m in MEASURES} if per_measure else None
            for m in MEASURES:
                run.entry["workloads"][m]["budget_tokens"] = run.entry["budgets"][m] if per_measure else None
            runs[planned.name] = run
            bench.update(1)
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
            "kv_cache_dtype": kv_cache_dtype,
            "host_kv_dtype": host_kv_dtype,
            "kv_float_window": kv_float_window,
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
