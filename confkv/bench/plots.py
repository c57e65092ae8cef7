"""The benchmark's plots: where each policy sits between memory and quality, how resident KV moves over a long
generation, and pass-key accuracy by length and depth. Each plotter takes the results dict and a path, and returns
the path, or None when the results hold nothing to draw (the report then leaves the plot out).
"""

from __future__ import annotations

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

from confkv.bench.labels import MARKERS, dodge, place_labels, shifted
from confkv.bench.tables import finite, policy_order

PLOT_FILES: dict[str, str] = {
    "plane": "memory_quality.png",
    "trace": "kv_trace.png",
    "passkey": "passkey.png",
}
PLOT_CAPTIONS: dict[str, str] = {
    "plane": "Memory / quality plane",
    "trace": "Resident KV over a long generation",
    "passkey": "Pass-key accuracy by length and depth",
}
_DPI = 130


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
    return np.array([np.nan if finite(v) is None else float(v) for v in values], dtype=float)


def _no_data(ax: Axes, text: str = "not measured") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _markers(names: Iterable[str]) -> dict[str, tuple[str, float]]:
    """One shape per policy, the same in every plot."""
    return {n: (MARKERS[i % len(MARKERS)], 90.0) for i, n in enumerate(names)}


#: The two panels of the memory/quality plane: the quality key, its scale, the y label, the title, the measure whose
#: resident KV places a policy on x, and how the x axis says so.
_PLANE_PANELS = (
    ("ppl_delta_rel", 100.0, "Δ perplexity vs full (%)\nlower is better", "(a) perplexity on prose", "prose",
     "KV resident while scoring the prose items\n(fraction of the full cache)"),
    ("passkey_acc", 1.0, "pass-key accuracy\nhigher is better", "(b) pass-key retrieval", "passkey",
     "KV resident while answering the pass-key prompts\n(fraction of the full cache)"),
)  # fmt: skip


def plot_memory_quality(results: dict[str, Any], path: Path) -> Path | None:
    """Where each policy sits between memory and quality: the trade-off the whole project is about.

    Each panel places a policy at the memory it kept on that panel's own items (prose, pass-key prompts): a policy
    keeps more on some workloads than on others, and the baselines are matched to a variant workload by workload,
    so one suite-wide number would put them where they never were. The x labels say which memory each panel shows.
    """
    policies = results.get("policies") or {}
    names = policy_order(results)
    colors = _colors(names)
    shapes = _markers(names)
    points: list[list[tuple[str, float, float]]] = []
    for key, scale, _, _, measure, _ in _PLANE_PANELS:
        pts = []
        for name in names:
            entry = policies[name] or {}
            own = ((entry.get("workloads") or {}).get(measure) or {}).get("kv_fraction_mean")
            x = finite(own if own is not None else entry.get("kv_fraction_mean"))
            if x is None and name == "full":
                x = 1.0
            y = finite(entry.get(key))
            if x is not None and y is not None:
                pts.append((name, x, y * scale))
        points.append(pts)
    if not any(points):
        return None

    fig: Figure
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.6), layout="constrained")
    handles: dict[str, Any] = {}
    for ax, (key, _, ylabel, sub, _, xlabel), pts in zip(axes, _PLANE_PANELS, points, strict=True):
        ax.set_title(sub)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xlim(0, 1.1)
        ax.grid(True, alpha=0.3)
        if key == "ppl_delta_rel":
            ax.axhline(0, color="0.5", lw=0.8)
            ys = [y for _, _, y in pts]
            if ys:
                lo, hi = min(0.0, *ys), max(0.0, *ys)
                pad = 0.15 * (hi - lo or 1.0)
                ax.set_ylim(lo - pad, hi + pad)
        else:
            ax.set_ylim(-0.12, 1.12)
        absent = [n for n in names if n not in {p[0] for p in pts}]
        if absent:
            note = "not measured: " + ", ".join(absent)
            ax.text(0.99, 0.01, note, transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="0.4")
        if not pts:
            _no_data(ax)
            continue
        xy = [(x, y) for _, x, y in pts]
        offsets = dodge(ax, xy)
        for (name, x, y), dx in zip(pts, offsets, strict=True):
            marker, size = shapes[name]
            handles[name] = ax.scatter([x], [y], s=size, marker=marker, color=colors[name], label=name, zorder=3,
                                       edgecolor="black", linewidth=0.6, transform=shifted(ax, dx))  # fmt: skip
        place_labels(ax, xy, [n for n, _, _ in pts], colors=[colors[n] for n, _, _ in pts], offsets=offsets)
    fig.legend([handles[n] for n in names if n in handles], [n for n in names if n in handles],
               loc="outside right center", title="policy", fontsize=9)  # fmt: skip
    fig.suptitle(_title(results, "Memory vs quality") + "\nx: the memory a policy kept on that panel's own items; "
                 "markers on one spot are spread a few pixels sideways", fontsize=11)  # fmt: skip
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _same_traces(names: list[str], traces: dict[str, Any]) -> list[list[str]]:
    """Policies whose resident KV traces are identical, grouped (first seen first): fixed baselines at one budget
    hold the same number of keys at every step, and drawn one by one the last line would hide the others."""
    groups: list[list[str]] = []
    seen: list[np.ndarray] = []
    for name in names:
        values = _series(traces[name].get("resident"))
        for group, ref in zip(groups, seen, strict=True):
            if ref.shape == values.shape and np.array_equal(ref, values, equal_nan=True):
                group.append(name)
                break
        else:
            groups.append([name])
            seen.append(values)
    return groups


_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def plot_kv_trace(results: dict[str, Any], path: Path) -> Path | None:
    """How the resident KV moves token by token: shows the dynamic budget reacting to the confidence signals below.

    Policies with identical traces are drawn once, labelled with all their names; the others get their own line
    style, so every policy listed is visible."""
    traces = {k: v for k, v in (results.get("long_trace") or {}).items() if v and v.get("resident")}
    if not traces:
        return None
    policies = results.get("policies") or {}
    extra = [n for n in traces if n not in policies]
    names = [n for n in policy_order(results) if n in traces] + extra
    colors = _colors(policy_order(results) + extra)
    dyn = _dynamic_name(results, traces)

    fig: Figure
    fig, (top, low) = plt.subplots(
        2, 1, figsize=(13, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1]}, layout="constrained"
    )
    if "full" not in traces:  # without a full run, still show what a full cache would hold
        full_tokens = _series((traces[dyn] if dyn else next(iter(traces.values()))).get("full_tokens"))
        if full_tokens.size:
            x = np.arange(1, full_tokens.size + 1)
            top.plot(x, full_tokens, color="0.5", ls=":", lw=1.2, label="all tokens (full cache)")
    for i, group in enumerate(_same_traces(names, traces)):
        lead = group[0]
        resident = _series(traces[lead].get("resident"))
        x = np.arange(1, resident.size + 1)
        label = f"{lead} resident" if len(group) == 1 else f"{', '.join(group)} resident (identical)"
        wide = dyn in group
        top.plot(x, resident, color=colors[lead], ls=_LINESTYLES[i % len(_LINESTYLES)], lw=2.2 if wide else 1.6,
                 label=label)  # fmt: skip
    if dyn is not None:
        tr = traces[dyn]
        budget = _series(tr.get("budget"))
        if budget.size:
            top.plot(np.arange(1, budget.size + 1), budget, color=colors[dyn], ls=(0, (1, 1)), lw=1.4,
                     label=f"{dyn} budget")  # fmt: skip
        expanded = np.array([bool(e) for e in (tr.get("expanded") or [])], dtype=bool)
        if expanded.any():  # a rug along the bottom: dense expansions would bury the lines as markers
            rug = top.get_xaxis_transform()
            x = np.flatnonzero(expanded) + 1
            top.vlines(x, 0, 0.035, transform=rug, color="crimson", lw=0.8, label=f"{dyn} expansion (step)")
    top.set_ylabel("KV tokens resident")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, borderaxespad=0)
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
            handles += low.plot(np.arange(1, entropy.size + 1), entropy, color="tab:purple", lw=0.9, label="entropy")
        ent_t = finite(thresholds.get("entropy_threshold"))
        if ent_t is not None:
            handles.append(low.axhline(ent_t, color="tab:purple", ls="--", lw=1, label=f"entropy threshold {ent_t:g}"))
        low.set_ylabel("entropy (nats)", color="tab:purple")
        low.set_ylim(bottom=0)
        gap_ax = low.twinx()
        gap = _series(tr.get("gap"))
        if gap.size:
            handles += gap_ax.plot(
                np.arange(1, gap.size + 1), gap, color="tab:green", lw=0.9, alpha=0.8, label="top-1 − top-2 gap"
            )
        gap_t = finite(thresholds.get("gap_threshold"))
        if gap_t is not None:
            handles.append(gap_ax.axhline(gap_t, color="tab:green", ls="--", lw=1, label=f"gap threshold {gap_t:g}"))
        gap_ax.set_ylabel("probability gap", color="tab:green")
        gap_ax.set_ylim(0, 1.05)
        low.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize=8, borderaxespad=0)
        low.set_title(f"Confidence signals of {dyn} (uncertain: entropy above or gap below its threshold)")
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
    f = finite(v)
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
        f = finite(v)
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
    order = policy_order(results) + [n for n in grid if n not in (results.get("policies") or {})]
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


PLOTTERS: dict[str, Callable[[dict[str, Any], Path], Path | None]] = {
    "plane": plot_memory_quality,
    "trace": plot_kv_trace,
    "passkey": plot_passkey,
}
