"""Optuna search over the dynamic rule's knobs and sizes, with the environment's reward as objective.

The search space is the agents' (``confkv.controllers.learned.KnobSpace.for_policy`` around the base policy, built by
``envs.env.knob_space``): ``entropy_threshold``, ``gap_threshold``, ``scaling_factor`` over the same bounds,
``base_size`` and ``max_size`` over the same block-rounded ranges with ``max_size >= base_size``. What differs is
what a point is: a trial is one constant policy for a whole episode, an agent's action sets the knobs segment by
segment; and the scorer, which a sequence keeps from start to end (its records are made while the text is read),
is a per-trial categorical only when ``scorers`` names several (an agent runs under one: ``--scorer``).

A trial is a ``CachePolicy``; it is judged by ``envs.evaluate.evaluate_policy`` on the training episodes, in
groups so that a clearly bad trial is pruned after its first group (median pruner). With
``objectives="pareto"`` the study minimises resident KV fraction and KL together and keeps a Pareto front
(Optuna cannot prune multi-objective trials, so every trial runs to the end). The first trial of a new study is
the base policy itself (``enqueue_trial``), then any ``seeds`` (say, a calibrated policy), so the search starts
from the hand-set rule and its best is never worse on the training episodes. Studies live in an RDB storage
(SQLite by default), so a search resumes where it stopped. A study records the settings that define its objective
(``settings``: reward weights, the seed that picks the items, their scale, the scorers...) as a user attribute
when it is created, and a resume under other settings is refused: trials scored under one reward are not
comparable with trials scored under another, and the best of such a mix is meaningless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna

from confkv.config import CachePolicy
from confkv.controllers.learned import KnobSpace
from confkv.errors import ConfkvError
from confkv.progress import Stage
from envs.env import RewardWeights, knob_space
from envs.episodes import TuneData
from envs.evaluate import evaluate_policy

SEARCHED = ("entropy_threshold", "gap_threshold", "scaling_factor", "base_size", "max_size")
#: The study user attribute holding the settings it was created with (``search``'s ``settings``).
SETTINGS_ATTR = "confkv_settings"

log = logging.getLogger(__name__)


def suggest_policy(trial: optuna.Trial, base: CachePolicy, scorers: Sequence[str] = ()) -> CachePolicy:
    """One point of the shared space (``space`` bounds; sizes in whole blocks, ``max_size >= base_size``)."""
    space = knob_space(base)
    b = space.bounds()
    bs = space.block_size
    lo, hi = b["base_size"]
    base_size = trial.suggest_int("base_size", int(lo), int(hi), step=bs)
    lo, hi = b["max_size"]
    max_size = trial.suggest_int("max_size", max(base_size, int(lo)), int(hi), step=bs)
    knobs: dict[str, Any] = {
        name: trial.suggest_float(name, *b[name]) for name in ("entropy_threshold", "gap_threshold", "scaling_factor")
    }
    if len(scorers) > 1:
        knobs["scorer"] = trial.suggest_categorical("scorer", list(scorers))
    return base.replace(base_size=base_size, max_size=max_size, **knobs)


def params_of(policy: CachePolicy, base: CachePolicy, scorers: Sequence[str] = ()) -> dict[str, Any]:
    """``policy`` as trial parameters of the space around ``base`` (to enqueue it), clamped into that space."""
    space = knob_space(base)
    bounds = space.bounds()
    params: dict[str, Any] = {}
    for name in SEARCHED:
        lo, hi = bounds[name]
        value = min(hi, max(lo, float(getattr(policy, name))))
        if name in ("base_size", "max_size"):
            bs = space.block_size
            value = int(lo + round((value - lo) / bs) * bs)
        params[name] = value
    params["max_size"] = max(params["max_size"], params["base_size"])
    if len(scorers) > 1:
        params["scorer"] = policy.effective_scorer if policy.effective_scorer in scorers else scorers[0]
    return params


def policy_from_params(base: CachePolicy, params: dict[str, Any]) -> CachePolicy:
    return base.replace(**{k: v for k, v in params.items() if k in CachePolicy.model_fields})


def space_description(base: CachePolicy, scorers: Sequence[str] = ()) -> dict[str, Any]:
    """The searched space, for the run's parameters: one entry per knob, ``[low, high]``."""
    space: KnobSpace = knob_space(base)
    out: dict[str, Any] = {f"space_{k}": list(v) for k, v in space.bounds().items()}
    out["space_scorer"] = ",".join(scorers) if len(scorers) > 1 else base.effective_scorer
    return out


def open_study(storage: str, study_name: str) -> optuna.Study | None:
    """The stored study of that name, or None when there is none, so that a caller can check a resume before it
    loads a model; a storage that cannot be reached (or is no database URL) is a ``ConfkvError``, not a traceback."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:  # optuna's "Record does not exist."
        return None
    except (SQLAlchemyError, ImportError, optuna.exceptions.OptunaError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfkvError(f"cannot open the optuna storage {storage}: {first}") from None


def check_settings(study: optuna.Study, settings: Mapping[str, Any], where: str, remedy: str) -> None:
    """Refuse (``ConfkvError``) to resume ``study`` under settings that differ from those it recorded when it was
    created. A study that recorded none, or a setting it did not record, passes: what was not recorded cannot be
    checked, and a setting added later must not lock every older study."""
    recorded = study.user_attrs.get(SETTINGS_ATTR)
    if not isinstance(recorded, dict):
        return
    differ = {k: (recorded[k], v) for k, v in settings.items() if k in recorded and recorded[k] != v}
    if differ:
        what = "; ".join(f"--{k.replace('_', '-')} {old} (now {new})" for k, (old, new) in differ.items())
        raise ConfkvError(f"optuna study {study.study_name!r}{where} was created with other settings: {what}; "
                          f"resume it with those, or start a new study with {remedy}")  # fmt: skip


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
    progress: Stage | None = None,
    on_trial: Callable[[optuna.trial.FrozenTrial, dict[str, Any]], None] | None = None,
    on_pruned: Callable[[optuna.Trial, dict[str, Any]], None] | None = None,
    scorers: Sequence[str] = (),
    seeds: Sequence[CachePolicy] = (),
    settings: Mapping[str, Any] | None = None,
) -> optuna.Study:
    """Run ``trials`` more trials of a (new or resumed) study; ``scorers``: several to search the scorer too;
    ``seeds``: policies tried right after the base policy in a new study; ``settings``: JSON values that define
    the objective, recorded by a new study and required to match when one is resumed (``ConfkvError`` otherwise);
    ``progress``: a ``confkv.progress`` stage counting finished trials, pruned ones included; ``on_pruned(trial,
    metrics)``: a trial stopped after a group, with that group's figures (also kept as ``partial_*`` user attributes,
    so a plot can place it)."""
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
    if settings is not None:
        check_settings(study, settings, "", "another name or storage")
        if SETTINGS_ATTR not in study.user_attrs:
            if study.trials:
                log.warning("optuna study %r predates recorded settings; resuming it, its settings are now taken "
                            "to be %s", study_name, dict(settings))  # fmt: skip
            study.set_user_attr(SETTINGS_ATTR, dict(settings))
    if not study.trials:  # a new study: the hand-set rule first
        for i, policy in enumerate((base, *seeds)):
            study.enqueue_trial(params_of(policy, base, scorers), user_attrs={"enqueued": "default" if i == 0 else
                                                                              f"seed {i}"})  # fmt: skip
    episodes = data.episodes
    chunks = [episodes[i::groups] for i in range(groups)] if objectives == "reward" else [episodes]
    chunks = [c for c in chunks if c]

    def objective(trial: optuna.Trial) -> float | tuple[float, float]:
        policy = suggest_policy(trial, base, scorers)
        rewards: list[float] = []
        rows: list[dict[str, Any]] = []
        metrics: dict[str, Any] = {}
        for step, group in enumerate(chunks):
            label = f"trial {trial.number}" + (f", group {step + 1}/{len(chunks)}" if len(chunks) > 1 else "")
            metrics = evaluate_policy(data, policy, weights, group, label=label)
            rows.extend(metrics["per_episode"])
            rewards.extend(r["reward"] for r in metrics["per_episode"])
            if objectives == "reward" and step < len(chunks) - 1:
                trial.report(sum(rewards) / len(rewards), step)
                if trial.should_prune():
                    trial.set_user_attr("partial_kv_fraction", metrics["kv_fraction"])
                    trial.set_user_attr("partial_kl_mean", metrics["kl_mean"])
                    if on_pruned:
                        on_pruned(trial, {**metrics, "reward": sum(rewards) / len(rewards)})
                    raise optuna.TrialPruned()
        if len(chunks) > 1:
            metrics = evaluate_summary(rows)
        trial.set_user_attr("kv_fraction", metrics["kv_fraction"])
        trial.set_user_attr("kl_mean", metrics["kl_mean"])
        for key in ("passkey_acc", "multikey_acc"):
            if metrics.get(key) is not None:
                trial.set_user_attr(key, metrics[key])
        if on_trial:
            on_trial(trial, {**metrics, "reward": sum(rewards) / len(rewards)})
        if objectives == "pareto":
            return metrics["kv_fraction"], metrics["kl_mean"]
        return sum(rewards) / len(rewards)

    count = [lambda _study, _trial: progress.update(1)] if progress is not None else []
    study.optimize(objective, n_trials=trials, catch=(), callbacks=count)
    return study


def evaluate_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Episode-weighted means when a trial ran in groups (token-weighted figures come from a full evaluation)."""
    from envs.evaluate import task_accuracy

    return {
        "kv_fraction": sum(r["kv_fraction"] for r in rows) / len(rows),
        "kl_mean": sum(r["kl"] for r in rows) / len(rows),
        "passkey_acc": task_accuracy(rows, "passkey"),
        "multikey_acc": task_accuracy(rows, "multikey"),
        "task_acc": task_accuracy(rows),
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
