"""``confkv-tune probe``: where the confidence signal says in advance that a larger budget pays.

For held-out items of each workload named (default prose, chat, long generation and pass keys), the gain of a
larger budget per segment and per token and how well each observed feature and the ``dynamic`` rule's own budget
predict it (``envs.probe`` measures, ``tuner.probe_stats`` judges), written as ``probe.md`` and ``probe.json`` and
logged to MLflow (metrics ``<workload>.<level>.<feature>.auc`` with ``_lo``/``_hi``, likewise ``rho``). Where no
feature's AUC interval leaves 0.5, no controller that acts on these observations can beat its best constant.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from confkv.cli import out_folder
from confkv.errors import ConfkvError
from confkv.progress import stage
from tuner.options import maybe_run

PROBE_WORKLOADS = ("prose", "chat", "longgen", "passkey")
ALLOWED = ("prose", "chat", "longgen", "passkey", "multikey")


def add_probe_command(sub: Any) -> None:
    p = sub.add_parser("probe", help="how well the observed signals predict the gain of a larger budget, per workload")
    p.add_argument("--model", default=None, help="model (default $CONFKV_MODEL or smollm2-135m)")
    default = ",".join(PROBE_WORKLOADS)
    p.add_argument("--workloads", default=default, help=f"from {', '.join(ALLOWED)}, comma-separated ({default})")
    p.add_argument("--items", type=int, default=12, help="held-out items per workload (default 12; pass keys come "
                   "in whole repetitions of their length x depth grid)")  # fmt: skip
    p.add_argument("--split", choices=["train", "heldout"], default="heldout")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples over items (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true")


def _workloads(spec: str) -> list[str]:
    names = [w.strip() for w in spec.split(",") if w.strip()]
    bad = [w for w in names if w not in ALLOWED]
    if bad or not names:
        raise ConfkvError(f"--workloads takes names from {', '.join(ALLOWED)} (got {spec!r})")
    return list(dict.fromkeys(names))


def sizes_for(model: str, workload: str, items: int) -> dict[str, dict[str, Any]]:
    """The tuner's item sizes for ``model`` with ``items`` items (pass keys: enough grid repetitions to reach it)."""
    from envs.episodes import scaled_sizes

    spec = dict(scaled_sizes(model)[workload])
    cells = len(spec.get("lengths", (1,))) * len(spec.get("depths", (1,))) if workload == "passkey" else 1
    spec["n"] = math.ceil(items / cells)
    return {workload: spec}


def cmd_probe(args: argparse.Namespace) -> int:
    import os

    from confkv.model_loader import load_model
    from envs.episodes import build_episodes
    from envs.probe import budget_policies, probe_items
    from tuner.probe_stats import feature_table, markdown

    args.model = args.model or os.environ.get("CONFKV_MODEL", "smollm2-135m")
    workloads = _workloads(args.workloads)
    if args.items < 2:
        raise ConfkvError(f"--items must be at least 2 for an interval over items (got {args.items})")
    if args.resamples < 100:
        raise ConfkvError(f"--resamples must be at least 100 (got {args.resamples})")
    out = out_folder(args.out)
    if not args.no_mlflow:
        from tuner.tracking import check_tracking_uri

        check_tracking_uri(args.tracking_uri)
    params = {"model": args.model, "workloads": ",".join(workloads), "items": args.items, "split": args.split,
              "resamples": args.resamples, "seed": args.seed}  # fmt: skip
    with maybe_run(args, f"probe-{args.model}-{args.split}", params, "probe"):
        loaded = load_model(args.model, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir, seed=args.seed)
        rows, gains, policies = [], [], {}
        with stage("probe", total=len(workloads), unit="workloads") as progress:
            for w in workloads:
                data = build_episodes(args.model, workload=w, split=args.split, seed=args.seed, loaded=loaded,
                                      kv_cache_memory=args.kv_cache_memory,
                                      sizes=sizes_for(args.model, w, args.items))  # fmt: skip
                policies = {k: {"base_size": p.base_size, "max_size": p.max_size}
                            for k, p in budget_policies(data.base_policy).items()}  # fmt: skip
                r, g = feature_table(probe_items(data, label=f"probe {w}"), args.resamples, args.seed)
                rows += r
                gains += g
                progress.update(1)
        title = f"Signal probe: {args.model}, {args.split} items"
        doc = {"model": args.model, "split": args.split, "items": args.items, "resamples": args.resamples,
               "budgets": policies, "gain": [g.to_dict() for g in gains],
               "features": [r.to_dict() for r in rows]}  # fmt: skip
        (out / "probe.json").write_text(json.dumps(doc, indent=2))
        text = markdown(rows, gains, title)
        (out / "probe.md").write_text(text + "\n")
        if not args.no_mlflow:
            from tuner.tracking import log_artifact_file, log_metrics, metric_key

            metrics: dict[str, Any] = {}
            for r in rows:
                key = f"{r.workload}.{r.level}.{metric_key(r.feature)}"
                for stat in ("auc", "auc_lo", "auc_hi", "rho", "rho_lo", "rho_hi"):
                    if getattr(r, stat) is not None:
                        metrics[f"{key}.{stat}"] = getattr(r, stat)
            for g in gains:
                metrics[f"{g.workload}.{g.level}.gain_mean"] = g.gain_mean
            log_metrics(metrics)
            for name in ("probe.json", "probe.md"):
                log_artifact_file(out / name)
    print(text, file=sys.stdout)
    return 0
