"""What several ``confkv-tune`` commands share: the episodes a command runs on, the reward weights, and the
policies named on the command line."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from confkv.config import BUILTIN_POLICIES, CachePolicy
from confkv.errors import ConfkvError
from confkv.policy_source import load_policy


def check_finite(flag: str, value: float | None) -> None:
    """Refuse NaN and infinity: they pass every range check (a comparison with NaN is false) and then poison the
    reward, the optimiser or the JSON printed (``NaN`` is not JSON)."""
    if value is not None and not math.isfinite(value):
        raise ConfkvError(f"{flag} must be a finite number (got {value})")


def reward_weights(args: argparse.Namespace):
    from envs.env import RewardWeights

    return RewardWeights(args.memory_weight, args.quality_weight, args.task_weight)


def tune_data(args: argparse.Namespace, split: str):
    from envs.episodes import TUNE_WORKLOADS, build_episodes, scaled_sizes

    if args.workload not in TUNE_WORKLOADS:
        raise ConfkvError(f"unknown workload {args.workload!r}; choose one of {', '.join(TUNE_WORKLOADS)}")
    try:
        sizes = scaled_sizes(args.model, args.items_scale)
    except ValueError:
        raise ConfkvError(f"--items-scale must be at least 1 (got {args.items_scale})") from None
    return build_episodes(args.model, workload=args.workload, split=split, seed=args.seed, device=args.device,
                          dtype=args.dtype, cache_dir=args.cache_dir, kv_cache_memory=args.kv_cache_memory,
                          sizes=sizes)  # fmt: skip


def resolve_policy_arg(
    spec: str, base: CachePolicy, model: str | None = None, cache_dir: str | None = None
) -> CachePolicy:
    """A policy named on the command line, relative to the tuned base policy."""
    if spec == "default":
        return base
    if spec == "calibrated":
        from confkv.calibration import calibrated_thresholds, calibration_path

        found = calibrated_thresholds(model, cache_dir) if model else None
        if found is None:
            raise ConfkvError(f"{model} has no calibration ({calibration_path(model or '?', cache_dir)}); run "
                              f"`confkv calibrate --model {model}` first")  # fmt: skip
        return base.replace(**found)
    if spec in BUILTIN_POLICIES:
        if spec == "dynamic":
            return base
        if spec == "full":
            return base.replace(controller="full")
        from confkv.bench.suite import baseline_policy

        return baseline_policy(base, spec)
    path = Path(spec)
    if path.exists() or spec.startswith("registry://"):
        return load_policy(spec)
    raise ConfkvError(f"policy {spec!r} is neither a file, an exported folder, nor one of default, calibrated, "
                      f"{', '.join(BUILTIN_POLICIES)}")  # fmt: skip


def summary_of(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k != "per_episode"}


def scorer_names(args: argparse.Namespace) -> list[str]:
    from confkv.plugins import SCORERS

    names = [n.strip() for n in (args.scorer or "").split(",") if n.strip()]
    bad = [n for n in names if n not in SCORERS]
    if bad:
        raise ConfkvError(f"unknown scorer {bad[0]!r}; choose from {', '.join(SCORERS)}")
    if len(names) > 1 and args.algo != "optuna":
        raise ConfkvError("an agent runs under one scorer (a sequence keeps its scorer); --scorer takes a list with "
                          "--algo optuna only")  # fmt: skip
    return names


def maybe_run(args: argparse.Namespace, name: str, params: dict[str, Any], kind: str) -> Any:
    """An MLflow run for eval/compare (a no-op context with ``--no-mlflow``)."""
    import contextlib

    if args.no_mlflow:
        return contextlib.nullcontext()
    from tuner.tracking import mlflow_run

    return mlflow_run(args.tracking_uri, name, params, tags={"confkv.kind": kind})
