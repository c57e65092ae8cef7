"""``confkv-tune eval``, ``compare`` and ``export``: a policy measured on a split, several side by side, and a run's
or a registry version's policy written where ``--policy-file`` loads it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from confkv.cli import out_folder
from confkv.config import BUILTIN_POLICIES, CachePolicy, load_policy_file
from confkv.errors import ConfkvError
from tuner import options
from tuner.options import maybe_run, resolve_policy_arg, reward_weights, summary_of
from tuner.plots import compare_plot


def cmd_eval(args: argparse.Namespace) -> int:
    from envs.evaluate import evaluate_policy

    reward_weights(args)  # checked before the model loads: RewardWeights refuses non-finite values
    if not args.no_mlflow:
        from tuner.tracking import check_tracking_uri

        check_tracking_uri(args.tracking_uri)
    data = options.tune_data(args, args.split)
    policy = resolve_policy_arg(args.policy, data.base_policy, args.model, args.cache_dir)
    weights = reward_weights(args)
    knobs = policy.model_dump(exclude={"learned_path"}, exclude_none=True)
    params = {"policy": args.policy, "controller": policy.controller, "model": args.model, "workload": args.workload,
              "split": args.split, "seed": args.seed, "episodes": len(data.episodes),
              "items_scale": args.items_scale, **weights.__dict__,
              **{f"policy_{k}": v for k, v in knobs.items()}}  # fmt: skip
    with maybe_run(args, f"eval-{Path(args.policy).name or args.policy}-{args.model}-{args.split}", params, "eval"):
        metrics = evaluate_policy(data, policy, weights)
        out = {"policy": args.policy, "controller": policy.controller, "split": args.split, **summary_of(metrics)}
        if not args.no_mlflow:
            from tuner.tracking import log_dict, log_metrics

            log_metrics(summary_of(metrics))
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

    reward_weights(args)  # checked before the model loads: RewardWeights refuses non-finite values
    out = out_folder(args.out)
    if not args.no_mlflow:
        check_tracking_uri(args.tracking_uri)
    data = options.tune_data(args, args.split)
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
              "policies": ",".join(n for n, _ in named), **reward_weights(args).__dict__,
              # a policy's name is free text; as part of a parameter key it must be what MLflow accepts
              **{f"policy.{metric_key(item.partition('=')[0])}": item.partition("=")[2]
                 for item in args.policy}}  # fmt: skip
    with maybe_run(args, f"compare-{args.model}-{args.workload}-{args.split}", params, "compare"):
        rows = []
        for name, policy in named:
            m = summary_of(evaluate_policy(data, policy, reward_weights(args)))
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
        compare_plot(out / "compare.png", rows, f"{args.model}: {args.split} {args.workload}")
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
