"""The long-generation suite's report (``confkv bench --suite longgen``): ``results.json``, ``report.md`` with the
summary table, and ``curves.png``: per metric, the median and 10-90% band against generated position for every
policy, with the summary beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from confkv.bench.curves import METRICS

_TITLES = {
    "resident": "resident KV (tokens)",
    "kv_share": "resident KV / full's",
    "budget": "budget (tokens)",
    "entropy": "entropy (nats)",
    "gap": "top-1 - top-2 probability",
    "expanded": "budget expanded (share of runs)",
    "step_s": "step time (s)",
}


def _summary_lines(results: dict[str, Any]) -> list[str]:
    lines = ["| policy | req/s | vs full | out tok/s | KV share mean | KV share peak | expansions / 1k tokens | "
             "median step s | preemptions | BLEU-4 vs full | ROUGE-L vs full |",
             "|:---|" + "---:|" * 10]  # fmt: skip
    summary = results["summary"]
    full = next(iter(summary.values()))["requests_per_s"]
    for name, s in summary.items():
        lines.append(
            f"| `{name}` | {s['requests_per_s']:.3f} | {s['requests_per_s'] / full:.2f}x | "
            f"{s['output_tokens_per_s']:.1f} | {s['kv_share_mean']:.3f} | {s['kv_share_peak']:.3f} | "
            f"{s['expansions_per_1k_tokens']:.1f} | {s['step_s_median']:.3f} | {s['preemptions']} | "
            f"{s['bleu4_vs_full']:.1f} | {s['rougeL_vs_full']:.3f} |"
        )
    return lines


def write_curves_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``results.json``, ``report.md`` and ``curves.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "results.json", "report": out / "report.md", "curves": out / "curves.png"}
    paths["results"].write_text(json.dumps(results))
    s = results["settings"]
    lines = [
        f"# Long generation: {results['model']} ({results['created']}, commit `{results['commit']}`)",
        "",
        f"{s['runs']} runs per policy: prompts {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} tokens (mean "
        f"{s['prompt_tokens_mean']:.0f}), outputs {s['output_tokens'][0]}-{s['output_tokens'][1]} (mean "
        f"{s['output_tokens_mean']:.0f}, EOS ignored), all submitted at once; KV pool "
        f"{s['kv_cache_memory_bytes'] / 2**20:.1f} MiB ({s['full_fits']} full-cache sequences of the longest), "
        f"admission {s['admission']}, max_batch_size {s['max_batch_size']}, max_num_batched_tokens "
        f"{s.get('max_num_batched_tokens', 'n/a')}; {s['device']}, {s['threads']} threads; "
        f"{s['seconds']:.0f} s in all.",
        "",
        *_summary_lines(results),
        "",
        f"![per-position curves]({paths['curves'].name})",
    ]
    paths["report"].write_text("\n".join(lines) + "\n")

    panels = ["kv_share", *METRICS]
    fig = plt.figure(figsize=(16, 10))
    grid = fig.add_gridspec(3, 4)
    axes = [fig.add_subplot(grid[i // 3, i % 3]) for i in range(len(panels))]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes, panels, strict=False):
        for k, (name, curves) in enumerate(results["curves"].items()):
            b = curves[metric]
            xs = range(len(b["p50"]))
            nan = float("nan")
            p10, p50, p90 = ([nan if v is None else v for v in b[q]] for q in ("p10", "p50", "p90"))
            color = colors[k % len(colors)]
            ax.plot(xs, p50, color=color, lw=1.2, label=name)
            ax.fill_between(xs, p10, p90, color=color, alpha=0.15, lw=0)
        ax.set_title(_TITLES[metric], fontsize=10)
        ax.set_xlabel("generated position")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    text = fig.add_subplot(grid[:, 3])
    text.axis("off")
    rows = [f"{results['model']}, {s['runs']} runs per policy", "median, 10-90% band", ""]
    for name, m in results["summary"].items():
        rows += [name, f"  {m['requests_per_s']:.3f} req/s, KV {100 * m['kv_share_mean']:.0f}% of full's",
                 f"  BLEU-4 {m['bleu4_vs_full']:.1f}, ROUGE-L {m['rougeL_vs_full']:.3f}", ""]  # fmt: skip
    text.text(0.0, 1.0, "\n".join(rows), va="top", family="monospace", fontsize=9)
    fig.tight_layout()
    fig.savefig(paths["curves"], dpi=110)
    plt.close(fig)
    return paths
