"""``confkv-tune eval``, ``compare`` and ``export``: a policy measured on a split, several side by side, and a run's
or a registry version's policy written where ``--policy-file`` loads it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from confkv.cli import out_folder
from confkv.config import BUILTIN_POLICIES, CachePolicy, load_policy_file
from confkv.errors import ConfkvError
from confkv.progress import stage
from tuner import options
from tuner.explain import lost_retrieval, reward_lines, reward_table, term_metrics, weights_note
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
        metrics = evaluate_policy(data, policy, weights, label=f"evaluate {args.policy}")
        out = {"policy": args.policy, "controller": policy.controller, "split": args.split, **summary_of(metrics),
               "retrieval_lost": lost_retrieval(metrics)}  # fmt: skip
        if not args.no_mlflow:
            from tuner.tracking import log_dict, log_metrics

            log_metrics({**summary_of(metrics), **term_metrics(metrics)})
            log_dict({**out, "per_episode": metrics["per_episode"]}, "eval.json")
    print("\n".join(reward_lines(metrics)), file=sys.stderr)
    if args.json:
        print(json.dumps({**out, "per_episode": metrics["per_episode"]}))
    else:
        print(json.dumps(out))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from confkv.calibration import calibrated_thresholds
    from envs.constant import evaluate_with_actions, is_network
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
        given = [item.partition("=")[0] for item in args.policy]
        per_episode: dict[str, list[dict[str, Any]]] = {}
        decisions: dict[str, list[dict[str, float]]] = {}
        with stage("compare", total=len(named), unit="policies") as progress:
            for name, policy in named:
                label = f"evaluate {name}"
                if name in given and is_network(policy):  # its decisions make its own constant
                    full, decisions[name] = evaluate_with_actions(data, policy, reward_weights(args), label=label)
                else:
                    full = evaluate_policy(data, policy, reward_weights(args), label=label)
                per_episode[name] = full["per_episode"]
                m = summary_of(full)
                rows.append({"policy": name, "controller": policy.controller, **m,
                             "retrieval_lost": bool(lost_retrieval(m))})  # fmt: skip
                print(f"{name}: reward {m['reward']:.3f}, kv {100 * m['kv_fraction']:.1f}% kl {m['kl_mean']:.4f}",
                      file=sys.stderr)  # fmt: skip
                progress.update(1)
        policies = dict(named)
        checks = state_dependence(data, args, policies, decisions, per_episode, rows, given)
        fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
        pct = lambda v: None if v is None else 100 * v  # noqa: E731
        lines = [
            f"# Policy comparison: {args.model}, workload {args.workload}, split {args.split}",
            "",
            "| policy | controller | KV % | KL | ppl | pass-key % | multi-key % | reward | retrieval |",
            "|:---|:---|---:|---:|---:|---:|---:|---:|:---|",
        ]
        for r in rows:
            lines.append(f"| {r['policy']} | {r['controller']} | {100 * r['kv_fraction']:.1f} | {r['kl_mean']:.4f} | "
                         f"{fmt(r['ppl'], '.3f')} | {fmt(pct(r['passkey_acc']), '.0f')} | "
                         f"{fmt(pct(r.get('multikey_acc')), '.0f')} | {r['reward']:.3f} | "
                         f"{'**lost**' if r['retrieval_lost'] else 'kept'} |")  # fmt: skip
        full_pk, full_mk = rows[0].get("full_passkey_acc"), rows[0].get("full_multikey_acc")
        lines += ["", f"Retrieval is *lost* when a policy answers fewer pass-key or multi-key episodes than the full "
                  f"cache does on the same episodes (full: pass keys {fmt(pct(full_pk), '.0f')}%, multi-keys "
                  f"{fmt(pct(full_mk), '.0f')}%).", "", "## How the reward is made (mean per episode)", "",
                  *reward_table(rows), "", weights_note(rows)]  # fmt: skip
        lines += state_dependence_lines(checks)
        (out / "compare.json").write_text(json.dumps(rows, indent=2))
        (out / "state_dependence.json").write_text(json.dumps(checks, indent=2))
        (out / "compare.md").write_text("\n".join(lines) + "\n")
        compare_plot(out / "compare.png", rows, f"{args.model}: {args.split} {args.workload}")
        if not args.no_mlflow:
            from tuner.tracking import log_artifact_file, log_metrics

            for r in rows:
                flat = {**{k: v for k, v in r.items() if k not in ("policy", "controller")}, **term_metrics(r)}
                log_metrics({f"{metric_key(r['policy'])}.{k}": v for k, v in flat.items()})
            for name, check in checks.items():
                for other, margin in check["margins"].items():
                    log_metrics({f"{metric_key(name)}.margin_{metric_key(other)}{suffix}": margin[key]
                                 for key, suffix in (("mean", ""), ("lo", "_lo"), ("hi", "_hi"))})  # fmt: skip
            for name in ("compare.json", "compare.md", "compare.png", "state_dependence.json"):
                log_artifact_file(out / name)
    print("\n".join(lines))
    return 0


def state_dependence(
    data: Any, args: argparse.Namespace, policies: dict[str, CachePolicy], decisions: dict[str, list[dict[str, float]]],
    per_episode: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]], given: list[str],
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each learned policy against its own constant (the ``dynamic`` rule with the network's median knobs over the
    decisions it took here, or a budget network's most frequent action taken every segment, evaluated and added to
    ``rows`` as ``NAME constant``) and against every other policy named with ``--policy``, rule (an Optuna result)
    or network (a hand rule as a network, the network it was imitated from, another seed), since a learned policy
    that only ties what it started from has learned nothing the start did not have: per-item reward margins with 95%
    bootstrap intervals over items."""
    from envs.constant import median_knobs, own_constant, paired_margin
    from envs.evaluate import evaluate_policy

    checks: dict[str, dict[str, Any]] = {}
    for name, seen in decisions.items():
        knobs = median_knobs(seen, policies[name])
        fixed = own_constant(policies[name], knobs)
        constant = evaluate_policy(data, fixed, reward_weights(args), label=f"evaluate {name}'s constant")
        m = summary_of(constant)
        rows.append({"policy": f"{name} constant", "controller": fixed.controller, **m,
                     "retrieval_lost": bool(lost_retrieval(m))})  # fmt: skip
        margins = {"constant": paired_margin(per_episode[name], constant["per_episode"], seed=args.seed).to_dict()}
        for other in (n for n in given if n != name):
            margins[other] = paired_margin(per_episode[name], per_episode[other], seed=args.seed).to_dict()
        checks[name] = {"knobs": knobs, "decisions": len(seen), "constant_reward": m["reward"],
                        "constant_kv_fraction": m["kv_fraction"], "margins": margins}  # fmt: skip
        print(f"{name} - its constant: {margins['constant']['mean']:+.4f} [{margins['constant']['lo']}, "
              f"{margins['constant']['hi']}]", file=sys.stderr)  # fmt: skip
    return checks


def state_dependence_lines(checks: dict[str, dict[str, Any]]) -> list[str]:
    """The report's section on whether each learned policy uses what it sees."""
    if not checks:
        return []
    from envs.constant import BUDGET_ACTIONS

    ci = lambda m: f"{m['mean']:+.4f} [{m['lo']:+.4f}, {m['hi']:+.4f}]" if m["lo"] is not None else f"{m['mean']:+.4f}"  # noqa: E731
    lines = ["", "## State dependence: each learned policy against its own constant", "",
             "Its constant is the plain `dynamic` rule with the network's median knobs over the decisions it took on "
             "these items (a budget network: its most frequent action, taken every segment; row `NAME constant` "
             "above). "
             "Margin: mean per-item reward difference, 95% bootstrap interval over items; a network that uses what "
             "it sees beats its constant with the interval above 0.",
             "", "| policy | decisions | its constant's knobs | margin over its constant | beats it | other margins |",
             "|:---|---:|:---|---:|:---|:---|"]  # fmt: skip
    for name, c in checks.items():
        action = c["knobs"].get("budget_action")
        knobs = f"always {BUDGET_ACTIONS[int(action)]}" if action is not None else (
            ", ".join(f"{k} {v:g}" for k, v in c["knobs"].items()))  # fmt: skip
        m = c["margins"]["constant"]
        others = "; ".join(f"vs {o}: {ci(v)}" for o, v in c["margins"].items() if o != "constant") or "-"
        lines.append(f"| {name} | {c['decisions']} | {knobs} | {ci(m)} | {'yes' if m['above_zero'] else '**no**'} | "
                     f"{others} |")  # fmt: skip
    return lines


def cmd_export(args: argparse.Namespace) -> int:
    """Write a policy where ``confkv generate --policy-file OUT`` loads it, from any of its three homes: an exported
    folder (or YAML file) on disk, a registry version, an MLflow run."""
    from tuner.registry_cli import export_registry, is_registry_target
    from tuner.tracking import download_policy

    source = Path(args.run)
    if source.exists():
        return _export_local(source, Path(args.out))
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


def _export_local(source: Path, out: Path) -> int:
    """An exported folder or a YAML policy file copied to ``out`` (a folder, or a ``.yaml`` file for a rule policy),
    checked to load before and after."""
    import shutil

    from tuner.tracking import copy_policy_folder

    policy = load_policy_file(source)
    if source.is_file() and policy.learned_path is not None:
        raise ConfkvError(f"{source} names a learned network: export the folder it is in, which holds both")
    if source.resolve() == out.resolve():
        raise ConfkvError(f"--out {out} is the policy being exported")
    if out.suffix in (".yaml", ".yml"):
        if policy.controller == "learned" or policy.learned_path is not None:
            raise ConfkvError(f"{source} is a learned policy: it exports to a folder, not to {out}")
        if out.is_dir():
            raise ConfkvError(f"--out {out} is an existing folder, not a YAML file")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / "policy.yaml" if source.is_dir() else source, out)
    elif out.exists() and not out.is_dir():
        raise ConfkvError(f"--out {out} is an existing file; give a folder (or a .yaml name for a rule policy)")
    elif source.is_dir():
        copy_policy_folder(source, out)
    else:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, out / "policy.yaml")
    load_policy_file(out)
    print(str(out))
    return 0
