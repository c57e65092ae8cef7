"""``confkv-tune``: learn the CONF-KV policy, evaluate it on held-out items, compare, register, promote, export.

    confkv-tune train --algo {ppo,sac,optuna} --model M [--workload mixed] (--timesteps N | --trials N) --out DIR
                      [--register-as NAME | --no-register]
    confkv-tune eval POLICY --workload NAME --split heldout
    confkv-tune compare --policy optuna=DIR/policy.yaml --policy ppo=DIR2/policy --out DIR3
    confkv-tune register NAME (--policy-file F | --artifact DIR | --run RUN_ID)
    confkv-tune policies list | policies show NAME[@VERSION|@ALIAS]
    confkv-tune promote NAME VERSION [--alias production] [--reason TEXT] [--check WORKLOAD] [--force]
    confkv-tune rollback NAME [--alias production]
    confkv-tune export NAME@ALIAS|NAME@VERSION|RUN_ID --out PATH

POLICY is a YAML policy file, an exported policy folder, a ``registry://NAME@ALIAS`` reference, a built-in policy
name, or ``default`` (the requirement's dynamic rule, sized for the episodes). ``train`` registers its result as
a new version (no alias) in the policy registry (``store``; see ``tuner.registry_cli``). ``export`` reads the
registry when its argument has an ``@`` (or is ``registry://...``), and an MLflow run's exported policy otherwise.
User errors print one line on stderr and exit with 2; the registry's refusals (a missing version, a promotion
the gate refuses) exit with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from confkv.config import BUILTIN_POLICIES, CachePolicy, load_policy_file
from confkv.errors import ConfkvError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("CONFKV_MODEL", "smollm2-135m"))
    p.add_argument("--workload", default="mixed", help="mixed (default), prose, longgen, chat, passkey")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", default=None, help="device KV pool per engine, e.g. 512MiB")
    p.add_argument("--cache-dir", default=None, help="converted-model cache (default: $CONFKV_CACHE)")
    p.add_argument("--memory-weight", type=float, default=1.0)
    p.add_argument("--quality-weight", type=float, default=2.0)
    p.add_argument("--task-weight", type=float, default=1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="confkv-tune", description="Learn and evaluate CONF-KV cache policies.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train an RL agent or run an Optuna search, tracked in MLflow")
    _common(train)
    train.add_argument("--algo", choices=["ppo", "sac", "optuna"], required=True)
    budget = train.add_mutually_exclusive_group(required=True)
    budget.add_argument("--timesteps", type=int, help="environment steps (segments) for ppo/sac")
    budget.add_argument("--trials", type=int, help="trials for optuna")
    train.add_argument("--action", choices=["knobs", "budget"], default="knobs", help="what the agent sets")
    train.add_argument("--n-envs", type=int, default=4, help="episodes per engine batch (teacher mode)")
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
    ev.add_argument("policy", help="YAML file, exported folder, built-in name, or 'default'")
    _common(ev)
    ev.add_argument("--split", choices=["train", "heldout"], default="heldout")
    ev.add_argument("--json", action="store_true")

    cmp_ = sub.add_parser("compare", help="default rule vs learned policies vs fixed baselines on held-out items")
    _common(cmp_)
    cmp_.add_argument("--policy", action="append", default=[], metavar="NAME=PATH", help="a policy to include")
    cmp_.add_argument("--split", choices=["train", "heldout"], default="heldout")
    cmp_.add_argument("--out", required=True)

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


def _weights(args: argparse.Namespace):
    from envs.env import RewardWeights

    return RewardWeights(args.memory_weight, args.quality_weight, args.task_weight)


def _data(args: argparse.Namespace, split: str):
    from envs.episodes import TUNE_WORKLOADS, build_episodes

    if args.workload not in TUNE_WORKLOADS:
        raise ConfkvError(f"unknown workload {args.workload!r}; choose one of {', '.join(TUNE_WORKLOADS)}")
    return build_episodes(args.model, workload=args.workload, split=split, seed=args.seed, device=args.device,
                          dtype=args.dtype, cache_dir=args.cache_dir, kv_cache_memory=args.kv_cache_memory)  # fmt: skip


def resolve_policy_arg(spec: str, base: CachePolicy) -> CachePolicy:
    """A policy named on the command line, relative to the tuned base policy."""
    if spec == "default":
        return base
    if spec in BUILTIN_POLICIES:
        if spec == "dynamic":
            return base
        if spec == "full":
            return base.replace(controller="full")
        from confkv.bench.suite import baseline_policy

        return baseline_policy(base, spec)
    path = Path(spec)
    if path.exists() or spec.startswith("registry://"):
        return load_policy_file(spec)
    raise ConfkvError(f"policy {spec!r} is neither a file, an exported folder, nor one of default, "
                      f"{', '.join(BUILTIN_POLICIES)}")  # fmt: skip


def _summary(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k != "per_episode"}


def _plot_curve(xs: list[float], ys: list[float], xlabel: str, ylabel: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, ys, marker=".", lw=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_train(args: argparse.Namespace) -> int:
    from envs.evaluate import evaluate_policy
    from tuner.tracking import log_artifact_file, log_artifacts, log_metrics, mlflow_run

    if args.algo == "optuna" and args.trials is None:
        raise ConfkvError("--algo optuna takes --trials")
    if args.algo != "optuna" and args.timesteps is None:
        raise ConfkvError(f"--algo {args.algo} takes --timesteps")
    if (args.trials or args.timesteps or 0) < 1:
        raise ConfkvError("--timesteps/--trials must be at least 1")
    if args.algo == "sac" and args.action != "knobs":
        raise ConfkvError("sac needs --action knobs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = _data(args, "train")
    weights = _weights(args)
    params = {
        "algo": args.algo, "model": args.model, "workload": args.workload, "seed": args.seed,
        "episodes": len(data.episodes), "timesteps": args.timesteps, "trials": args.trials, "action": args.action,
        "n_envs": args.n_envs, "objectives": args.objectives, "mode": args.mode, **weights.__dict__,
        **{f"base_{k}": v for k, v in data.base_policy.model_dump(
            include={"base_size", "max_size", "min_recent", "compact_interval"}).items()},
    }  # fmt: skip
    policy_dir = out / "policy"
    lineage: dict[str, Any] = {}
    with mlflow_run(args.tracking_uri, f"{args.algo}-{args.model}-{args.workload}", params) as run:
        if args.algo == "optuna":
            policy = _train_optuna(args, data, weights, out, log_metrics, lineage)
            policy_dir.mkdir(exist_ok=True)
            import yaml

            (policy_dir / "policy.yaml").write_text(yaml.safe_dump({"cache_policy": policy.model_dump(mode="json")}))
        else:
            policy = _train_rl(args, data, weights, out, policy_dir, log_metrics)
        final = evaluate_policy(data, policy, weights)
        log_metrics({f"train_{k}": v for k, v in _summary(final).items()})
        log_artifacts(policy_dir, "policy")
        for png in out.glob("*.png"):
            log_artifact_file(png)
        summary = {
            "run_id": run.info.run_id,
            "policy": str(policy_dir),
            "seconds": round(time.perf_counter() - t0, 1),
            "train": _summary(final),
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


def _train_optuna(
    args: argparse.Namespace, data: Any, weights: Any, out: Path, log_metrics: Any, lineage: dict[str, Any]
) -> CachePolicy:
    from tuner.search import best_policy, best_trial, search
    from tuner.tracking import set_tags

    storage = args.storage or f"sqlite:///{(out / 'optuna.db').resolve()}"
    study_name = args.study or f"confkv-{Path(args.model).name}-{args.workload}-{args.objectives}"
    xs: list[float] = []
    ys: list[float] = []

    def on_trial(trial: Any, metrics: dict[str, Any]) -> None:
        log_metrics({"trial_reward": metrics["reward"], "trial_kv_fraction": metrics["kv_fraction"],
                     "trial_kl": metrics["kl_mean"], **({"trial_passkey_acc": metrics["passkey_acc"]}
                                                        if metrics.get("passkey_acc") is not None else {})},
                    step=trial.number)  # fmt: skip
        xs.append(metrics["kv_fraction"])
        ys.append(metrics["kl_mean"])

    study = search(data, args.trials, storage=storage, study_name=study_name, objectives=args.objectives,
                   weights=weights, seed=args.seed, on_trial=on_trial, progress=sys.stderr.isatty())  # fmt: skip
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
    lineage.update(optuna_study=study_name, optuna_trial=best_trial(study).number)
    set_tags({"confkv.optuna_study": study_name, "confkv.optuna_trial": lineage["optuna_trial"],
              "confkv.optuna_storage": storage})  # fmt: skip
    return best_policy(study, data.base_policy)


def _train_rl(
    args: argparse.Namespace, data: Any, weights: Any, out: Path, policy_dir: Path, log_metrics: Any
) -> CachePolicy:
    from agents.export import export_sb3
    from agents.sb3 import train_sb3
    from envs.env import ConfKVVecEnv

    if args.mode == "decode":
        from stable_baselines3.common.vec_env import DummyVecEnv

        from envs.decode_env import ConfKVDecodeEnv

        env = DummyVecEnv([lambda: ConfKVDecodeEnv(data, args.action, weights)])
        env.seed(args.seed)
    else:
        env = ConfKVVecEnv(data, args.n_envs, args.action, weights, seed=args.seed)
    steps: list[float] = []
    rewards: list[float] = []

    def on_episode(timestep: int, ep: dict[str, Any]) -> None:
        quality = {"episode_kl": ep["kl"]} if "kl" in ep else {"episode_divergence": ep["divergence"]}
        log_metrics({"episode_reward": ep["reward"], "episode_kv_fraction": ep["kv_fraction"], **quality},
                    step=timestep)  # fmt: skip
        steps.append(timestep)
        rewards.append(ep["reward"])

    model = train_sb3(args.algo, env, args.timesteps, seed=args.seed, on_episode=on_episode,
                      progress=sys.stderr.isatty())  # fmt: skip
    env.close()
    export_sb3(model, args.action, policy_dir, data.base_policy, {"workload": args.workload, "model": args.model})
    model.save(out / f"{args.algo}_sb3.zip")
    if steps:
        _plot_curve(steps, rewards, "timestep", "episode reward", f"{args.algo} on {args.workload}",
                    out / "reward_curve.png")  # fmt: skip
    return load_policy_file(policy_dir)


def cmd_eval(args: argparse.Namespace) -> int:
    from envs.evaluate import evaluate_policy

    data = _data(args, args.split)
    policy = resolve_policy_arg(args.policy, data.base_policy)
    metrics = evaluate_policy(data, policy, _weights(args))
    out = {"policy": args.policy, "controller": policy.controller, "split": args.split, **_summary(metrics)}
    if args.json:
        print(json.dumps({**out, "per_episode": metrics["per_episode"]}))
    else:
        print(json.dumps(out))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from envs.evaluate import evaluate_policy

    data = _data(args, args.split)
    named: list[tuple[str, CachePolicy]] = [("default", data.base_policy)]
    for item in args.policy:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfkvError(f"--policy expects NAME=PATH (got {item!r})")
        named.append((name, resolve_policy_arg(path, data.base_policy)))
    for name in BUILTIN_POLICIES:
        if name != "dynamic":
            named.append((name, resolve_policy_arg(name, data.base_policy)))
    rows = []
    for name, policy in named:
        m = _summary(evaluate_policy(data, policy, _weights(args)))
        rows.append({"policy": name, "controller": policy.controller, **m})
        print(f"{name}: kv {100 * m['kv_fraction']:.1f}% kl {m['kl_mean']:.4f}", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(rows, indent=2))
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    lines = [
        f"# Policy comparison: {args.model}, workload {args.workload}, split {args.split}",
        "",
        "| policy | controller | KV % | KL | ppl | pass-key % | reward |",
        "|:---|:---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        pk = None if r["passkey_acc"] is None else 100 * r["passkey_acc"]
        lines.append(f"| {r['policy']} | {r['controller']} | {100 * r['kv_fraction']:.1f} | {r['kl_mean']:.4f} | "
                     f"{fmt(r['ppl'], '.3f')} | {fmt(pk, '.0f')} | {r['reward']:.3f} |")  # fmt: skip
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
    print("\n".join(lines))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tuner.registry_cli import export_registry, is_registry_target
    from tuner.tracking import download_policy

    if is_registry_target(args.run):
        return export_registry(args)
    try:
        path = download_policy(args.run, args.out, args.tracking_uri)
    except Exception as err:  # MLflow raises several types for an unknown run or artifact
        raise ConfkvError(f"cannot export run {args.run!r}: {str(err).splitlines()[0]} "
                          "(a registered policy is named NAME@ALIAS or NAME@VERSION)") from None  # fmt: skip
    load_policy_file(path)  # it must load
    print(str(path))
    return 0


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
    return run_command("confkv-tune", commands[args.command], args, user_errors=(ValueError,))


if __name__ == "__main__":
    sys.exit(main())
