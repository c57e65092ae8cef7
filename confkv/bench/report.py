"""Turn one benchmark run's results into ``results.json``, ``report.md`` and PNG plots.

The results are a plain dict (the schema ``confkv.bench.suite.run_suite`` returns) so a run can be re-rendered from
its ``results.json`` without the model. Anything not measured is ``None``: the table prints "n/a" and the plots leave
that point, line or panel out rather than fail, because a partial run is still worth reading. The tables are
``confkv.bench.tables``, the plots ``confkv.bench.plots``; this module checks the schema and assembles the folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from confkv.bench.plots import PLOT_CAPTIONS, PLOT_FILES, PLOTTERS
from confkv.bench.tables import (
    HOW_TO_READ,
    budgets_markdown,
    comparison_markdown,
    jsonable,
    markdown_table,
    memory_markdown,
    run_time_line,
    settings_markdown,
    split_words,
)

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


def _report_md(results: dict[str, Any], plots: dict[str, Path]) -> str:
    parts = [
        f"# confkv benchmark: {results.get('model', '?')}, suite {results.get('suite', '?')}{split_words(results)}\n",
        f"Commit `{results.get('commit') or 'n/a'}`, created {results.get('created') or 'n/a'}.\n",
        run_time_line(results),
        "## Settings\n",
        settings_markdown(results.get("settings")),
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
            parts.append(f"### {PLOT_CAPTIONS[key]}\n\n![{PLOT_CAPTIONS[key]}]({path.name})\n")
    parts += ["## How to read this\n", HOW_TO_READ + "\n"]
    return "\n".join(parts)


def write_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json``, the plots that have data, and ``report.md`` linking them; return what was written.

    A plot with nothing to show (say, no traces recorded) is left out of the folder, the returned dict and the report.
    """
    validate_results(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    results_path = out / "results.json"
    results_path.write_text(json.dumps(jsonable(results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    written["results"] = results_path
    plots: dict[str, Path] = {}
    for key, plotter in PLOTTERS.items():
        path = plotter(results, out / PLOT_FILES[key])
        if path is not None:
            plots[key] = path
    report_path = out / "report.md"
    report_path.write_text(_report_md(results, plots), encoding="utf-8")
    written["report"] = report_path
    written.update(plots)
    return written
