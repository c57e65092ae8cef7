"""The long-generation headline as one table (issue 34): per policy its KV dtype and resident KV share (in tokens,
and in bytes at that dtype against ``full``'s at the model's dtype, so ``snapkv@128:int8``'s quantised tokens count
at what they cost), requests/s against on-demand ``full``, fidelity on ``full``'s answers (KL, top-1 agreement), and
BLEU-4 / ROUGE-L of its own answers against ``full``'s, each with its 95% interval, assembled from the runs that
measured them.

    python benchmarks/headline.py --throughput bench-out/longgen/results.json --fidelity fidelity.json

``--plot PATH`` also draws the frontier: requests/s against on-demand ``full`` beside KL and beside BLEU-4, one
point per row measured by both (the confidence rules, named ``dynamic*``, apart from the fixed baselines).

``--throughput``: ``results.json`` of ``confkv bench --suite throughput --scenarios longgen`` (``--repeats N`` for
intervals on requests/s); several runs may be given, each row's ratio is against the ``full`` of its own run and the
first run's row of a name is kept. ``--fidelity``: the JSON that ``benchmarks/longgen_fidelity.py --json`` prints
(its last line); several may be given, the first file's row of a name is kept. A row measured by only one of the
two has the other's columns empty; ``full`` is the reference of fidelity and text (KL 0, BLEU-4 100 by definition).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REFERENCE = "full"


def _load_json(path: str) -> dict[str, Any]:
    """A results file, or the last JSON line of a script's output."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
    raise SystemExit(f"{path}: no JSON object in it")


def _section(results: dict[str, Any], path: str) -> dict[str, Any]:
    sec = results.get("longgen") or (results if results.get("settings", {}).get("stream") == "longgen" else None)
    if not sec or "policies" not in sec:
        raise SystemExit(f"{path}: no longgen section (run the throughput suite with --scenarios longgen)")
    return sec


def _plain(name: str) -> str:
    """A throughput row under the default admission by its policy's name (``dynamic:on_demand`` -> ``dynamic``, as
    fidelity names it); ``:reserve`` rows and the ceiling (``full:8x``) keep theirs."""
    return name.removesuffix(":on_demand")


def assemble(throughputs: list[dict[str, Any]], fidelities: list[dict[str, Any]]) -> dict[str, Any]:
    """The table's rows (throughput's names first, in their order, then fidelity-only rows) and its caption facts."""
    rows: dict[str, dict[str, Any]] = {}
    references = []
    for run, results in enumerate(throughputs, 1):
        sec = _section(results, "throughput")
        ref = sec.get("speed_reference", REFERENCE)
        references.append({"row": ref, "requests_per_s": sec["policies"][ref]["requests_per_s"],
                           "requests_per_s_ci": sec["policies"][ref].get("requests_per_s_ci"),
                           "repeats": sec.get("repeats", 1), "commit": results.get("commit")})  # fmt: skip
        for name, m in sec["policies"].items():
            row = rows.setdefault(_plain(name), {})
            if "requests_per_s" in row:
                continue
            kvb = m.get("kv_bytes_fraction_mean")  # absent from runs before rows had their own dtype
            row.update({
                "kv_cache_dtype": m.get("kv_cache_dtype", results.get("settings", {}).get("kv_cache_dtype")),
                "kv_share": [m["kv_fraction_mean"], *(m.get("kv_fraction_ci") or [None, None])],
                "kv_bytes_share": None if kvb is None else [kvb, *(m.get("kv_bytes_fraction_ci") or [None, None])],
                "requests_per_s": [m["requests_per_s"], *(m.get("requests_per_s_ci") or [None, None])],
                "vs_full": [m["requests_per_s_vs_full"], *(m.get("requests_per_s_vs_full_ci") or [None, None])],
                "peak_pool": m.get("peak_pool_usage"),
                "reference_of_speed": name == ref,
                "run": run,
            })  # fmt: skip
    for results in fidelities:
        for name, q in results["policies"].items():
            row = rows.setdefault(name, {})
            if "kl" not in row:
                row.update({k: q[k] for k in ("kl", "top1_agreement", "bleu4_vs_full", "rougeL_vs_full")})
                row["kv_share_scoring"] = q["kv_fraction"]
                row["kv_bytes_share_scoring"] = q.get("kv_bytes_fraction")
                row.setdefault("kv_cache_dtype", q.get("kv_cache_dtype"))
    if REFERENCE in rows and fidelities:
        rows[REFERENCE].update({"kl": [0.0, None, None], "top1_agreement": [1.0, None, None],
                                "bleu4_vs_full": [100.0, None, None], "rougeL_vs_full": [1.0, None, None],
                                "kv_share_scoring": [1.0, None, None],
                                "kv_bytes_share_scoring": [1.0, None, None]})  # fmt: skip
    return {"rows": rows, "speed_references": references,
            "fidelity_requests": [f.get("requests") for f in fidelities]}  # fmt: skip


def _cell(v: list | None, spec: str, scale: float = 1.0) -> str:
    if not v or v[0] is None:
        return ""
    text = format(scale * v[0], spec)
    if v[1] is not None and v[2] is not None:
        text += f" [{format(scale * v[1], spec)}, {format(scale * v[2], spec)}]"
    return text


def markdown(table: dict[str, Any]) -> str:
    lines = [
        "| policy | KV share (served) | KV dtype | KV bytes share (served) | req/s | vs on-demand `full` | "
        "KV share (scoring) | KV bytes share (scoring) | KL on full's answers | top-1 agreement | BLEU-4 vs full | "
        "ROUGE-L vs full |",
        "|:---|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in table["rows"].items():
        ratio = _cell(r.get("vs_full"), ".2f")
        if r.get("reference_of_speed"):
            ratio = "1.00x (reference)"
        elif ratio:
            ratio = ratio.replace(" [", "x [", 1) if "[" in ratio else ratio + "x"
            if len(table["speed_references"]) > 1:
                ratio += f" (run {r['run']})"
        lines.append(
            f"| `{name}` | {_cell(r.get('kv_share'), '.2f')} | {r.get('kv_cache_dtype') or ''} | "
            f"{_cell(r.get('kv_bytes_share'), '.2f')} | {_cell(r.get('requests_per_s'), '.3f')} | {ratio} | "
            f"{_cell(r.get('kv_share_scoring'), '.3f')} | {_cell(r.get('kv_bytes_share_scoring'), '.3f')} | "
            f"{_cell(r.get('kl'), '.4f')} | "
            f"{_cell(r.get('top1_agreement'), '.3f')} | "
            f"{_cell(r.get('bleu4_vs_full'), '.1f')} | {_cell(r.get('rougeL_vs_full'), '.3f')} |"
        )
    refs = "; ".join(
        f"run {i}: `{ref['row']}` {_cell([ref['requests_per_s'], *(ref['requests_per_s_ci'] or [None, None])], '.3f')}"
        f" req/s ({ref['repeats']} runs, commit `{ref['commit']}`)"
        for i, ref in enumerate(table["speed_references"], 1)
    )
    if refs:
        lines += ["", f"Requests/s against the on-demand `full` of the same run: {refs}."]
    return "\n".join(lines)


def _short(name: str) -> str:
    """A rule's label without the part every variant of the headline's rule shares."""
    for prefix in ("dynamic-128-512-decayed-r75-d98-", "dynamic-"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def plot(table: dict[str, Any], path: str) -> int:
    """requests/s against on-demand ``full`` (x) beside KL and BLEU-4 (y), with 95% intervals where known; returns
    how many rows were drawn."""
    import matplotlib

    matplotlib.use("Agg")  # a file only
    import matplotlib.pyplot as plt

    points = {n: r for n, r in table["rows"].items() if r.get("vs_full") and r.get("kl")}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, key, label in ((axes[0], "kl", "KL on full's answers (lower is better)"),
                           (axes[1], "bleu4_vs_full", "BLEU-4 of its own answers vs full's")):  # fmt: skip
        for name, r in points.items():
            x, y = r["vs_full"][0], r[key][0]
            lo, hi = r[key][1], r[key][2]
            rule = name.startswith("dynamic")
            color = "tab:blue" if rule else ("tab:gray" if name == REFERENCE else "tab:orange")
            if lo is not None and hi is not None:
                ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], fmt="none", ecolor=color, alpha=0.35, capsize=2)
            ax.plot(x, y, "o" if rule else "s", color=color)
            ax.annotate(_short(name), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel("requests/s vs on-demand full (its own run's)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("confidence rules (circles) and fixed baselines (squares)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return len(points)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--throughput", action="append", default=[], help="results.json of a longgen throughput run")
    ap.add_argument("--fidelity", action="append", default=[], help="longgen_fidelity.py --json output")
    ap.add_argument("--json", action="store_true", help="print the table's data as JSON instead of markdown")
    ap.add_argument("--plot", metavar="PATH", help="also draw requests/s against KL and BLEU-4 into this PNG")
    args = ap.parse_args(argv)
    if not args.throughput and not args.fidelity:
        print("headline.py: give at least one --throughput or --fidelity file", file=sys.stderr)
        return 2
    for path in args.throughput + args.fidelity:
        if not Path(path).is_file():
            print(f"headline.py: {path} is not a file", file=sys.stderr)
            return 2
    table = assemble([_load_json(p) for p in args.throughput], [_load_json(p) for p in args.fidelity])
    print(json.dumps(table, indent=2) if args.json else markdown(table))
    if args.plot:
        plot(table, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
