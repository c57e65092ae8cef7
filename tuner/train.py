"""``confkv-tune train``: one MLflow run that measures the default rule, tunes (Optuna, or an RL agent through
``tuner.train_rl``), measures the result on the training episodes, exports it to ``OUT/policy`` and registers it
as a new version in the policy registry."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from confkv.cli import out_folder
from confkv.config import CachePolicy
from confkv.errors import ConfkvError
from confkv.progress import stage
from tuner import options
from tuner.interrupt import interruptible
from tuner.options import reward_weights, scorer_names, summary_of
from tuner.plots import optuna_trials_plot
from tuner.tracking import DEFAULT_TRACKING_URI
from tuner.train_rl import checkpoint_of, preset_of, teacher_network, train_rl, warm_start

DEFAULT_TRIALS = 24
#: ``--observation``'s choices and the observation layouts they name (``confkv.controllers.observation.OBS_VERSIONS``).
OBSERVATIONS = {"segment": 1, "history": 2}


def cmd_train(args: argparse.Namespace) -> int:
    from tuner.tracking import check_tracking_uri

    if args.algo == "optuna" and args.timesteps is not None:
        raise ConfkvError("--algo optuna takes --trials")
    if args.algo != "optuna" and args.trials is not None:
        raise ConfkvError(f"--algo {args.algo} takes --timesteps")
    if args.algo == "sac" and args.action != "knobs":
        raise ConfkvError("sac needs --action knobs")
    if args.init_policy is not None and (args.algo == "optuna" or args.action != "knobs"):
        raise ConfkvError("--init-policy starts a knobs agent (ppo or sac with --action knobs)")
    if args.init_network is not None and (args.algo != "ppo" or args.action != "budget" or args.resume):
        raise ConfkvError("--init-network starts a new ppo agent with --action budget")
    if args.observation != "segment" and args.algo == "optuna":
        raise ConfkvError("--observation is for ppo or sac (an Optuna trial sets its knobs once, seeing nothing)")
    if args.relative_reward and args.algo == "optuna":
        raise ConfkvError("--relative-reward is for ppo or sac")
    if (args.gamma is not None or args.ent_coef is not None or args.lr_schedule is not None) and args.algo == "optuna":
        raise ConfkvError("--gamma, --ent-coef and --lr-schedule are for ppo or sac")
    if args.shaping_headroom is not None and args.algo == "optuna":
        raise ConfkvError("--shaping-headroom is for ppo or sac (it shapes the reward an agent trains on)")
    if args.learning_starts is not None and args.algo != "sac":
        raise ConfkvError("--learning-starts is for sac")
    if args.validation_fraction is not None and args.algo == "optuna":
        raise ConfkvError("--validation-fraction is for ppo or sac (optuna keeps its best trial on all items)")
    if args.mode != "teacher" and args.algo == "optuna":
        raise ConfkvError("--mode decode is for ppo or sac (optuna scores its trials teacher-forced)")
    if args.mode == "decode" and args.keep == "best":
        raise ConfkvError("--keep best chooses by teacher-forced evaluations (KL), not the decode reward the agent "
                          "trains on; use --keep last with --mode decode")  # fmt: skip
    args.keep = args.keep or ("last" if args.mode == "decode" else "best")
    if args.objectives != "reward" and args.algo != "optuna":
        raise ConfkvError(f"--objectives {args.objectives} is for optuna (ppo and sac maximise the reward)")
    reward_weights(args)  # checked before the model loads: RewardWeights refuses non-finite values
    scorers = scorer_names(args)
    params: dict[str, Any] = {}
    if args.algo == "optuna":
        args.trials = args.trials if args.trials is not None else DEFAULT_TRIALS
        if args.trials < 1:
            raise ConfkvError("--trials must be at least 1")
    else:
        from agents.sb3 import describe, preset_params, schedule

        preset = preset_of(args)
        args.timesteps = args.timesteps if args.timesteps is not None else preset.timesteps
        if args.timesteps < 1:
            raise ConfkvError("--timesteps must be at least 1")
        args.n_envs = preset.n_envs
        args.preset_obj = preset
        args.relative_reward = args.relative_reward or preset.relative_reward
        if args.validation_fraction is None:
            args.validation_fraction = preset.validation_fraction
        if not 0 <= args.validation_fraction < 1:
            raise ConfkvError("--validation-fraction must be at least 0 and below 1")
        if args.relative_reward and args.mode != "teacher":
            raise ConfkvError("relative rewards (--relative-reward, or --preset refine) are for teacher mode only")
        if args.shaping_headroom is not None:
            from envs.env import Shaping

            args.shaping = Shaping(args.shaping_headroom, preset.gamma)  # refuses bad values before the model loads
        plan = schedule(args.algo, args.timesteps, args.n_envs, preset)
        print(describe(args.algo, args.timesteps, args.n_envs, preset), file=sys.stderr)
        params.update(preset_params(preset))
        params.update({f"{args.algo}_{k}": v for k, v in plan.items()})
    out = out_folder(args.out)
    check_tracking_uri(args.tracking_uri)
    settings = _check_study(args, out, scorers) if args.algo == "optuna" else None
    if args.init_network is not None:
        teacher_network(args, OBSERVATIONS[args.observation])  # refused before the model loads
    resumed_from = checkpoint_of(args, out).get("run_id") if args.resume and args.algo != "optuna" else None
    args.run_id = None
    with interruptible(), stage(f"train {args.algo} on {args.model}"):
        summary = _run(args, out, scorers, params, settings, plan if args.algo != "optuna" else None, resumed_from)
    print(json.dumps(summary))
    return 0


def _run(
    args: argparse.Namespace, out: Path, scorers: list[str], params: dict[str, Any], settings: dict[str, Any] | None,
    plan: dict[str, Any] | None, resumed_from: str | None,
) -> dict[str, Any]:  # fmt: skip
    """Load the episodes, then one MLflow run: the default rule measured, the search or the agent, the result
    measured, exported, logged and registered. Stopped part way (an interrupt, an error), the run ends KILLED or
    FAILED with the best policy so far in ``OUT/policy`` (``_stopped``)."""
    from envs.evaluate import evaluate_policy
    from tuner.search import space_description
    from tuner.tracking import log_artifact_file, log_artifacts, log_metrics, mlflow_run, set_tags

    t0 = time.perf_counter()
    data = options.tune_data(args, "train")
    data.obs_version = OBSERVATIONS[args.observation]
    if len(scorers) == 1:
        data.base_policy = data.base_policy.replace(scorer=scorers[0])
    weights = reward_weights(args)
    tuned_base = data.base_policy
    if args.init_policy is not None:
        params.update(warm_start(args, data, scorers))
    params.update({
        "algo": args.algo, "model": args.model, "workload": args.workload, "seed": args.seed,
        "episodes": len(data.episodes), "items_scale": args.items_scale, "timesteps": args.timesteps,
        "trials": args.trials, "action": args.action, "relative_reward": args.relative_reward,
        "init_network": args.init_network, "shaping_headroom": args.shaping_headroom,
        "validation_fraction": args.validation_fraction, "resume": args.resume,
        "n_envs": args.n_envs, "objectives": args.objectives, "mode": args.mode, "observation": args.observation,
        "obs_version": data.obs_version, **weights.__dict__,
        **{f"base_{k}": v for k, v in tuned_base.model_dump(
            include={"base_size", "max_size", "min_recent", "compact_interval", "entropy_threshold", "gap_threshold",
                     "scaling_factor"}).items()},
        "base_scorer": data.base_policy.effective_scorer,
        **space_description(tuned_base, scorers if args.algo == "optuna" else ()),
    })  # fmt: skip
    policy_dir = out / "policy"
    lineage: dict[str, Any] = {}
    tags = {"confkv.kind": "train", **({"confkv.resumed_from": resumed_from} if resumed_from else {})}
    with mlflow_run(args.tracking_uri, f"{args.algo}-{args.model}-{args.workload}", params, tags=tags) as run:
        args.run_id = run.info.run_id
        try:
            default = evaluate_policy(data, tuned_base, weights, label="evaluate the default rule")
            log_metrics({"default_reward": default["reward"], "default_kv_fraction": default["kv_fraction"],
                         "default_kl": default["kl_mean"]}, step=0)  # fmt: skip
            start = None
            if args.init_policy is not None:
                start = evaluate_policy(data, data.base_policy, weights, label="evaluate the --init-policy")
                log_metrics({"init_reward": start["reward"], "init_kv_fraction": start["kv_fraction"],
                             "init_kl": start["kl_mean"]}, step=0)  # fmt: skip
            if args.algo == "optuna":
                policy = _train_optuna(args, data, weights, out, policy_dir, log_metrics, lineage, scorers,
                                       settings or {})  # fmt: skip
            else:
                policy = train_rl(args, data, weights, out, policy_dir, log_metrics, default["reward"])
            final = evaluate_policy(data, policy, weights, label="evaluate the result")
        except BaseException as err:
            _stopped(args, err, out, policy_dir, t0)
            raise
        log_metrics({f"train_{k}": v for k, v in summary_of(final).items()})
        set_tags(
            {"confkv.train_reward": round(final["reward"], 6), "confkv.default_reward": round(default["reward"], 6)}
        )
        log_artifacts(policy_dir, "policy")
        for png in out.glob("*.png"):
            log_artifact_file(png)
        summary = {
            "run_id": run.info.run_id,
            "status": "FINISHED",
            "policy": str(policy_dir),
            "seconds": round(time.perf_counter() - t0, 1),
            "train": summary_of(final),
            "default": summary_of(default),
            **({"init": summary_of(start)} if start is not None else {}),
            **({"schedule": plan} if plan is not None else {}),
            "tracking_uri": args.tracking_uri or DEFAULT_TRACKING_URI,
        }
        if not args.no_register:
            summary["registry"] = _register_result(args, run.info.run_id, policy_dir, final, lineage)
        if policy.controller == "learned":  # also an MLflow model whose predict maps observations to knobs
            from tuner.pyfunc import log_policy_model

            registered = summary.get("registry")
            summary["pyfunc_model_uri"] = log_policy_model(policy_dir, registered["ref"] if registered else None)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _stopped(args: argparse.Namespace, err: BaseException, out: Path, policy_dir: Path, t0: float) -> None:
    """Training stopped part way: record why on the MLflow run (which then ends KILLED, or FAILED on an error),
    log the best policy so far as its artifact, and say on stderr where that policy is and how to go on."""
    import signal

    from tuner.interrupt import signal_of
    from tuner.tracking import log_artifacts, set_tags

    interrupted = isinstance(err, KeyboardInterrupt)
    why = signal.Signals(signal_of(err)).name if interrupted else f"{type(err).__name__}: {err}"
    saved = (policy_dir / "policy.yaml").is_file()
    try:
        set_tags({"confkv.stopped": why[:500], "confkv.best_so_far_saved": saved})
        if saved:
            log_artifacts(policy_dir, "policy")
    except Exception as tag_err:  # the tracking store may be what failed; the local files still stand
        print(f"confkv-tune: warning: could not record the stop in MLflow: {tag_err}", file=sys.stderr)
    status = "KILLED" if interrupted else "FAILED"
    summary = {"run_id": args.run_id, "status": status, "stopped": why, "policy": str(policy_dir) if saved else None,
               "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    with contextlib.suppress(OSError):
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    kept = f"the best policy so far is in {policy_dir}" if saved else "no policy had been evaluated yet"
    print(f"confkv-tune: training stopped ({why}); MLflow run {args.run_id} ends {status}; {kept}. Run the same "
          "command with --resume to go on from there.", file=sys.stderr)  # fmt: skip


def default_policy_name(model: str, workload: str) -> str:
    """The registry policy a training result joins unless ``--register-as`` names one: ``<model>-<workload>``."""
    import re

    stem = Path(model).name.removesuffix(".gguf") or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{stem}-{workload}").strip("-._")[:128] or "policy"


def _register_result(
    args: argparse.Namespace, run_id: str, policy_dir: Path, final: dict[str, Any], lineage: dict[str, Any]
) -> dict[str, Any] | None:
    """Add the trained policy to the registry (no alias) and tag the MLflow run with the version.

    Training has already succeeded and is in MLflow when this runs, so a registry failure is reported, not fatal:
    the result can be registered later with ``confkv-tune register NAME --run RUN_ID``.
    """
    from store.registry import Registry
    from tuner.tracking import set_tags

    name = args.register_as or default_policy_name(args.model, args.workload)
    try:
        reg = Registry(args.registry_url)
        info = reg.register(
            name, policy_dir, model=args.model, mlflow_run_id=run_id, optuna_study=lineage.get("optuna_study"),
            optuna_trial=lineage.get("optuna_trial"),
            description=f"confkv-tune train --algo {args.algo} --workload {args.workload}",
        )  # fmt: skip
        reg.add_evaluation(name, info.version, args.workload, "train", final, model=args.model)
    except ConfkvError as err:
        print(f"confkv-tune: warning: the result was not registered ({err}); register it later with "
              f"`confkv-tune register {name} --run {run_id}`", file=sys.stderr)  # fmt: skip
        return None
    set_tags({"confkv.registry.policy": name, "confkv.registry.version": info.version,
              "confkv.registry.ref": f"registry://{info.ref}"})  # fmt: skip
    print(f"registered {info.ref} in {reg.url}", file=sys.stderr)
    return {"name": name, "version": info.version, "ref": f"registry://{info.ref}", "url": reg.url}


def _check_study(args: argparse.Namespace, out: Path, scorers: list[str]) -> dict[str, Any]:
    """Fix the study's storage and name (``args.storage``, ``args.study``) and refuse, before the model loads, to
    resume a stored study created under other settings: the name says only model, workload and objectives, and
    trials scored under another reward (or on other items: ``--seed`` picks them) are not comparable. Returns the
    settings, which a new study records (``tuner.search.search``)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from envs.episodes import default_base_policy
    from tuner.search import check_settings, open_study

    if args.storage:
        try:
            make_url(args.storage)
        except ArgumentError:
            raise ConfkvError(f"--storage must be a database URL such as sqlite:///{args.storage} (got "
                              f"{args.storage!r})") from None  # fmt: skip
    args.storage = args.storage or f"sqlite:///{(out / 'optuna.db').resolve()}"
    args.study = args.study or f"confkv-{Path(args.model).name}-{args.workload}-{args.objectives}"
    settings = {
        "model": args.model, "workload": args.workload, "objectives": args.objectives, "seed": args.seed,
        "items_scale": args.items_scale, "memory_weight": args.memory_weight, "quality_weight": args.quality_weight,
        "task_weight": args.task_weight,
        "scorer": ",".join(scorers) if scorers else default_base_policy(args.model).effective_scorer,
    }  # fmt: skip
    study = open_study(args.storage, args.study)
    if study is not None:
        check_settings(study, settings, f" in {args.storage}", "--study NAME, --storage URL or another --out")
    if args.resume:
        if study is None:
            raise ConfkvError(f"--resume: no optuna study {args.study!r} in {args.storage} to go on with; run "
                              "without --resume to start one")  # fmt: skip
        finished = sum(t.state.is_finished() and t.state.name != "FAIL" for t in study.trials)
        if finished >= args.trials:
            raise ConfkvError(f"--resume: study {args.study!r} already has {finished} of {args.trials} trials; raise "
                              "--trials to run more")  # fmt: skip
        print(f"  resuming study {args.study!r}: {finished} trials done, {args.trials - finished} to go",
              file=sys.stderr)  # fmt: skip
        args.trials -= finished
    return settings


def _retrieval_text(metrics: dict[str, Any]) -> str:
    parts = [f"{name} {100 * metrics[key]:.0f}%" for name, key in (("pass keys", "passkey_acc"),
             ("multi-keys", "multikey_acc")) if metrics.get(key) is not None]  # fmt: skip
    return (", " + ", ".join(parts)) if parts else ""


def _write_rule_policy(policy_dir: Path, policy: CachePolicy) -> None:
    import yaml

    policy_dir.mkdir(parents=True, exist_ok=True)
    (policy_dir / "policy.yaml").write_text(yaml.safe_dump({"cache_policy": policy.model_dump(mode="json")}))


def _train_optuna(
    args: argparse.Namespace, data: Any, weights: Any, out: Path, policy_dir: Path, log_metrics: Any,
    lineage: dict[str, Any], scorers: list[str], settings: dict[str, Any],
) -> CachePolicy:  # fmt: skip
    """Run the trials; the best one's policy goes to ``policy_dir``, also when the search stops part way (the
    study keeps every finished trial in its storage, so ``--resume`` goes on with it)."""
    from confkv.calibration import calibrated_thresholds
    from tuner.search import best_policy, best_trial, open_study, search
    from tuner.tracking import set_tags

    storage, study_name = args.storage, args.study  # set by _check_study

    def on_trial(trial: Any, metrics: dict[str, Any]) -> None:
        log_metrics({"trial_reward": metrics["reward"], "trial_kv_fraction": metrics["kv_fraction"],
                     "trial_kl": metrics["kl_mean"], "trial_passkey_acc": metrics.get("passkey_acc"),
                     "trial_multikey_acc": metrics.get("multikey_acc")}, step=trial.number)  # fmt: skip
        print(f"  trial {trial.number}: reward {metrics['reward']:.3f}, kv {100 * metrics['kv_fraction']:.1f}%, "
              f"kl {metrics['kl_mean']:.4f}{_retrieval_text(metrics)}", file=sys.stderr)  # fmt: skip

    def on_pruned(trial: Any, metrics: dict[str, Any]) -> None:
        print(f"  trial {trial.number}: pruned after its first group of episodes (reward {metrics['reward']:.3f}, "
              f"below the median of the trials before it at that point)", file=sys.stderr)  # fmt: skip

    calibrated = calibrated_thresholds(args.model, args.cache_dir)
    seeds = [data.base_policy.replace(**calibrated)] if calibrated else []
    try:
        with stage("optuna", total=args.trials, unit="trials") as progress:
            study = search(data, args.trials, storage=storage, study_name=study_name, objectives=args.objectives,
                           weights=weights, seed=args.seed, on_trial=on_trial, on_pruned=on_pruned,
                           progress=progress, scorers=scorers, seeds=seeds, settings=settings)  # fmt: skip
    except BaseException:
        stored = open_study(storage, study_name)
        if stored is not None and any(t.state.name == "COMPLETE" for t in stored.trials):
            _write_rule_policy(policy_dir, best_policy(stored, data.base_policy))
            lineage.update(optuna_study=study_name, optuna_trial=best_trial(stored).number)
            optuna_trials_plot(out / "optuna_trials.png", stored)
        raise
    optuna_trials_plot(out / "optuna_trials.png", study)
    best = best_trial(study)
    lineage.update(optuna_study=study_name, optuna_trial=best.number)
    tags: dict[str, Any] = {
        "confkv.optuna_study": study_name, "confkv.optuna_trial": best.number, "confkv.optuna_storage": storage,
        "confkv.optuna_trials": len(study.trials),
        "confkv.optuna_seeded": "default" + (" + calibrated" if seeds else ""),
        **{f"confkv.best.{k}": v for k, v in best.params.items()},
    }  # fmt: skip
    if best.values:
        tags["confkv.best_value"] = best.values if len(best.values) > 1 else best.values[0]
    set_tags(tags)
    policy = best_policy(study, data.base_policy)
    _write_rule_policy(policy_dir, policy)
    return policy
