"""The benchmark results as Markdown: the per-policy table, resident KV per workload, the baselines' budgets, who
is ahead at equal memory (``equal_memory_comparisons``, which ``run_suite`` also stores in the results), and the
run-time line. Nothing here needs matplotlib, so the suite and the tuner can import it cheaply.

Anything not measured is ``None`` in the results and prints as "n/a".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

#: Measures in report order, with the label the tables use.
MEASURE_LABELS: dict[str, str] = {
    "prose": "prose",
    "longgen": "long gen (forced)",
    "chat": "chat",
    "passkey": "pass-key",
    "multikey": "multi-key",
    "longgen_free": "long gen (free)",
}
#: What decides "ahead at equal memory" on each measure: the quality key, whether higher is better, and the keys
#: shown beside it. Perplexity follows KL on prose; ROUGE-L is shown beside BLEU-4 on long generations.
VERDICT_METRICS: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "prose": ("kl_mean", False, ("ppl",)),
    "longgen": ("kl_mean", False, ()),
    "chat": ("kl_mean", False, ()),
    "passkey": ("acc", True, ("acc_by_filler",)),
    "multikey": ("acc", True, ()),
    "longgen_free": ("bleu4_vs_full", True, ("rougeL_vs_full",)),
}
#: A baseline whose measured mean resident KV differs from its variant's by more than this share is flagged: the
#: budget was matched by prediction, and a comparison is only at equal memory if the measurement agrees.
MEMORY_TOLERANCE = 0.05
_METRIC_NAMES = {"kl_mean": "KL", "acc": "accuracy", "bleu4_vs_full": "BLEU-4"}


def finite(x: Any) -> float | None:
    """A plottable float, or None: NaN/inf and non-numbers mean "not measured" as far as the report is concerned."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def fmt(x: Any, decimals: int, scale: float = 1.0, signed: bool = False) -> str:
    """Fixed decimals, except that a small non-zero value keeps three significant digits instead of printing 0.00."""
    v = finite(x)
    if v is None:
        return "n/a"
    v *= scale
    sign = "+" if signed else ""
    if v != 0 and abs(v) < 10 ** (-decimals):
        return f"{v:{sign}.3g}"
    return f"{v:{sign}.{decimals}f}"


def policy_order(results: dict[str, Any]) -> list[str]:
    """Full first (the reference every quality column is relative to), then the run's own order."""
    names = list((results.get("policies") or {}).keys())
    return sorted(names, key=lambda n: n != "full")


def jsonable(obj: Any) -> Any:
    """Non-finite floats become null: strict JSON readers (jq, browsers) reject the NaN/Infinity Python would write."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


_Column = tuple[str, Callable[[dict[str, Any]], str]]

_COLUMNS: tuple[_Column, ...] = (
    ("KV mean %", lambda e: fmt(e.get("kv_fraction_mean"), 1, 100)),
    ("KV peak %", lambda e: fmt(e.get("kv_fraction_peak"), 1, 100)),
    ("KV bytes mean %", lambda e: fmt(e.get("kv_bytes_fraction_mean"), 1, 100)),
    ("ppl", lambda e: fmt(e.get("ppl"), 3)),
    ("Δppl %", lambda e: fmt(e.get("ppl_delta_rel"), 2, 100, signed=True)),
    ("KL", lambda e: fmt(e.get("kl_mean"), 4)),
    ("pass-key %", lambda e: fmt(e.get("passkey_acc"), 0, 100)),
    ("multi-key %", lambda e: fmt(e.get("multikey_acc"), 0, 100)),
    ("BLEU-4 vs full", lambda e: fmt(e.get("bleu4_vs_full"), 1)),
    ("ROUGE-L vs full", lambda e: fmt(e.get("rougeL_vs_full"), 3)),
    ("tok/s", lambda e: fmt(e.get("tokens_per_s"), 1)),
    ("req/s", lambda e: fmt(e.get("requests_per_s"), 2)),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(results: dict[str, Any]) -> str:
    """The per-policy summary table on its own, so BENCHMARKS.md can show the same numbers as each report.md."""
    headers = ["policy", *(h for h, _ in _COLUMNS)]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join([":---", *(["---:"] * len(_COLUMNS))]) + "|",
    ]
    policies = results.get("policies") or {}
    for name in policy_order(results):
        entry = policies[name] or {}
        cells = [f"`{_cell(name)}`", *(_cell(fmt(entry)) for _, fmt in _COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _workload(entry: dict[str, Any] | None, measure: str) -> dict[str, Any]:
    return ((entry or {}).get("workloads") or {}).get(measure) or {}


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def _memory(w: dict[str, Any]) -> float | None:
    """A measure's mean memory for the equal-memory check: bytes over full's at the model's dtype (what rows at
    different KV dtypes or with demoted copies are matched on), tokens in results written before bytes were."""
    b = finite(w.get("kv_bytes_fraction_mean"))
    return b if b is not None else finite(w.get("kv_fraction_mean"))


def equal_memory_comparisons(results: dict[str, Any]) -> dict[str, Any]:
    """For each variant (a policy some baselines are matched to) and each measure: who is ahead at equal memory.

    The contenders are the variant and the baselines matched to it (``matched_to``); ``full`` is the reference, not
    a contender. The leader is the best value of the measure's quality key (``VERDICT_METRICS``), equal best values
    tie, and a measure nobody has a value for is left out. Baselines whose measured mean resident KV differs from
    the variant's by more than ``MEMORY_TOLERANCE`` are listed in ``memory_mismatch`` (relative difference), so a
    verdict that is not at equal memory says so.
    """
    policies = results.get("policies") or {}
    groups: dict[str, list[str]] = {}
    for name, entry in policies.items():
        target = (entry or {}).get("matched_to")
        if target in policies:
            groups.setdefault(target, []).append(name)
    out: dict[str, Any] = {}
    for variant, baselines in groups.items():
        contenders = [variant, *baselines]
        per: dict[str, Any] = {}
        for measure, (key, higher, _) in VERDICT_METRICS.items():
            values = {n: finite(_workload(policies[n], measure).get(key)) for n in contenders}
            known = {n: v for n, v in values.items() if v is not None}
            if not known:
                continue
            best = max(known.values()) if higher else min(known.values())
            ahead = [n for n, v in known.items() if _same(v, best)]
            kv = {n: _memory(_workload(policies[n], measure)) for n in contenders}
            peak = {n: finite(_workload(policies[n], measure).get("kv_fraction_peak")) for n in contenders}
            mismatch = {}
            for n in baselines:
                if kv[n] is not None and kv[variant]:
                    rel = kv[n] / kv[variant] - 1.0
                    if abs(rel) > MEMORY_TOLERANCE:
                        mismatch[n] = rel
            per[measure] = {
                "metric": key,
                "higher_is_better": higher,
                "values": values,
                "kv_fraction_mean": kv,
                "kv_fraction_peak": peak,
                "ahead": ahead,
                "variant_ahead": ahead == [variant],
                "memory_mismatch": mismatch,
            }
        out[variant] = {"baselines": baselines, "workloads": per}
    return out


def _pct(x: Any) -> str:
    return fmt(x, 1, 100)


def _measure_value(measure: str, w: dict[str, Any]) -> str:
    """A measure's deciding value with what is shown beside it, as the comparison table prints it."""
    key = VERDICT_METRICS[measure][0]
    if key == "kl_mean":
        text = f"KL {fmt(w.get('kl_mean'), 4)}"
        return text + (f", ppl {fmt(w.get('ppl'), 3)}" if measure == "prose" else "")
    if key == "acc":
        text = f"{fmt(w.get('acc'), 0, 100)}%"
        by = w.get("acc_by_filler") or {}
        if by:
            text += " (" + ", ".join(f"{k} {fmt(v, 0, 100)}%" for k, v in by.items()) + ")"
        return text
    return f"BLEU-4 {fmt(w.get('bleu4_vs_full'), 1)}, ROUGE-L {fmt(w.get('rougeL_vs_full'), 3)}"


def _span(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    lo, hi = min(vals), max(vals)
    return _pct(lo) if _same(lo, hi) or f"{100 * lo:.1f}" == f"{100 * hi:.1f}" else f"{_pct(lo)}–{_pct(hi)}"


def comparison_markdown(results: dict[str, Any]) -> str:
    """Per variant, per measure: the variant, the best of its matched baselines, who is ahead, and both memories."""
    comparisons = results.get("comparisons") or equal_memory_comparisons(results)
    policies = results.get("policies") or {}
    if not comparisons:
        return "_No baseline was matched to a variant's memory in this run._\n"
    parts = []
    for variant, comp in comparisons.items():
        baselines = comp["baselines"]
        names = ", ".join(f"`{_cell(b)}`" for b in baselines)
        parts.append(f"### `{_cell(variant)}` against {names}\n")
        lines = [
            f"| workload | decided by | `{_cell(variant)}` | best fixed baseline | ahead "
            f"| KV mean % ({_cell(variant)} / fixed) | KV peak % ({_cell(variant)} / fixed) |",
            "|:---|:---|:---|:---|:---|---:|---:|",
        ]
        ahead_on, tied_on, behind_on = [], [], []
        for measure, c in comp["workloads"].items():
            key, higher, _ = VERDICT_METRICS[measure]
            label = MEASURE_LABELS.get(measure, measure)
            known = {b: c["values"][b] for b in baselines if c["values"].get(b) is not None}
            best = (max if higher else min)(known, key=lambda b: known[b]) if known else None
            best_text = (
                f"`{_cell(best)}` {_measure_value(measure, _workload(policies[best], measure))}" if best else "n/a"
            )
            ahead = c["ahead"]
            verdict = f"`{_cell(ahead[0])}`" if len(ahead) == 1 else "tie: " + ", ".join(f"`{_cell(a)}`" for a in ahead)
            if c["memory_mismatch"]:
                verdict += (
                    " (memory differs: "
                    + ", ".join(f"`{_cell(n)}` {100 * r:+.0f}%" for n, r in c["memory_mismatch"].items())
                    + ")"
                )
            if c["variant_ahead"]:
                ahead_on.append(label)
            elif variant in ahead:
                tied_on.append(label)
            else:
                behind_on.append(label)
            decided = f"{_METRIC_NAMES.get(key, key)} {'↑' if higher else '↓'}"
            kv_cell = f"{_pct(c['kv_fraction_mean'].get(variant))} / " + _span(
                [c["kv_fraction_mean"].get(b) for b in baselines]
            )
            peak_cell = f"{_pct(c['kv_fraction_peak'].get(variant))} / " + _span(
                [c["kv_fraction_peak"].get(b) for b in baselines]
            )
            row = [
                label,
                decided,
                _measure_value(measure, _workload(policies[variant], measure)),
                best_text,
                verdict,
                kv_cell,
                peak_cell,
            ]
            lines.append("| " + " | ".join(_cell(x) if i < 2 else x for i, x in enumerate(row)) + " |")
        total = len(comp["workloads"])
        summary = f"`{_cell(variant)}` is ahead at equal memory on {len(ahead_on)} of {total} workloads"
        summary += f" ({', '.join(ahead_on)})" if ahead_on else ""
        summary += f", tied on {len(tied_on)}" + (f" ({', '.join(tied_on)})" if tied_on else "")
        summary += f", behind on {len(behind_on)}" + (f" ({', '.join(behind_on)})" if behind_on else "") + "."
        parts += ["\n".join(lines) + "\n", summary + "\n"]
    return "\n".join(parts)


def memory_markdown(results: dict[str, Any]) -> str:
    """Mean and peak resident KV of every policy on every measure, and over the whole suite."""
    policies = results.get("policies") or {}
    measures = [m for m in MEASURE_LABELS if any(_workload(e, m) for e in policies.values())]
    if not measures:
        return ""
    lines = [
        "| policy | " + " | ".join(MEASURE_LABELS[m] for m in measures) + " | all |",
        "|:---|" + "|".join(["---:"] * (len(measures) + 1)) + "|",
    ]
    for name in policy_order(results):
        entry = policies[name] or {}
        cells = [
            f"{_pct(_workload(entry, m).get('kv_fraction_mean'))} / {_pct(_workload(entry, m).get('kv_fraction_peak'))}"
            for m in measures
        ]
        cells.append(f"{_pct(entry.get('kv_fraction_mean'))} / {_pct(entry.get('kv_fraction_peak'))}")
        lines.append(f"| `{_cell(name)}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budgets_markdown(results: dict[str, Any]) -> str:
    """The fixed baselines' budgets in tokens, per variant they were matched to and per measure."""
    budgets = (results.get("settings") or {}).get("baseline_budgets") or {}
    if not budgets:
        return ""
    measures = [m for m in MEASURE_LABELS if any(m in b for b in budgets.values())]
    lines = [
        "| matched to | " + " | ".join(MEASURE_LABELS[m] for m in measures) + " | suite-wide |",
        "|:---|" + "|".join(["---:"] * (len(measures) + 1)) + "|",
    ]
    for variant, b in budgets.items():
        cells = [str(b.get(m, "n/a")) for m in [*measures, "overall"]]
        lines.append(f"| `{_cell(variant)}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _duration(seconds: Any) -> str:
    v = finite(seconds)
    if v is None:
        return "n/a"
    if v < 120:
        return f"{v:.0f} s"
    return f"{int(v // 60)} min {int(v % 60):02d} s"


def run_time_line(results: dict[str, Any]) -> str:
    """The run's wall time, the part spent on references, and the estimate the suite was sized by."""
    st = results.get("settings") or {}
    text = f"Run time: **{_duration(st.get('seconds'))}**"
    if st.get("seconds_references") is not None:
        refs = _duration(st.get("seconds_references"))
        text += f" (of which {refs} loading the model and building or reading the full-cache references)"
    per = st.get("seconds_per_policy") or {}
    if per:
        text += "; per policy: " + ", ".join(f"`{_cell(n)}` {_duration(v)}" for n, v in per.items())
    est = st.get("estimated_seconds_smollm2_cpu") or {}
    if est and results.get("model") == "smollm2-135m":
        text += f". Estimated before the run: {_duration(est.get('low'))} to {_duration(est.get('high'))}"
    return text + ".\n"


def settings_markdown(settings: Any) -> str:
    if not settings:
        return "_none recorded_\n"
    if not isinstance(settings, dict):
        return f"`{json.dumps(jsonable(settings))}`\n"
    lines = []
    for key, value in settings.items():
        shown = json.dumps(jsonable(value)) if isinstance(value, (dict, list, tuple)) else str(value)
        lines.append(f"- **{key}**: `{shown}`")
    return "\n".join(lines) + "\n"


HOW_TO_READ = (
    "**KV fraction** is the mean number of key/value tokens resident on the device divided by the number a full "
    "cache would hold at the same step (prompt plus tokens generated so far), over the steps whose output is "
    "measured (teacher-forced tokens; generated tokens after the first); *peak* is the largest number resident at "
    "any point of an item (prompt reading included) over the item's length, the largest over the items. "
    "Fixed baselines are matched to each variant's measured mean, workload by workload (the budgets table); "
    "*ahead at equal memory* names the best quality among a variant and its matched baselines. "
    "The quality columns are relative to the `full` cache: Δppl is the relative change in teacher-forced perplexity, "
    "KL the mean KL divergence of the next-token distribution from full's, and BLEU-4 / ROUGE-L compare free "
    "generations with full's generations of the same prompts (100 / 1.0 = identical text). Pass-key and multi-key "
    "are retrieval accuracies on prompts where a key is hidden deep in filler. In the memory/quality plane, "
    "good policies sit to the left (less memory) and near full's quality."
)


def split_words(results: dict[str, Any]) -> str:
    """Held-out items are the default; a run on the tuner's items says so where a reader looks first."""
    split = (results.get("settings") or {}).get("split")
    return f", {split} items" if split and split != "heldout" else ""
