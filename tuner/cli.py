"""``confkv-tune``: learn the CONF-KV policy, evaluate it on held-out items, compare, register, promote, export.

    confkv-tune train --algo {ppo,sac,optuna} --model M [--workload mixed] [--preset quick|standard|refine]
                      [--timesteps N | --trials N] [--scorer NAME[,NAME...]] --out DIR
                      [--register-as NAME | --no-register]
    confkv-tune eval POLICY --workload NAME --split heldout
    confkv-tune compare --policy optuna=DIR/policy.yaml --policy ppo=DIR2/policy --out DIR3
    confkv-tune register NAME (--policy-file F | --artifact DIR | --run RUN_ID)
    confkv-tune policies list | policies show NAME[@VERSION|@ALIAS]
    confkv-tune promote NAME VERSION [--alias production] [--reason TEXT] [--check WORKLOAD] [--force]
    confkv-tune rollback NAME [--alias production]
    confkv-tune export NAME@ALIAS|NAME@VERSION|RUN_ID --out PATH

POLICY is a YAML policy file, an exported policy folder, a ``registry://NAME@ALIAS`` reference, a built-in policy
name, ``default`` (the requirement's dynamic rule, sized for the episodes) or ``calibrated`` (that rule with the
model's calibrated thresholds, ``confkv calibrate``). ``train``, ``eval`` and ``compare`` are each an MLflow run of
the experiment ``confkv-tune`` (``--no-mlflow`` for eval/compare), tagged with the git commit. ``train`` registers
its result as a new version (no alias) in the policy registry (``store``; see ``tuner.registry_cli``). ``export``
reads the registry when its argument has an ``@`` (or is ``registry://...``), and an MLflow run's exported policy
otherwise.
User errors print one line on stderr and exit with 2; the registry's refusals (a missing version, a promotion
the gate refuses) exit with 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from confkv.cli import out_folder
from confkv.config import BUILTIN_POLICIES, CachePolicy, load_policy_file
from confkv.errors import ConfkvError

#: ``agents.sb3.PRESETS``' names (not imported here: the parser must not load stable-baselines3).
PRESET_NAMES = ("quick", "standard", "refine")
DEFAULT_TRIALS = 24


def _common(p: argparse.ArgumentParser) -> None:
    from envs.episodes import TUNE_WORKLOADS  # the list ``_data`` checks against, so the help cannot fall behind

    p.add_argument("--model", default=os.environ.get("CONFKV_MODEL", "smollm2-135m"))
    p.add_argument("--workload", default="mixed", help=f"one of {', '.join(TUNE_WORKLOADS)} (default mixed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", default=None, help="device KV pool per engine, e.g. 512MiB")
    p.add_argument("--cache-dir", default=None, help="converted-model cache (default: $CONFKV_CACHE)")
    p.add_argument("--memory-weight", type=float, default=1.0)
    p.add_argument("--quality-weight", type=float, default=2.0)
    p.add_argument("--task-weight", type=float, default=1.0)
    p.add_argument(
        "--items-scale", type=int, default=1, metavar="K",
        help="K times as many items of every kind in the episodes (the mixed split holds 10 at 1): fewer items "
        "let one pass key decide a comparison",
    )  # fmt: skip


def _tracking(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true", help="do not record this as an MLflow run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="confkv-tune", description="Learn and evaluate CONF-KV cache policies.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train an RL agent or run an Optuna search, tracked in MLflow")
    _common(train)
    train.add_argument("--algo", choices=["ppo", "sac", "optuna"], required=True)
    budget = train.add_mutually_exclusive_group()
    budget.add_argument(
        "--timesteps", type=int, help="environment steps (segments) for ppo/sac (default: the preset's)"
    )
    budget.add_argument("--trials", type=int, help=f"trials for optuna (default {DEFAULT_TRIALS})")
    train.add_argument(
        "--preset", choices=PRESET_NAMES, default="quick",
        help="ppo/sac schedule: quick (2048 timesteps, 4 envs x 16 steps per update: 32 updates), standard "
        "(8192, 8 x 32: 32 updates) or refine (quick's schedule with a narrow start, learning rate 1e-4 and "
        "--relative-reward: for --init-policy); the run prints and logs how many updates it makes",
    )  # fmt: skip
    train.add_argument("--action", choices=["knobs", "budget"], default="knobs", help="what the agent sets")
    train.add_argument("--n-envs", type=int, default=None, help="episodes per engine batch (default: the preset's)")
    train.add_argument("--n-steps", type=int, default=None, help="ppo: segments per episode slot per update")
    train.add_argument("--batch-size", type=int, default=None, help="minibatch size")
    train.add_argument("--n-epochs", type=int, default=None, help="ppo: passes over each rollout")
    train.add_argument("--learning-rate", type=float, default=None)
    train.add_argument("--log-std-init", type=float, default=None, help="ppo/sac: log standard deviation of the "
                       "Gaussian policy at the start (default the preset's, -1: 0.37 in action units)")  # fmt: skip
    train.add_argument("--gamma", type=float, default=None, help="ppo/sac: discount of later segments' rewards "
                       "(default the preset's, 0.99; lower values credit an action mostly with its own segment and "
                       "discount a retrieval answer at the episode's end)")  # fmt: skip
    train.add_argument("--learning-starts", type=int, default=None, help="sac: uniformly random actions before the "
                       "first gradient step (default the preset's, 128; 0 explores around the start from the "
                       "first step)")  # fmt: skip
    train.add_argument("--ent-coef", default=None, help="ppo/sac: entropy bonus (default SB3's: ppo 0, sac auto, "
                       "learned from 1.0); sac also auto_X: learned from X")  # fmt: skip
    train.add_argument("--eval-every", type=int, default=None, help="updates between evaluations of the "
                       "deterministic policy on every training episode (0: only before and after)")  # fmt: skip
    train.add_argument(
        "--scorer", default=None,
        help="block scorer of the tuned policy (h2o, snapkv, tova, decayed, knorm, recency; default the base "
        "policy's, snapkv); optuna also takes a comma-separated list and searches it",
    )  # fmt: skip
    train.add_argument(
        "--init-policy", default=None, metavar="POLICY",
        help="ppo/sac: start the agent from this dynamic policy's knobs (a YAML file such as an Optuna run's "
        "OUT/policy/policy.yaml, a registry reference, or calibrated): an action of 0 is that policy, in the space "
        "searched around the default base",
    )  # fmt: skip
    train.add_argument(
        "--keep", choices=["best", "last"], default=None,
        help="ppo/sac: export the policy of the best evaluation on the training episodes (or on the share "
        "--validation-fraction holds out; the untrained one counts; default in teacher mode) or as the last update "
        "left it (default in decode mode: evaluations are teacher-forced, a reward the decode agent does not train on)",
    )  # fmt: skip
    train.add_argument(
        "--validation-fraction", type=float, default=None, metavar="F",
        help="ppo/sac: train on the other training items and run the evaluations that choose the export (--keep "
        "best) on this share of them, every kind represented (default: the preset's; 0: evaluate on the items "
        "trained on)",
    )  # fmt: skip
    train.add_argument(
        "--relative-reward", action="store_true",
        help="ppo/sac: reward each segment minus what the base policy (an action of 0) earns on the same segment of "
        "the same item, measured once before training; changes no policy's ranking, removes the spread of returns "
        "between items from the advantages (evaluations and exports keep the plain reward)",
    )  # fmt: skip
    train.add_argument(
        "--mode", choices=["teacher", "decode"], default="teacher",
        help="episodes scored teacher-forced (fast, KL reward) or decoded freely (divergence reward)",
    )  # fmt: skip
    train.add_argument("--objectives", choices=["reward", "pareto"], default="reward", help="optuna objective(s)")
    train.add_argument("--storage", default=None, help="optuna storage URL (default sqlite:///OUT/optuna.db)")
    train.add_argument("--study", default=None, help="optuna study name (default confkv-<model>-<workload>)")
    train.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///mlflow.db)")
    train.add_argument("--out", required=True)
    train.add_argument(
        "--register-as",
        default=None,
        metavar="NAME",
        help="registry policy to add the result to as a new version (default <model>-<workload>)",
    )
    train.add_argument("--no-register", action="store_true", help="do not add the result to the policy registry")
    train.add_argument("--registry-url", default=None, help="policy registry (default $CONFKV_REGISTRY_URL or the "
                       "SQLite file ~/.local/share/confkv/registry.db)")  # fmt: skip

    ev = sub.add_parser("eval", help="evaluate a policy on a workload split")
    ev.add_argument(
        "policy",
        help="YAML file, exported folder, registry://NAME@ALIAS (or @VERSION), built-in name, 'default' (the dynamic "
        "rule sized for the episodes) or 'calibrated' (that rule with the model's calibrated thresholds)",
    )
    _common(ev)
    ev.add_argument("--split", choices=["train", "heldout"], default="heldout")
    ev.add_argument("--json", action="store_true")
    _tracking(ev)

    cmp_ = sub.add_parser("compare", help="default rule vs learned policies vs fixed baselines on held-out items")
    _common(cmp_)
    cmp_.add_argument("--policy", action="append", default=[], metavar="NAME=PATH", help="a policy to include")
    cmp_.add_argument("--split", choices=["train", "heldout"], default="heldout")
    cmp_.add_argument("--out", required=True)
    _tracking(cmp_)

    ex = sub.add_parser("export", help="write a registered version (NAME@ALIAS, NAME@VERSION) or an MLflow run's "
                        "policy as a policy file or folder")  # fmt: skip
    ex.add_argument(
        "run",
        metavar="NAME@ALIAS|NAME@VERSION|RUN_ID",
        help="a registry version (anything with '@', or registry://...), else an MLflow run id",
    )
    ex.add_argument("--out", required=True, help="YAML file (rule policies) or folder")
    ex.add_argument("--tracking-uri", default=None)
    ex.add_argument("--registry-url", default=None, help="policy registry (default $CONFKV_REGISTRY_URL or the "
                    "SQLite file ~/.local/share/confkv/registry.db)")  # fmt: skip

    from tuner.registry_cli import add_registry_commands

    add_registry_commands(sub)
    return parser


def _finite(flag: str, value: float | None) -> None:
    """Refuse NaN and infinity: they pass every range check (a comparison with NaN is false) and then poison the
    reward, the optimiser or the JSON printed (``NaN`` is not JSON)."""
    if value is not None and not math.isfinite(value):
        raise ConfkvError(f"{flag} must be a finite number (got {value})")


def _weights(args: argparse.Namespace):
    from envs.env import RewardWeights

    return RewardWeights(args.memory_weight, args.quality_weight, args.task_weight)


def _data(args: argparse.Namespace, split: str):
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
        from confkv.bench.specs import baseline_policy

        return baseline_policy(base, spec)
    path = Path(spec)
    if path.exists() or spec.startswith("registry://"):
        return load_policy_file(spec)
    raise ConfkvError(f"policy {spec!r} is neither a file, an exported folder, nor one of default, calibrated, "
                      f"{', '.join(BUILTIN_POLICIES)}")  # fmt: skip


def _summary(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k != "per_episode"}


def _scorers(args: argparse.Namespace) -> list[str]:
    from confkv.scorers import SCORER_NAMES

    names = [n.strip() for n in (args.scorer or "").split(",") if n.strip()]
    bad = [n for n in names if n not in SCORER_NAMES]
    if bad:
        raise ConfkvError(f"unknown scorer {bad[0]!r}; choose from {', '.join(SCORER_NAMES)}")
    if len(names) > 1 and args.algo != "optuna":
        raise ConfkvError("an agent runs under one scorer (a sequence keeps its scorer); --scorer takes a list with "
                          "--algo optuna only")  # fmt: skip
    return names


def _ent_coef(text: str, algo: str) -> float | str:
    """``--ent-coef`` as SB3 takes it: a number, or for SAC ``auto`` / ``auto_X`` (learned, starting at X)."""
    auto = algo == "sac" and (text == "auto" or text.startswith("auto_"))
    try:
        value = float(text.removeprefix("auto").removeprefix("_") or 1) if auto else float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0 or (auto and value == 0):
        raise ConfkvError(f"--ent-coef must be a number >= 0, not NaN or infinite (sac also: auto, auto_X with "
                          f"finite X > 0); got {text!r}")  # fmt: skip
    return text if auto else value


def _preset(args: argparse.Namespace) -> Any:
    import dataclasses

    from agents.sb3 import PRESETS

    changes = {k: getattr(args, k) for k in ("n_steps", "batch_size", "n_epochs", "learning_rate", "eval_every",
                                             "log_std_init", "gamma", "learning_starts", "ent_coef")
               if getattr(args, k) is not None}  # fmt: skip
    if args.n_envs is not None:
        changes["n_envs"] = args.n_envs
    for name in ("learning_rate", "log_std_init", "gamma"):
        _finite("--" + name.replace("_", "-"), changes.get(name))
    signed = ("eval_every", "log_std_init", "gamma", "learning_starts", "ent_coef")  # checked on their own
    positive = [v for k, v in changes.items() if k not in signed]
    if any(v <= 0 for v in positive):
        raise ConfkvError("--n-envs, --n-steps, --batch-size, --n-epochs and --learning-rate must be positive")
    if changes.get("eval_every", 0) < 0:
        raise ConfkvError("--eval-every must be at least 0 (0: evaluate only before the first update and after the "
                          "last)")  # fmt: skip
    if not 0 <= changes.get("gamma", 0) <= 1 or changes.get("learning_starts", 0) < 0:
        raise ConfkvError("--gamma must be in [0, 1] and --learning-starts at least 0")
    if "ent_coef" in changes:
        changes["ent_coef"] = _ent_coef(changes["ent_coef"], args.algo)
    if changes.get("eval_every") == 0:
        changes["eval_every"] = 1 << 30  # before the first update and after the last only
    if args.mode == "decode":
        changes["n_envs"] = 1  # one free-decoding episode at a time
    preset = dataclasses.replace(PRESETS[args.preset], **changes)
    rollout = preset.n_steps * preset.n_envs
    if args.algo == "ppo" and preset.batch_size > rollout and args.batch_size is None:
        preset = dataclasses.replace(preset, batch_size=rollout)  # a minibatch no larger than a rollout
    if args.algo == "ppo":
        # stable-baselines3 asserts both (advantages are normalised over a minibatch), after the model has loaded
        if rollout < 2:
            one = " (--mode decode runs one episode at a time)" if args.mode == "decode" else ""
            raise ConfkvError(f"ppo needs a rollout of at least 2 segments: --n-steps x --n-envs is "
                              f"{preset.n_steps} x {preset.n_envs}{one}")  # fmt: skip
        if preset.batch_size < 2:
            raise ConfkvError(f"ppo needs --batch-size of at least 2 (got {preset.batch_size})")
    return preset


def _warm_start(args: argparse.Namespace, data: Any, scorers: list[str]) -> dict[str, Any]:
    """Centre the agent's space on ``--init-policy``'s knobs, keeping the bounds searched around the tuned base, so
    the untrained agent is that policy (typically an Optuna run's best); with ``--keep best`` the export is never
    below it on the training episodes (held-out items may still differ). Returns the run parameters it sets."""
    from confkv.learned import KNOB_NAMES

    init = resolve_policy_arg(args.init_policy, data.base_policy, args.model, args.cache_dir)
    if init.controller != "dynamic":
        raise ConfkvError(f"--init-policy must be a dynamic policy (got controller {init.controller!r})")
    base = data.base_policy
    if (init.min_recent, init.sink_tokens, init.compact_interval, init.block_size) != (
        base.min_recent, base.sink_tokens, base.compact_interval, base.block_size
    ):  # fmt: skip
        raise ConfkvError("--init-policy must share the base policy's min_recent, sink_tokens, compact_interval and "
                          "block_size (only its knobs and scorer are taken)")  # fmt: skip
    space = data.knob_space()
    outside = [n for n, lo, hi in zip(space.names, space.low, space.high, strict=True)
               if not lo <= float(getattr(init, n)) <= hi]  # fmt: skip
    if outside:
        raise ConfkvError(f"--init-policy sets {', '.join(outside)} outside the searched space {space.bounds()}")
    data.bounds_of = base
    knobs = {n: getattr(init, n) for n in KNOB_NAMES}
    data.base_policy = base.replace(**knobs, scorer=scorers[0] if scorers else init.effective_scorer)
    return {"init_policy": args.init_policy, **{f"init_{k}": v for k, v in knobs.items()}}


def cmd_train(args: argparse.Namespace) -> int:
    from envs.evaluate import evaluate_policy
    from tuner.search import space_description
    from tuner.tracking import check_tracking_uri, log_artifact_file, log_artifacts, log_metrics, mlflow_run, set_tags

    if args.algo == "optuna" and args.timesteps is not None:
        raise ConfkvError("--algo optuna takes --trials")
    if args.algo != "optuna" and args.trials is not None:
        raise ConfkvError(f"--algo {args.algo} takes --timesteps")
    if args.algo == "sac" and args.action != "knobs":
        raise ConfkvError("sac needs --action knobs")
    if args.init_policy is not None and (args.algo == "optuna" or args.action != "knobs"):
        raise ConfkvError("--init-policy starts a knobs agent (ppo or sac with --action knobs)")
    if args.relative_reward and args.algo == "optuna":
        raise ConfkvError("--relative-reward is for ppo or sac")
    if (args.gamma is not None or args.ent_coef is not None) and args.algo == "optuna":
        raise ConfkvError("--gamma and --ent-coef are for ppo or sac")
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
    _weights(args)  # checked before the model loads: RewardWeights refuses non-finite values
    scorers = _scorers(args)
    params: dict[str, Any] = {}
    if args.algo == "optuna":
        args.trials = args.trials if args.trials is not None else DEFAULT_TRIALS
        if args.trials < 1:
            raise ConfkvError("--trials must be at least 1")
    else:
        from agents.sb3 import describe, preset_params, schedule

        preset = _preset(args)
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
        plan = schedule(args.algo, args.timesteps, args.n_envs, preset)
        print(describe(args.algo, args.timesteps, args.n_envs, preset), file=sys.stderr)
        params.update(preset_params(preset))
        params.update({f"{args.algo}_{k}": v for k, v in plan.items()})
    out = out_folder(args.out)
    check_tracking_uri(args.tracking_uri)
    settings = _check_study(args, out, scorers) if args.algo == "optuna" else None
    t0 = time.perf_counter()
    data = _data(args, "train")
    if len(scorers) == 1:
        data.base_policy = data.base_policy.replace(scorer=scorers[0])
    weights = _weights(args)
    tuned_base = data.base_policy
    if args.init_policy is not None:
        params.update(_warm_start(args, data, scorers))
    params.update({
        "algo": args.algo, "model": args.model, "workload": args.workload, "seed": args.seed,
        "episodes": len(data.episodes), "items_scale": args.items_scale, "timesteps": args.timesteps,
        "trials": args.trials, "action": args.action, "relative_reward": args.relative_reward,
        "validation_fraction": args.validation_fraction,
        "n_envs": args.n_envs, "objectives": args.objectives, "mode": args.mode, **weights.__dict__,
        **{f"base_{k}": v for k, v in tuned_base.model_dump(
            include={"base_size", "max_size", "min_recent", "compact_interval", "entropy_threshold", "gap_threshold",
                     "scaling_factor"}).items()},
        "base_scorer": data.base_policy.effective_scorer,
        **space_description(tuned_base, scorers if args.algo == "optuna" else ()),
    })  # fmt: skip
    policy_dir = out / "policy"
    lineage: dict[str, Any] = {}
    with mlflow_run(args.tracking_uri, f"{args.algo}-{args.model}-{args.workload}", params,
                    tags={"confkv.kind": "train"}) as run:  # fmt: skip
        default = evaluate_policy(data, tuned_base, weights)
        log_metrics({"default_reward": default["reward"], "default_kv_fraction": default["kv_fraction"],
                     "default_kl": default["kl_mean"]}, step=0)  # fmt: skip
        start = None
        if args.init_policy is not None:
            start = evaluate_policy(data, data.base_policy, weights)
            log_metrics({"init_reward": start["reward"], "init_kv_fraction": start["kv_fraction"],
                         "init_kl": start["kl_mean"]}, step=0)  # fmt: skip
        if args.algo == "optuna":
            policy = _train_optuna(args, data, weights, out, log_metrics, lineage, scorers, settings or {})
            policy_dir.mkdir(exist_ok=True)
            import yaml

            (policy_dir / "policy.yaml").write_text(yaml.safe_dump({"cache_policy": policy.model_dump(mode="json")}))
        else:
            policy = _train_rl(args, data, weights, out, policy_dir, log_metrics, default["reward"])
        final = evaluate_policy(data, policy, weights)
        log_metrics({f"train_{k}": v for k, v in _summary(final).items()})
        set_tags(
            {"confkv.train_reward": round(final["reward"], 6), "confkv.default_reward": round(default["reward"], 6)}
        )
        log_artifacts(policy_dir, "policy")
        for png in out.glob("*.png"):
            log_artifact_file(png)
        summary = {
            "run_id": run.info.run_id,
            "policy": str(policy_dir),
            "seconds": round(time.perf_counter() - t0, 1),
            "train": _summary(final),
            "default": _summary(default),
            **({"init": _summary(start)} if start is not None else {}),
            **({"schedule": plan} if args.algo != "optuna" else {}),
        }
        if not args.no_register:
            summary["registry"] = _register_result(args, run.info.run_id, policy_dir, final, lineage)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


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
    return settings


def _train_optuna(
    args: argparse.Namespace, data: Any, weights: Any, out: Path, log_metrics: Any, lineage: dict[str, Any],
    scorers: list[str], settings: dict[str, Any],
) -> CachePolicy:  # fmt: skip
    from confkv.calibration import calibrated_thresholds
    from tuner.search import best_policy, best_trial, search
    from tuner.tracking import set_tags

    storage, study_name = args.storage, args.study  # set by _check_study
    xs: list[float] = []
    ys: list[float] = []

    def on_trial(trial: Any, metrics: dict[str, Any]) -> None:
        log_metrics({"trial_reward": metrics["reward"], "trial_kv_fraction": metrics["kv_fraction"],
                     "trial_kl": metrics["kl_mean"], "trial_passkey_acc": metrics.get("passkey_acc"),
                     "trial_multikey_acc": metrics.get("multikey_acc")}, step=trial.number)  # fmt: skip
        xs.append(metrics["kv_fraction"])
        ys.append(metrics["kl_mean"])

    calibrated = calibrated_thresholds(args.model, args.cache_dir)
    seeds = [data.base_policy.replace(**calibrated)] if calibrated else []
    study = search(data, args.trials, storage=storage, study_name=study_name, objectives=args.objectives,
                   weights=weights, seed=args.seed, on_trial=on_trial, progress=sys.stderr.isatty(),
                   scorers=scorers, seeds=seeds, settings=settings)  # fmt: skip
    if xs:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 4))
        ax.scatter(xs, ys, c=range(len(xs)), cmap="viridis")
        ax.set_xlabel("resident KV fraction")
        ax.set_ylabel("mean KL to full (nats)")
        ax.set_title(f"Optuna trials ({study_name})")
        fig.tight_layout()
        fig.savefig(out / "optuna_trials.png", dpi=110)
        plt.close(fig)
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
    return best_policy(study, data.base_policy)


def _learning_curve(
    out: Path, title: str, episodes: list[tuple[float, float]], evals: list[tuple[float, float]], default: float
) -> None:
    """Episode rewards (dots), their running mean over 20, the deterministic policy's evaluations (line) and the
    default rule's reward on the same episodes (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    if episodes:
        xs, ys = map(np.array, zip(*episodes, strict=True))
        ax.scatter(xs, ys, s=6, alpha=0.3, label="episode reward")
        k = min(20, len(ys))
        ax.plot(xs[k - 1 :], np.convolve(ys, np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k} episodes")
    if evals:
        ex, ey = zip(*evals, strict=True)
        ax.plot(ex, ey, marker="o", lw=2, label="deterministic policy, all training episodes")
    ax.axhline(default, ls="--", c="gray", label="default rule")
    ax.set_xlabel("timestep (segments)")
    ax.set_ylabel("reward per episode")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_curve.png", dpi=110)
    plt.close(fig)


def _train_rl(
    args: argparse.Namespace, data: Any, weights: Any, out: Path, policy_dir: Path, log_metrics: Any,
    default_reward: float,
) -> CachePolicy:  # fmt: skip
    from agents.export import export_sb3
    from agents.sb3 import train_sb3
    from envs.env import ConfKVVecEnv
    from envs.episodes import hold_out
    from envs.evaluate import evaluate_agent, evaluate_policy, reference_rewards

    judge, baseline = data, "default"
    if args.validation_fraction > 0:
        baseline = "start"
        try:
            data, judge = hold_out(data, args.validation_fraction)
        except ValueError as err:
            raise ConfkvError(str(err)) from None
        default_reward = evaluate_policy(judge, data.base_policy, weights)["reward"]
        log_metrics({"validation_episodes": len(judge.episodes), "validation_start_reward": default_reward})
        print(f"  training on {len(data.episodes)} episodes; {len(judge.episodes)} held out to choose the export "
              f"(the starting policy earns {default_reward:.3f} on them)", file=sys.stderr)  # fmt: skip
    if args.mode == "decode":
        from stable_baselines3.common.vec_env import DummyVecEnv

        from envs.decode_env import ConfKVDecodeEnv

        env = DummyVecEnv([lambda: ConfKVDecodeEnv(data, args.action, weights)])
        env.seed(args.seed)
    else:
        reference = None
        if args.relative_reward:
            reference = reference_rewards(data, args.action, weights)
            mean = sum(map(sum, reference.values())) / len(reference)
            log_metrics({"reference_reward": mean})
            print(f"  rewards relative to the base policy's (its mean episode reward {mean:.3f})", file=sys.stderr)
        env = ConfKVVecEnv(data, args.n_envs, args.action, weights, seed=args.seed, reference=reference)
    episodes: list[tuple[float, float]] = []
    evals: list[tuple[float, float]] = []

    def on_episode(timestep: int, ep: dict[str, Any]) -> None:
        quality = {"episode_kl": ep["kl"]} if "kl" in ep else {"episode_divergence": ep["divergence"]}
        log_metrics({"episode_reward": ep["reward"], f"episode_reward_{ep['workload']}": ep["reward"],
                     "episode_kv_fraction": ep["kv_fraction"], **quality}, step=timestep)  # fmt: skip
        episodes.append((timestep, ep["reward"]))

    def evaluate(act: Any) -> dict[str, Any]:
        return evaluate_agent(judge, act, args.action, weights)

    def on_eval(timestep: int, updates: int, m: dict[str, Any]) -> None:
        log_metrics({"eval_reward": m["reward"], "eval_kv_fraction": m["kv_fraction"], "eval_kl": m["kl_mean"],
                     "eval_passkey_acc": m.get("passkey_acc"), "eval_multikey_acc": m.get("multikey_acc"),
                     "eval_updates": updates}, step=timestep)  # fmt: skip
        evals.append((timestep, m["reward"]))
        print(
            f"  after {updates} updates ({timestep} timesteps): reward {m['reward']:.3f} ({baseline} "
            f"{default_reward:.3f}), kv {100 * m['kv_fraction']:.1f}%, kl {m['kl_mean']:.4f}",
            file=sys.stderr,
        )

    def on_select(updates: int, reward: float) -> None:
        log_metrics({"selected_updates": updates, "selected_reward": reward})
        on = "validation" if judge is not data else "training"
        print(f"  exported: the policy after {updates} updates ({on} reward {reward:.3f})", file=sys.stderr)

    model = train_sb3(args.algo, env, args.timesteps, preset=args.preset_obj, seed=args.seed, on_episode=on_episode,
                      log_metrics=lambda metrics, step: log_metrics(metrics, step=step), evaluate=evaluate,
                      on_eval=on_eval, progress=sys.stderr.isatty(), keep=args.keep, on_select=on_select)  # fmt: skip
    env.close()
    export_sb3(model, args.action, policy_dir, data.base_policy, {"workload": args.workload, "model": args.model},
               space=data.knob_space() if args.action == "knobs" else None)  # fmt: skip
    model.save(out / f"{args.algo}_sb3.zip")
    _learning_curve(out, f"{args.algo} on {args.workload} ({args.model})", episodes, evals, default_reward)
    return load_policy_file(policy_dir)


def _maybe_run(args: argparse.Namespace, name: str, params: dict[str, Any], kind: str) -> Any:
    """An MLflow run for eval/compare (a no-op context with ``--no-mlflow``)."""
    import contextlib

    if args.no_mlflow:
        return contextlib.nullcontext()
    from tuner.tracking import mlflow_run

    return mlflow_run(args.tracking_uri, name, params, tags={"confkv.kind": kind})


def cmd_eval(args: argparse.Namespace) -> int:
    from envs.evaluate import evaluate_policy

    _weights(args)  # checked before the model loads: RewardWeights refuses non-finite values
    if not args.no_mlflow:
        from tuner.tracking import check_tracking_uri

        check_tracking_uri(args.tracking_uri)
    data = _data(args, args.split)
    policy = resolve_policy_arg(args.policy, data.base_policy, args.model, args.cache_dir)
    weights = _weights(args)
    knobs = policy.model_dump(exclude={"learned_path"}, exclude_none=True)
    params = {"policy": args.policy, "controller": policy.controller, "model": args.model, "workload": args.workload,
              "split": args.split, "seed": args.seed, "episodes": len(data.episodes),
              "items_scale": args.items_scale, **weights.__dict__,
              **{f"policy_{k}": v for k, v in knobs.items()}}  # fmt: skip
    with _maybe_run(args, f"eval-{Path(args.policy).name or args.policy}-{args.model}-{args.split}", params, "eval"):
        metrics = evaluate_policy(data, policy, weights)
        out = {"policy": args.policy, "controller": policy.controller, "split": args.split, **_summary(metrics)}
        if not args.no_mlflow:
            from tuner.tracking import log_dict, log_metrics

            log_metrics(_summary(metrics))
            log_dict({**out, "per_episode": metrics["per_episode"]}, "eval.json")
    if args.json:
        print(json.dumps({**out, "per_episode": metrics["per_episode"]}))
    else:
        print(json.dumps(out))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from confkv.calibration import calibrated_thresholds
    from envs.evaluate import evaluate_policy
    from tuner.tracking import check_tracking_uri, metric_key

    _weights(args)  # checked before the model loads: RewardWeights refuses non-finite values
    out = out_folder(args.out)
    if not args.no_mlflow:
        check_tracking_uri(args.tracking_uri)
    data = _data(args, args.split)
    named: list[tuple[str, CachePolicy]] = [("default", data.base_policy)]
    if calibrated_thresholds(args.model, args.cache_dir):
        named.append(("calibrated", resolve_policy_arg("calibrated", data.base_policy, args.model, args.cache_dir)))
    for item in args.policy:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfkvError(f"--policy expects NAME=PATH (got {item!r})")
        named.append((name, resolve_policy_arg(path, data.base_policy, args.model, args.cache_dir)))
    for name in BUILTIN_POLICIES:
        if name != "dynamic":
            named.append((name, resolve_policy_arg(name, data.base_policy)))
    params = {"model": args.model, "workload": args.workload, "split": args.split, "seed": args.seed,
              "episodes": len(data.episodes), "items_scale": args.items_scale,
              "policies": ",".join(n for n, _ in named), **_weights(args).__dict__,
              # a policy's name is free text; as part of a parameter key it must be what MLflow accepts
              **{f"policy.{metric_key(item.partition('=')[0])}": item.partition("=")[2]
                 for item in args.policy}}  # fmt: skip
    with _maybe_run(args, f"compare-{args.model}-{args.workload}-{args.split}", params, "compare"):
        rows = []
        for name, policy in named:
            m = _summary(evaluate_policy(data, policy, _weights(args)))
            rows.append({"policy": name, "controller": policy.controller, **m})
            print(f"{name}: kv {100 * m['kv_fraction']:.1f}% kl {m['kl_mean']:.4f}", file=sys.stderr)
        (out / "compare.json").write_text(json.dumps(rows, indent=2))
        fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
        pct = lambda v: None if v is None else 100 * v  # noqa: E731
        lines = [
            f"# Policy comparison: {args.model}, workload {args.workload}, split {args.split}",
            "",
            "| policy | controller | KV % | KL | ppl | pass-key % | multi-key % | reward |",
            "|:---|:---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(f"| {r['policy']} | {r['controller']} | {100 * r['kv_fraction']:.1f} | {r['kl_mean']:.4f} | "
                         f"{fmt(r['ppl'], '.3f')} | {fmt(pct(r['passkey_acc']), '.0f')} | "
                         f"{fmt(pct(r.get('multikey_acc')), '.0f')} | {r['reward']:.3f} |")  # fmt: skip
        (out / "compare.md").write_text("\n".join(lines) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in rows:
            ax.scatter(r["kv_fraction"], r["kl_mean"], s=40)
            ax.annotate(r["policy"], (r["kv_fraction"], r["kl_mean"]), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("resident KV fraction (lower saves more)")
        ax.set_ylabel("mean KL to full (lower is better)")
        ax.set_title(f"{args.model}: {args.split} {args.workload}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "compare.png", dpi=110)
        plt.close(fig)
        if not args.no_mlflow:
            from tuner.tracking import log_artifact_file, log_metrics

            for r in rows:
                log_metrics(
                    {f"{metric_key(r['policy'])}.{k}": v for k, v in r.items() if k not in ("policy", "controller")}
                )
            for name in ("compare.json", "compare.md", "compare.png"):
                log_artifact_file(out / name)
    print("\n".join(lines))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tuner.registry_cli import export_registry, is_registry_target
    from tuner.tracking import download_policy

    if is_registry_target(args.run):
        return export_registry(args)
    try:
        path = download_policy(args.run, args.out, args.tracking_uri)
    except ConfkvError:
        raise
    except Exception as err:  # MLflow raises several types for an unknown run or artifact
        raise ConfkvError(f"cannot export run {args.run!r}: {str(err).splitlines()[0]} "
                          "(a registered policy is named NAME@ALIAS or NAME@VERSION)") from None  # fmt: skip
    load_policy_file(path)  # it must load
    print(str(path))
    return 0


def _mlflow_errors_are_user_errors(
    command: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """MLflow's own refusals (a store it cannot open, a value it rejects) as one line, not a traceback: the last
    resort behind the up-front checks. Matched without importing MLflow: if it was never imported, it raised nothing."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except Exception as err:
            exceptions = sys.modules.get("mlflow.exceptions")
            if exceptions is not None and isinstance(err, exceptions.MlflowException):
                message = str(err).strip().splitlines()
                raise ConfkvError(f"MLflow: {message[0] if message else type(err).__name__}") from None
            raise

    return run


def main(argv: Sequence[str] | None = None) -> int:
    from confkv.cli import quiet_libraries, run_command

    args = build_parser().parse_args(argv)
    quiet_libraries()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from tuner import registry_cli as rc

    commands = {
        "train": cmd_train, "eval": cmd_eval, "compare": cmd_compare, "export": rc.wrap_exit1(cmd_export),
        "register": rc.wrap_exit1(rc.cmd_register), "policies": rc.wrap_exit1(rc.cmd_policies),
        "promote": rc.wrap_exit1(rc.cmd_promote), "rollback": rc.wrap_exit1(rc.cmd_rollback),
    }  # fmt: skip
    # OSError: a path that cannot be read or written, reported as one line when no earlier check caught it
    command = _mlflow_errors_are_user_errors(commands[args.command])
    return run_command("confkv-tune", command, args, user_errors=(ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
