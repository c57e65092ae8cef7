"""Optuna search over the dynamic rule's knobs and sizes, with the environment's reward as objective.

A trial is a ``CachePolicy``; it is judged by ``envs.evaluate.evaluate_policy`` on the training episodes, in
groups so that a clearly bad trial is pruned after its first group (median pruner). With
``objectives="pareto"`` the study minimises resident KV fraction and KL together and keeps a Pareto front
(Optuna cannot prune multi-objective trials, so every trial runs to the end). Studies live in an RDB storage
(SQLite by default), so a search resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna

from confkv.config import CachePolicy
from envs.env import RewardWeights
from envs.episodes import TuneData
from envs.evaluate import evaluate_policy


def suggest_policy(trial: optuna.Trial, base: CachePolicy) -> CachePolicy:
    bs = base.block_size
    base_size = trial.suggest_int("base_size", max(bs, base.base_size // 2), base.base_size * 2, step=bs)
    max_size = trial.suggest_int("max_size", base_size, max(base_size, base.max_size * 2), step=bs)
    return base.replace(
        entropy_threshold=trial.suggest_float("entropy_threshold", 0.5, 6.0),
        gap_threshold=trial.suggest_float("gap_threshold", 0.0, 0.5),
        scaling_factor=trial.suggest_float("scaling_factor", 0.5, 1.0),
        base_size=base_size,
        max_size=max_size,
        min_recent=min(base.min_recent, max(0, max_size - base.sink_tokens)),
    )


def policy_from_params(base: CachePolicy, params: dict[str, Any]) -> CachePolicy:
    p = base.replace(**{k: v for k, v in params.items() if k in CachePolicy.model_fields})
    return p.replace(min_recent=min(base.min_recent, max(0, p.max_size - p.sink_tokens)))


def search(
    data: TuneData,
    trials: int,
    *,
    storage: str | None = None,
    study_name: str = "confkv",
    objectives: str = "reward",
    weights: RewardWeights | None = None,
    seed: int = 0,
    groups: int = 2,
    progress: bool = False,
    on_trial: Callable[[optuna.trial.FrozenTrial, dict[str, Any]], None] | None = None,
) -> optuna.Study:
    weights = weights or RewardWeights()
    base = data.base_policy
    sampler = optuna.samplers.TPESampler(seed=seed)
    if objectives == "reward":
        study = optuna.create_study(
            study_name=study_name, storage=storage, sampler=sampler, direction="maximize", load_if_exists=True,
            pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
        )  # fmt: skip
    elif objectives == "pareto":
        study = optuna.create_study(
            study_name=study_name, storage=storage, sampler=optuna.samplers.NSGAIISampler(seed=seed),
            directions=["minimize", "minimize"], load_if_exists=True,
        )  # fmt: skip
    else:
        raise ValueError("objectives must be 'reward' or 'pareto'")
    episodes = data.episodes
    chunks = [episodes[i::groups] for i in range(groups)] if objectives == "reward" else [episodes]
    chunks = [c for c in chunks if c]

    def objective(trial: optuna.Trial) -> float | tuple[float, float]:
        policy = suggest_policy(trial, base)
        rewards: list[float] = []
        rows: list[dict[str, Any]] = []
        metrics: dict[str, Any] = {}
        for step, group in enumerate(chunks):
            metrics = evaluate_policy(data, policy, weights, group)
            rows.extend(metrics["per_episode"])
            rewards.extend(r["reward"] for r in metrics["per_episode"])
            if objectives == "reward" and step < len(chunks) - 1:
                trial.report(sum(rewards) / len(rewards), step)
                if trial.should_prune():
                    raise optuna.TrialPruned()
        if len(chunks) > 1:
            metrics = evaluate_summary(rows)
        trial.set_user_attr("kv_fraction", metrics["kv_fraction"])
        trial.set_user_attr("kl_mean", metrics["kl_mean"])
        if metrics.get("passkey_acc") is not None:
            trial.set_user_attr("passkey_acc", metrics["passkey_acc"])
        if on_trial:
            on_trial(trial, {**metrics, "reward": sum(rewards) / len(rewards)})
        if objectives == "pareto":
            return metrics["kv_fraction"], metrics["kl_mean"]
        return sum(rewards) / len(rewards)

    study.optimize(objective, n_trials=trials, catch=(), show_progress_bar=progress)
    return study


def evaluate_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Episode-weighted means when a trial ran in groups (token-weighted figures come from a full evaluation)."""
    passkey = [r["task_correct"] for r in rows if "task_correct" in r]
    return {
        "kv_fraction": sum(r["kv_fraction"] for r in rows) / len(rows),
        "kl_mean": sum(r["kl"] for r in rows) / len(rows),
        "passkey_acc": sum(passkey) / len(passkey) if passkey else None,
    }


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial:
    """The trial whose knobs become the policy (its number is recorded as the registry version's lineage)."""
    if len(study.directions) > 1:
        # the Pareto point with the least memory among those within 10% of the lowest KL
        front = study.best_trials
        lowest = min(t.values[1] for t in front)
        ok = [t for t in front if t.values[1] <= lowest * 1.1 + 1e-6]
        return min(ok, key=lambda t: t.values[0])
    return study.best_trial


def best_policy(study: optuna.Study, base: CachePolicy) -> CachePolicy:
    return policy_from_params(base, best_trial(study).params)
