"""Turn one benchmark run's results into ``results.json``, ``report.md`` and PNG plots.

The results are a plain dict (the schema ``confkv.bench.suite.run_suite`` returns) so a run can be re-rendered from
its ``results.json`` without the model. Anything not measured is ``None``: the table prints "n/a" and the plots leave
that point, line or panel out rather than fail, because a partial run is still worth reading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run on headless machines

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

REQUIRED_POLICY_KEYS: tuple[str, ...] = (
    "kv_fraction_mean",
    "kv_fraction_peak",
    "ppl",
    "ppl_delta_rel",
    "kl_mean",
    "passkey_acc",
    "bleu4_vs_full",
    "rougeL_vs_full",
    "tokens_per_s",
    "requests_per_s",
)

#: Fields of every measure's entry under a policy's ``workloads`` (the standard suite reports memory per measure).
WORKLOAD_KEYS: tuple[str, ...] = (
    "kv_fraction_mean",
    "kv_fraction_peak",
    "kv_mean_tokens",
    "kv_peak_tokens",
    "budget_tokens",
    "steps",
    "items",
    "seconds",
)
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

PLOT_FILES: dict[str, str] = {
    "plane": "memory_quality.png",
    "trace": "kv_trace.png",
    "passkey": "passkey.png",
}
_PLOT_CAPTIONS: dict[str, str] = {
    "plane": "Memory / quality plane",
    "trace": "Resident KV over a long generation",
    "passkey": "Pass-key accuracy by length and depth",
}
_DPI = 130


# --------------------------------------------------------------------------------------------------------------------
# numbers and names


def _finite(x: Any) -> float | None:
    """A plottable float, or None: NaN/inf and non-numbers mean "not measured" as far as the report is concerned."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _fmt(x: Any, decimals: int, scale: float = 1.0, signed: bool = False) -> str:
    """Fixed decimals, except that a small non-zero value keeps three significant digits instead of printing 0.00."""
    v = _finite(x)
    if v is None:
        return "n/a"
    v *= scale
    sign = "+" if signed else ""
    if v != 0 and abs(v) < 10 ** (-decimals):
        return f"{v:{sign}.3g}"
    return f"{v:{sign}.{decimals}f}"


def _policy_order(results: dict[str, Any]) -> list[str]:
    """Full first (the reference every quality column is relative to), then the run's own order."""
    names = list((results.get("policies") or {}).keys())
    return sorted(names, key=lambda n: n != "full")


def _colors(names: Iterable[str]) -> dict[str, Any]:
    """One color per policy, the same in every plot, so the plots can be read together."""
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(names)}


def _title(results: dict[str, Any], what: str) -> str:
    return f"{what} — {results.get('model', '?')}, suite {results.get('suite', '?')}"


def _dynamic_name(results: dict[str, Any], traces: dict[str, Any]) -> str | None:
    """The run whose budget and signals the trace plot shows: ``dynamic``, else the first policy file using it."""
    if "dynamic" in traces:
        return "dynamic"
    for name, entry in (results.get("policies") or {}).items():
        if name in traces and ((entry or {}).get("policy") or {}).get("controller") == "dynamic":
            return name
    return None


def _series(values: Any) -> np.ndarray:
    """A float array with None as NaN, so a gap in a trace breaks the line instead of crashing the plot."""
    if not values:
        return np.array([], dtype=float)
    return np.array([np.nan if _finite(v) is None else float(v) for v in values], dtype=float)


# --------------------------------------------------------------------------------------------------------------------
# validation and JSON


def validate_results(results: dict[str, Any]) -> None:
    """Reject a results dict whose policies lack a required key, so a schema drift fails here, not as a blank cell.

    The keys must be present; their values may be None (not measured).
    """
    policies = results.get("policies")
    if not isinstance(policies, dict) or not policies:
        raise ValueError("results['policies'] must be a non-empty dict of policy name -> measurements")
    for name, entry in policies.items():
        if not isinstance(entry, dict):
            raise ValueError(f"results['policies'][{name!r}] must be a dict")
        missing = [k for k in REQUIRED_POLICY_KEYS if k not in entry]
        if missing:
            raise ValueError(f"policy {name!r} lacks {', '.join(missing)} (use None for not measured)")


def _jsonable(obj: Any) -> Any:
    """Non-finite floats become null: strict JSON readers (jq, browsers) reject the NaN/Infinity Python would write."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


# --------------------------------------------------------------------------------------------------------------------
# markdown

_Column = tuple[str, Callable[[dict[str, Any]], str]]

_COLUMNS: tuple[_Column, ...] = (
    ("KV mean %", lambda e: _fmt(e.get("kv_fraction_mean"), 1, 100)),
    ("KV peak %", lambda e: _fmt(e.get("kv_fraction_peak"), 1, 100)),
    ("ppl", lambda e: _fmt(e.get("ppl"), 3)),
    ("Δppl %", lambda e: _fmt(e.get("ppl_delta_rel"), 2, 100, signed=True)),
    ("KL", lambda e: _fmt(e.get("kl_mean"), 4)),
    ("pass-key %", lambda e: _fmt(e.get("passkey_acc"), 0, 100)),
    ("multi-key %", lambda e: _fmt(e.get("multikey_acc"), 0, 100)),
    ("BLEU-4 vs full", lambda e: _fmt(e.get("bleu4_vs_full"), 1)),
    ("ROUGE-L vs full", lambda e: _fmt(e.get("rougeL_vs_full"), 3)),
    ("tok/s", lambda e: _fmt(e.get("tokens_per_s"), 1)),
    ("req/s", lambda e: _fmt(e.get("requests_per_s"), 2)),
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
    for name in _policy_order(results):
        entry = policies[name] or {}
        cells = [f"`{_cell(name)}`", *(_cell(fmt(entry)) for _, fmt in _COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _workload(entry: dict[str, Any] | None, measure: str) -> dict[str, Any]:
    return ((entry or {}).get("workloads") or {}).get(measure) or {}


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


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
            values = {n: _finite(_workload(policies[n], measure).get(key)) for n in contenders}
            known = {n: v for n, v in values.items() if v is not None}
            if not known:
                continue
            best = max(known.values()) if higher else min(known.values())
            ahead = [n for n, v in known.items() if _same(v, best)]
            kv = {n: _finite(_workload(policies[n], measure).get("kv_fraction_mean")) for n in contenders}
            peak = {n: _finite(_workload(policies[n], measure).get("kv_fraction_peak")) for n in contenders}
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
    return _fmt(x, 1, 100)


def _measure_value(measure: str, w: dict[str, Any]) -> str:
    """A measure's deciding value with what is shown beside it, as the comparison table prints it."""
    key = VERDICT_METRICS[measure][0]
    if key == "kl_mean":
        text = f"KL {_fmt(w.get('kl_mean'), 4)}"
        return text + (f", ppl {_fmt(w.get('ppl'), 3)}" if measure == "prose" else "")
    if key == "acc":
        text = f"{_fmt(w.get('acc'), 0, 100)}%"
        by = w.get("acc_by_filler") or {}
        if by:
            text += " (" + ", ".join(f"{k} {_fmt(v, 0, 100)}%" for k, v in by.items()) + ")"
        return text
    return f"BLEU-4 {_fmt(w.get('bleu4_vs_full'), 1)}, ROUGE-L {_fmt(w.get('rougeL_vs_full'), 3)}"


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
    for name in _policy_order(results):
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
    v = _finite(seconds)
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


def _settings_md(settings: Any) -> str:
    if not settings:
        return "_none recorded_\n"
    if not isinstance(settings, dict):
        return f"`{json.dumps(_jsonable(settings))}`\n"
    lines = []
    for key, value in settings.items():
        shown = json.dumps(_jsonable(value)) if isinstance(value, (dict, list, tuple)) else str(value)
        lines.append(f"- **{key}**: `{shown}`")
    return "\n".join(lines) + "\n"


_HOW_TO_READ = (
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


def _split_words(results: dict[str, Any]) -> str:
    """Held-out items are the default; a run on the tuner's items says so where a reader looks first."""
    split = (results.get("settings") or {}).get("split")
    return f", {split} items" if split and split != "heldout" else ""


def _report_md(results: dict[str, Any], plots: dict[str, Path]) -> str:
    parts = [
        f"# confkv benchmark: {results.get('model', '?')}, suite {results.get('suite', '?')}{_split_words(results)}\n",
        f"Commit `{results.get('commit') or 'n/a'}`, created {results.get('created') or 'n/a'}.\n",
        run_time_line(results),
        "## Settings\n",
        _settings_md(results.get("settings")),
        "## Results\n",
        markdown_table(results),
    ]
    memory = memory_markdown(results)
    if memory:
        parts += ["## Resident KV per workload (mean % / peak % of the full cache)\n", memory]
    budgets = budgets_markdown(results)
    if budgets:
        parts += ["## Baseline budgets (tokens), matched to each variant's mean resident KV\n", budgets]
    if any((e or {}).get("matched_to") for e in (results.get("policies") or {}).values()):
        parts += ["## Who is ahead at equal memory\n", comparison_markdown(results)]
    if plots:
        parts.append("## Plots\n")
        for key, path in plots.items():
            parts.append(f"### {_PLOT_CAPTIONS[key]}\n\n![{_PLOT_CAPTIONS[key]}]({path.name})\n")
    parts += ["## How to read this\n", _HOW_TO_READ + "\n"]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------------------------
# plots


def _no_data(ax: Axes, text: str = "not measured") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def plot_memory_quality(results: dict[str, Any], path: Path) -> Path | None:
    """Where each policy sits between memory and quality: the trade-off the whole project is about."""
    policies = results.get("policies") or {}
    names = _policy_order(results)
    colors = _colors(names)
    panels = (
        ("ppl_delta_rel", 100.0, "Δ perplexity vs full (%)\nlower is better", "(a) perplexity"),
        ("passkey_acc", 1.0, "pass-key accuracy\nhigher is better", "(b) pass-key retrieval"),
    )
    measure_of = {"ppl_delta_rel": "prose", "passkey_acc": "passkey"}  # each panel at its own workload's memory
    points: list[list[tuple[str, float, float]]] = []
    for key, scale, _, _ in panels:
        pts = []
        for name in names:
            entry = policies[name] or {}
            own = ((entry.get("workloads") or {}).get(measure_of[key]) or {}).get("kv_fraction_mean")
            x = _finite(own if own is not None else entry.get("kv_fraction_mean"))
            if x is None and name == "full":
                x = 1.0
            y = _finite(entry.get(key))
            if x is not None and y is not None:
                pts.append((name, x, y * scale))
        points.append(pts)
    if not any(points):
        return None

    fig: Figure
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for ax, (key, _, ylabel, sub), pts in zip(axes, panels, points, strict=True):
        ax.set_title(sub)
        ax.set_xlabel("KV resident (fraction of full cache)")
        ax.set_ylabel(ylabel)
        ax.set_xlim(0, 1.1)
        ax.grid(True, alpha=0.3)
        if key == "ppl_delta_rel":
            ax.axhline(0, color="0.5", lw=0.8)
        else:
            ax.set_ylim(-0.05, 1.1)
        absent = [n for n in names if n not in {p[0] for p in pts}]
        if absent:
            note = "not measured: " + ", ".join(absent)
            ax.text(0.99, 0.01, note, transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="0.4")
        if not pts:
            _no_data(ax)
            continue
        for name, x, y in pts:
            ax.scatter([x], [y], s=70, color=colors[name], label=name, zorder=3, edgecolor="black", linewidth=0.5)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
        ax.legend(loc="best", fontsize=9)
    fig.suptitle(_title(results, "Memory vs quality"))
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_kv_trace(results: dict[str, Any], path: Path) -> Path | None:
    """How the resident KV moves token by token: shows the dynamic budget reacting to the confidence signals below."""
    traces = {k: v for k, v in (results.get("long_trace") or {}).items() if v and v.get("resident")}
    if not traces:
        return None
    policies = results.get("policies") or {}
    extra = [n for n in traces if n not in policies]
    names = [n for n in _policy_order(results) if n in traces] + extra
    colors = _colors(_policy_order(results) + extra)
    dyn = _dynamic_name(results, traces)

    fig: Figure
    fig, (top, low) = plt.subplots(
        2, 1, figsize=(12, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1]}, constrained_layout=True
    )
    if "full" not in traces:  # without a full run, still show what a full cache would hold
        full_tokens = _series((traces[dyn] if dyn else next(iter(traces.values()))).get("full_tokens"))
        if full_tokens.size:
            x = np.arange(1, full_tokens.size + 1)
            top.plot(x, full_tokens, color="0.5", ls=":", lw=1.2, label="all tokens (full cache)")
    for name in names:
        resident = _series(traces[name].get("resident"))
        x = np.arange(1, resident.size + 1)
        top.plot(x, resident, color=colors[name], lw=1.8 if name == dyn else 1.3, label=f"{name} resident")
    if dyn is not None:
        tr = traces[dyn]
        budget = _series(tr.get("budget"))
        if budget.size:
            top.plot(np.arange(1, budget.size + 1), budget, color=colors[dyn], ls="--", lw=1.2, label=f"{dyn} budget")
        expanded = np.array([bool(e) for e in (tr.get("expanded") or [])], dtype=bool)
        if expanded.any():  # a rug along the bottom: dense expansions would bury the lines as markers
            rug = top.get_xaxis_transform()
            x = np.flatnonzero(expanded) + 1
            top.vlines(x, 0, 0.035, transform=rug, color="crimson", lw=0.8, label=f"{dyn} expansion")
    top.set_ylabel("KV tokens resident")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left", fontsize=9)
    top.set_title("Resident KV on one long generation")

    if dyn is None or not (traces[dyn].get("entropy") or traces[dyn].get("gap")):
        _no_data(low, "no dynamic trace")
        low.set_ylabel("confidence")
    else:
        tr = traces[dyn]
        thresholds = ((policies.get(dyn) or {}).get("policy")) or {}
        handles = []
        entropy = _series(tr.get("entropy"))
        if entropy.size:
            handles += low.plot(np.arange(1, entropy.size + 1), entropy, color="tab:purple", lw=0.8, label="entropy")
        ent_t = _finite(thresholds.get("entropy_threshold"))
        if ent_t is not None:
            handles.append(low.axhline(ent_t, color="tab:purple", ls="--", lw=1, label=f"entropy threshold {ent_t:g}"))
        low.set_ylabel("entropy (nats)", color="tab:purple")
        low.set_ylim(bottom=0)
        gap_ax = low.twinx()
        gap = _series(tr.get("gap"))
        if gap.size:
            handles += gap_ax.plot(
                np.arange(1, gap.size + 1), gap, color="tab:green", lw=0.8, alpha=0.8, label="top-1 − top-2 gap"
            )
        gap_t = _finite(thresholds.get("gap_threshold"))
        if gap_t is not None:
            handles.append(gap_ax.axhline(gap_t, color="tab:green", ls="--", lw=1, label=f"gap threshold {gap_t:g}"))
        gap_ax.set_ylabel("probability gap", color="tab:green")
        gap_ax.set_ylim(0, 1.05)
        low.legend(handles=handles, loc="upper right", fontsize=8, ncol=2)
        low.set_title(f"Confidence signals of {dyn}")
    low.grid(True, alpha=0.3)
    low.set_xlabel("generated token")
    fig.suptitle(_title(results, "KV over time"))
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _label(v: Any) -> str:
    """Tick text: ``0.3`` rather than ``0.30000000000000004`` when a depth was computed; a (filler, length)
    column as two lines."""
    if isinstance(v, tuple):
        return f"{_label(v[1])}\n{v[0]}"
    f = _finite(v)
    return "?" if v is None else (f"{f:g}" if f is not None else str(v))


def _column(r: dict[str, Any], fillers: bool) -> Any:
    """A grid column: the length, or (filler, length) when the grid mixes fillers."""
    return (str(r.get("filler")), r.get("length")) if fillers else r.get("length")


def _grid_cells(records: list[dict[str, Any]]) -> tuple[list[Any], list[Any], np.ndarray]:
    """Accuracy per (depth, column) cell, a column being a length or a (filler, length) pair; NaN where the grid
    has no item."""

    def key(v: Any) -> tuple[Any, ...]:
        if isinstance(v, tuple):
            return (v[0], *key(v[1]))
        f = _finite(v)
        return (f is None, f if f is not None else 0.0, str(v))

    fillers = len({r.get("filler") for r in records if r.get("filler") is not None}) > 1
    lengths = sorted({_column(r, fillers) for r in records}, key=key)
    depths = sorted({r.get("depth") for r in records}, key=key)
    hits = np.zeros((len(depths), len(lengths)))
    count = np.zeros_like(hits)
    for r in records:
        i, j = depths.index(r.get("depth")), lengths.index(_column(r, fillers))
        count[i, j] += 1
        hits[i, j] += bool(r.get("correct"))
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(count > 0, hits / np.maximum(count, 1), np.nan)
    return lengths, depths, acc


def plot_passkey(results: dict[str, Any], path: Path) -> Path | None:
    """Where retrieval breaks: a fixed window fails at shallow depths of long prompts, which one mean number hides."""
    grid = results.get("passkey_grid") or {}
    order = _policy_order(results) + [n for n in grid if n not in (results.get("policies") or {})]
    names = [n for n in order if grid.get(n)]
    if not names:
        return None
    ncols = min(3, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig: Figure
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.8 * ncols + 0.8, 3.8 * nrows + 0.6), squeeze=False, constrained_layout=True
    )
    image = None
    for ax, name in zip(axes.flat, names, strict=False):
        lengths, depths, acc = _grid_cells(grid[name])
        cmap = plt.get_cmap("RdYlGn").with_extremes(bad="0.85")
        image = ax.imshow(np.ma.masked_invalid(acc), cmap=cmap, vmin=0, vmax=1, aspect="auto", origin="lower")
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                v = acc[i, j]
                text, dark = ("–", False) if np.isnan(v) else (f"{v:.2f}", v < 0.2 or v > 0.8)
                ax.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
        ax.set_xticks(range(len(lengths)), [_label(v) for v in lengths])
        ax.set_yticks(range(len(depths)), [_label(v) for v in depths])
        ax.set_xlabel("prompt length (tokens)" + (" and filler" if any(isinstance(v, tuple) for v in lengths) else ""))
        ax.set_ylabel("key depth (0 = start)")
        records = grid[name]
        overall = sum(bool(r.get("correct")) for r in records) / len(records)
        ax.set_title(f"{name}: {100 * overall:.0f}% of {len(records)} items")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(_title(results, "Pass-key accuracy by length × depth"))
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.85, label="accuracy")
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


_PLOTTERS: dict[str, Callable[[dict[str, Any], Path], Path | None]] = {
    "plane": plot_memory_quality,
    "trace": plot_kv_trace,
    "passkey": plot_passkey,
}


# --------------------------------------------------------------------------------------------------------------------
# entry point


def write_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json``, the plots that have data, and ``report.md`` linking them; return what was written.

    A plot with nothing to show (say, no traces recorded) is left out of the folder, the returned dict and the report.
    """
    validate_results(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    results_path = out / "results.json"
    results_path.write_text(json.dumps(_jsonable(results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    written["results"] = results_path
    plots: dict[str, Path] = {}
    for key, plotter in _PLOTTERS.items():
        path = plotter(results, out / PLOT_FILES[key])
        if path is not None:
            plots[key] = path
    report_path = out / "report.md"
    report_path.write_text(_report_md(results, plots), encoding="utf-8")
    written["report"] = report_path
    written.update(plots)
    return written
