"""The throughput suite's report (``confkv bench --suite throughput``): ``results.json``, ``report.md`` with one
table per scenario, and two plots (requests/s and time to first token by policy; running sequences over time)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _sections(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("burst", results)] if "policies" in results else []
    out += [(name, results[name]) for name in ("poisson", "longgen", "longgen_poisson") if name in results]
    return out


def _stream_line(s: dict[str, Any]) -> str:
    """One sentence on a stream: its requests, lengths and pool."""
    outputs = f"outputs {s['output_tokens'][0]}-{s['output_tokens'][1]} tokens (mean {s['output_tokens_mean']:.0f})"
    if s.get("max_tokens"):
        outputs = f"outputs of {s['max_tokens']} tokens each"
    return (
        f"{s['requests']} {s.get('stream', 'chat')} requests, prompts {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} "
        f"tokens (mean {s['prompt_tokens_mean']:.0f}), {outputs}; KV pool {s['kv_cache_memory_bytes'] / 2**20:.0f} "
        f"MiB = {s['full_fits']} full-cache sequences of the longest request; max_batch_size {s['max_batch_size']}"
        + (f", max_num_batched_tokens {s['max_num_batched_tokens']}" if "max_num_batched_tokens" in s else "")
    )


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _ci(bounds: list[float] | None, spec: str, scale: float = 1.0) -> str:
    """`` [low, high]`` after a figure when it has an interval, nothing otherwise."""
    return "" if not bounds else f" [{format(scale * bounds[0], spec)}, {format(scale * bounds[1], spec)}]"


def _interval_line(sec: dict[str, Any]) -> str:
    """How the section's intervals were made (``intervals.py``)."""
    kv = "KV %: 95% bootstrap interval over the requests (1,000 resamples)"
    n = sec.get("repeats", 1)
    if n < 2:
        return f"One run per row (no interval on requests/s: `--repeats N` gives one); {kv}."
    return (
        f"Requests/s: the mean of {n} runs per row (round-robin) with its 95% Student's t interval; vs full: bounded "
        f"by the two means' 97.5% intervals (Bonferroni, at least 95% together); {kv}; the other columns are the "
        f"first run's."
    )


def write_throughput_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``results.json``, ``report.md`` and two plots (requests/s and TTFT by policy; running sequences over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "results.json", "report": out / "report.md", "rates": out / "throughput.png",
             "running": out / "running.png"}  # fmt: skip
    paths["results"].write_text(json.dumps(results, indent=2))

    s = results["settings"]
    lines = [
        f"# Throughput: {results['model']} ({results['created']}, commit `{results['commit']}`)",
        "",
        f"{_stream_line(s)}; admission {', '.join(s.get('admissions', ['reserve']))}; {s['device']}, "
        f"{s['threads']} threads; {s['seconds']:.0f} s in all.",
    ]
    for scenario, sec in _sections(results):
        title = f"Poisson arrivals at {sec['arrival_rate']} requests/s" if "arrival_rate" in sec else (
            "all requests submitted at the start")  # fmt: skip
        lines += ["", f"## {scenario}: {title}", ""]
        if "settings" in sec:
            lines += [_stream_line(sec["settings"]) + ".", ""]
        if sec.get("speed_reference", "full") != "full":
            lines += [f"vs full: against `{sec['speed_reference']}`; quality against `{sec['quality_reference']}`.", ""]
        lines += [_interval_line(sec), ""]
        lines += [
            "KV %: resident tokens over full's; KV bytes %: their bytes at the row's KV dtype over full's at the "
            "model's dtype (every row's pool has the same bytes: a quantised one holds more tokens).",
            "",
        ]
        lines += [
                  "| policy | req/s | vs full | out tok/s | mean running | TTFT p50 s | TTFT p99 s | latency p50 s | "
                  "latency p99 s | preemptions | peak pool % | KV % | KV bytes % | ROUGE-L vs full | exact vs full | "
                  "KV dtype | pool tokens |",
                  "|:---|" + "---:|" * 14 + ":---|---:|"]  # fmt: skip
        rows = dict(sec["policies"])
        if "hf_static" in sec:
            rows["hf_static"] = sec["hf_static"]
        full_rps = sec["policies"].get(sec.get("speed_reference", "full"), {}).get("requests_per_s")
        for name, m in rows.items():
            ratio = m["requests_per_s"] / full_rps if full_rps else None
            peak = m.get("peak_pool_usage")
            kvf = m.get("kv_fraction_mean")
            kvb = m.get("kv_bytes_fraction_mean")
            lines.append(
                f"| `{name}` | {m['requests_per_s']:.3f}{_ci(m.get('requests_per_s_ci'), '.3f')} | "
                f"{_fmt(ratio, '.2f')}x{_ci(m.get('requests_per_s_vs_full_ci'), '.2f')} | "
                f"{m['output_tokens_per_s']:.1f} | "
                f"{_fmt(m.get('mean_running'), '.1f')} | {_fmt(m['ttft_p50_s'], '.1f')} | "
                f"{_fmt(m['ttft_p99_s'], '.1f')} | {_fmt(m['latency_p50_s'], '.1f')} | "
                f"{_fmt(m['latency_p99_s'], '.1f')} | {_fmt(m.get('preemptions'), 'd')} | "
                f"{_fmt(None if peak is None else 100 * peak, '.0f')} | "
                f"{_fmt(None if kvf is None else 100 * kvf, '.0f')}{_ci(m.get('kv_fraction_ci'), '.0f', 100)} | "
                f"{_fmt(None if kvb is None else 100 * kvb, '.0f')}{_ci(m.get('kv_bytes_fraction_ci'), '.0f', 100)} | "
                f"{_fmt(m.get('rougeL_vs_full'), '.3f')} | "
                f"{_fmt(m.get('exact_match_vs_full'), '.2f')} | {m.get('kv_cache_dtype', '')} | "
                f"{_fmt(m.get('pool_tokens'), 'd')} |"
            )
    lines += ["", f"![requests/s and TTFT]({paths['rates'].name})", ""]
    lines += [f"![running sequences]({paths['running'].name})"]
    paths["report"].write_text("\n".join(lines) + "\n")

    sections = _sections(results)
    fig, axes = plt.subplots(len(sections), 2, figsize=(10, 3.4 * len(sections)), squeeze=False)
    for row, (scenario, sec) in enumerate(sections):
        rows = dict(sec["policies"])
        if "hf_static" in sec:
            rows["hf_static"] = sec["hf_static"]
        names = list(rows)
        axes[row][0].bar(names, [rows[n]["requests_per_s"] for n in names], color="tab:blue")
        axes[row][0].set_ylabel("requests/s")
        axes[row][0].set_title(f"{scenario}: requests/s")
        axes[row][1].bar(names, [rows[n]["ttft_p50_s"] or 0 for n in names], color="tab:orange", label="p50")
        axes[row][1].scatter(names, [rows[n]["ttft_p99_s"] or 0 for n in names], color="k", marker="_", s=300,
                             label="p99")  # fmt: skip
        axes[row][1].set_ylabel("time to first token (s)")
        axes[row][1].set_title(f"{scenario}: TTFT")
        axes[row][1].legend()
        for ax in axes[row]:
            ax.tick_params(axis="x", rotation=30)
            ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(paths["rates"], dpi=120)
    plt.close(fig)

    traces = results.get("running_trace", {})
    fig, axes = plt.subplots(1, max(1, len(traces)), figsize=(6 * max(1, len(traces)), 3.6), squeeze=False)
    for ax, (scenario, per_policy) in zip(axes[0], traces.items(), strict=False):
        for name, points in per_policy.items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.step(xs, ys, where="post", label=name, lw=1)
        ax.set_xlabel("seconds")
        ax.set_ylabel("running sequences")
        ax.set_title(f"{scenario}: running sequences over time")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths["running"], dpi=120)
    plt.close(fig)
    return paths
