"""``confkv-tune`` commands over the policy registry (``store``): register, policies, promote, rollback, export.

    confkv-tune register NAME (--policy-file F | --artifact DIR | --run RUN_ID) [--model M] [--parent N]
    confkv-tune policies list
    confkv-tune policies show NAME[@VERSION|@ALIAS]
    confkv-tune promote NAME VERSION [--alias production] [--reason TEXT] [--check WORKLOAD [--model M]] [--force]
    confkv-tune rollback NAME [--alias production] [--reason TEXT]
    confkv-tune export NAME@ALIAS|NAME@VERSION|RUN_ID --out PATH

Every command takes ``--registry-url`` (default ``$CONFKV_REGISTRY_URL``, else the user's SQLite file) and migrates
the database on first use. Exit status: 0 done; 1 the registry refused on valid input (no such policy, version
or alias; the gate found the candidate worse); 2 malformed input, as everywhere in confkv.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from confkv.errors import ConfkvError


def _url(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry-url", default=None,
        help="registry database (default $CONFKV_REGISTRY_URL or ~/.local/share/confkv/registry.db); "
             "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB",
    )  # fmt: skip


def add_registry_commands(sub: Any) -> None:
    """Add the registry subcommands to ``confkv-tune``'s subparsers (``export`` is shared with MLflow runs)."""
    reg = sub.add_parser("register", help="add a policy version to the registry; prints its version number")
    reg.add_argument("name", help="policy name (letters, digits, '.', '_', '-')")
    src = reg.add_mutually_exclusive_group(required=True)
    src.add_argument("--policy-file", help="a YAML policy file (or an exported folder)")
    src.add_argument("--artifact", help="an exported policy folder (policy.yaml, and the network of a learned one)")
    src.add_argument("--run", help="an MLflow run id whose exported policy to register (its lineage is kept)")
    reg.add_argument("--model", default=None, help="the model the policy was tuned for")
    reg.add_argument("--parent", default=None, help="the version it derives from: N (this policy) or NAME@N")
    reg.add_argument("--description", default=None)
    reg.add_argument("--artifact-store", default=None,
                     help="keep the artifact at this folder/URL instead of in the database")  # fmt: skip
    reg.add_argument("--tracking-uri", default=None, help="MLflow tracking URI for --run (default sqlite:///mlflow.db)")
    _url(reg)

    pol = sub.add_parser("policies", help="list registered policies, or show one")
    psub = pol.add_subparsers(dest="policies_command", required=True)
    ls = psub.add_parser("list", help="every policy with its versions and aliases")
    ls.add_argument("--json", action="store_true")
    _url(ls)
    show = psub.add_parser("show", help="a version's parameters, lineage, evaluations and the alias history")
    show.add_argument("ref", metavar="NAME[@VERSION|@ALIAS]")
    show.add_argument("--json", action="store_true")
    _url(show)

    pro = sub.add_parser("promote", help="point an alias (default production) at a version, optionally gated")
    pro.add_argument("name")
    pro.add_argument("version", help="version number (or 'latest', or another alias)")
    pro.add_argument("--alias", default="production")
    pro.add_argument("--reason", default=None, help="recorded in the alias history")
    pro.add_argument("--check", metavar="WORKLOAD", default=None,
                     help="evaluate candidate and current version on this workload's held-out split first; "
                          "refuse if the candidate's reward is lower")  # fmt: skip
    pro.add_argument("--force", action="store_true", help="promote even if the check finds the candidate worse")
    pro.add_argument("--model", default=None, help="model for --check (default: the version's recorded model)")
    pro.add_argument("--seed", type=int, default=0)
    pro.add_argument("--device", default=None)
    pro.add_argument("--memory-weight", type=float, default=1.0)
    pro.add_argument("--quality-weight", type=float, default=2.0)
    pro.add_argument("--task-weight", type=float, default=1.0)
    _url(pro)

    rb = sub.add_parser("rollback", help="move an alias back to the version it pointed at before")
    rb.add_argument("name")
    rb.add_argument("--alias", default="production")
    rb.add_argument("--reason", default=None)
    _url(rb)


def _registry(args: argparse.Namespace) -> Any:
    from store.registry import Registry

    return Registry(args.registry_url)


# ------------------------------------------------------------------------------------------------ register
def _run_lineage(run_id: str, tracking_uri: str | None) -> dict[str, Any]:
    """What an MLflow run says about its policy: the model, the Optuna study and trial (tags set by train)."""
    from tuner.tracking import get_run

    run = get_run(run_id, tracking_uri)
    params, tags = run.data.params, run.data.tags
    trial = tags.get("confkv.optuna_trial")
    return {
        "model": params.get("model"),
        "optuna_study": tags.get("confkv.optuna_study"),
        "optuna_trial": int(trial) if trial not in (None, "") else None,
        "description": f"MLflow run {run_id} ({params.get('algo', '?')} on {params.get('workload', '?')})",
    }


def cmd_register(args: argparse.Namespace) -> int:
    reg = _registry(args)
    meta: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="confkv-register-") as tmp:
        if args.run:
            from tuner.tracking import download_policy

            try:
                source: Path = download_policy(args.run, tmp, args.tracking_uri)
                meta = _run_lineage(args.run, args.tracking_uri)
            except Exception as err:  # MLflow raises several types for an unknown run or artifact
                raise ConfkvError(f"cannot read MLflow run {args.run!r}: {str(err).splitlines()[0]}") from None
        elif args.artifact:
            source = Path(args.artifact)
            if not source.is_dir():
                raise ConfkvError(f"--artifact expects an exported policy folder: {source} is not a folder")
        else:
            source = Path(args.policy_file)
        info = reg.register(
            args.name, source, model=args.model or meta.get("model"), mlflow_run_id=args.run,
            optuna_study=meta.get("optuna_study"), optuna_trial=meta.get("optuna_trial"),
            parent=int(args.parent) if args.parent and args.parent.isdigit() else args.parent,
            description=args.description or meta.get("description"), artifact_store=args.artifact_store,
        )  # fmt: skip
        print(f"registered {info.ref} ({info.kind}, sha256 {info.sha256[:12]}) in {reg.url}", file=sys.stderr)
        if args.run and (source / "policy.json").is_file():  # a learned policy: also its MLflow model, as train logs
            _log_model_on_run(args.run, args.tracking_uri, source, f"registry://{info.ref}")
    print(info.version)
    return 0


def _log_model_on_run(run_id: str, tracking_uri: str | None, folder: Path, ref: str) -> None:
    """Log the learned policy registered from ``run_id`` as a pyfunc model of that run, linked to the version it
    became (what ``train`` does for the versions it registers itself). The run keeps its status and end time (MLflow
    marks a run it reopens FINISHED). The version stands whatever happens here, so a failure is a warning."""
    import mlflow

    from tuner.pyfunc import log_policy_model
    from tuner.tracking import DEFAULT_TRACKING_URI

    mlflow.set_tracking_uri(tracking_uri or DEFAULT_TRACKING_URI)
    client = mlflow.MlflowClient()

    def warn(err: Exception) -> None:
        print(f"confkv-tune: warning: {ref} was registered but its MLflow model was not logged on run {run_id}: "
              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)  # fmt: skip

    try:
        before = client.get_run(run_id).info
    except Exception as err:  # MLflow raises several types; the registry version is already there
        warn(err)
        return
    try:
        with mlflow.start_run(run_id=run_id):
            uri = log_policy_model(folder, ref)
    except Exception as err:
        warn(err)
        return
    finally:  # a failed log_model leaves the run FAILED, a reopened one FINISHED: either way, put its status back
        try:
            if before.status == "RUNNING":
                client.update_run(run_id, status="RUNNING")
            else:
                client.set_terminated(run_id, status=before.status, end_time=before.end_time)
        except Exception as err:
            warn(err)
    print(f"logged the MLflow model {uri} on run {run_id}, linked to {ref}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ policies
def cmd_policies(args: argparse.Namespace) -> int:
    return cmd_policies_list(args) if args.policies_command == "list" else cmd_policies_show(args)


def cmd_policies_list(args: argparse.Namespace) -> int:
    rows = _registry(args).list_policies()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    if not rows:
        print("no policies registered", file=sys.stderr)
        return 0
    width = max(4, *(len(r.name) for r in rows))
    print(f"{'name':<{width}}  versions  latest  aliases")
    for r in rows:
        aliases = ", ".join(f"{a} -> {v}" for a, v in r.aliases.items()) or "-"
        print(f"{r.name:<{width}}  {r.versions:>8}  {r.latest or '-':>6}  {aliases}")
    return 0


def _when(t: Any) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _lineage(reg: Any, info: Any) -> list[str]:
    chain = [info.ref]
    seen = {(info.policy, info.version)}
    parent = info.parent
    while parent is not None and parent not in seen and len(chain) < 50:
        seen.add(parent)
        chain.append(f"{parent[0]}@{parent[1]}")
        parent = reg.get_version(*parent).parent
    return chain


def _eval_line(e: Any) -> str:
    m = e.metrics
    parts = [f"v{e.version}", f"{e.workload}/{e.split}"]
    if e.reward is not None:
        parts.append(f"reward {e.reward:.4f}")
    if isinstance(m.get("kv_fraction"), (int, float)):
        parts.append(f"kv {100 * m['kv_fraction']:.1f}%")
    if isinstance(m.get("kl_mean"), (int, float)):
        parts.append(f"kl {m['kl_mean']:.4f}")
    if isinstance(m.get("passkey_acc"), (int, float)):
        parts.append(f"pass-key {100 * m['passkey_acc']:.0f}%")
    return "  ".join(parts) + f"  ({e.model or 'model ?'}, {_when(e.created_at)})"


def _move_line(m: Any) -> str:
    frm = "-" if m.from_version is None else m.from_version
    to = "-" if m.to_version is None else m.to_version
    reason = f"  {m.reason!r}" if m.reason else ""
    return f"{_when(m.at)}  {m.alias:<12} {m.action:<9} {frm} -> {to}  {m.who or '?'}{reason}"


def cmd_policies_show(args: argparse.Namespace) -> int:
    from store.names import split_ref
    from store.refs import is_registry_ref

    reg = _registry(args)
    spec = args.ref[len("registry://") :] if is_registry_ref(args.ref) else args.ref
    name, target = split_ref(spec)
    history = reg.history(name)
    if target is None:  # the policy: every version
        versions = reg.versions(name)
        evals = reg.evaluations(name)
        if args.json:
            print(json.dumps({"name": name, "versions": [v.as_dict() for v in versions],
                              "evaluations": [e.as_dict() for e in evals],
                              "alias_history": [m.as_dict() for m in history]}, indent=2))  # fmt: skip
            return 0
        print(f"policy {name}: {len(versions)} version(s)")
        for v in versions:
            aliases = f"  [{', '.join(v.aliases)}]" if v.aliases else ""
            print(f"  v{v.version:<4} {v.kind:<8} {v.parameters.get('controller', '?'):<9} {_when(v.created_at)}  "
                  f"model {v.model or '-'}{aliases}")  # fmt: skip
    else:
        v = reg.get_version(name, target)
        evals = reg.evaluations(name, v.version)
        lineage = _lineage(reg, v)
        if args.json:
            print(json.dumps({**v.as_dict(), "lineage": lineage, "evaluations": [e.as_dict() for e in evals],
                              "alias_history": [m.as_dict() for m in history]}, indent=2))  # fmt: skip
            return 0
        import yaml

        print(f"{v.ref}  ({v.kind}, controller {v.parameters.get('controller', '?')})")
        rows = [
            ("aliases", ", ".join(v.aliases) or "-"),
            ("created", f"{_when(v.created_at)} by {v.created_by or '?'}"),
            ("model", v.model or "-"),
            ("sha256", v.sha256),
            ("artifact", v.artifact_uri or "in the database"),
            ("mlflow run", v.mlflow_run_id or "-"),
            ("optuna", f"study {v.optuna_study}, trial {v.optuna_trial}" if v.optuna_study else "-"),
            ("lineage", " <- ".join(lineage)),
            ("description", v.description or "-"),
        ]
        for k, val in rows:
            print(f"  {k:<12} {val}")
        print("  parameters:")
        for line in yaml.safe_dump(v.parameters, sort_keys=True).splitlines():
            print(f"    {line}")
    print("evaluations:" if evals else "evaluations: none")
    for e in evals:
        print(f"  {_eval_line(e)}")
    print("alias history:" if history else "alias history: none")
    for m in history:
        print(f"  {_move_line(m)}")
    return 0


# ------------------------------------------------------------------------------------------------ promote, rollback
def cmd_promote(args: argparse.Namespace) -> int:
    from store.errors import PromotionRefused
    from store.names import parse_version_ref
    from store.registry import UNSET

    reg = _registry(args)
    version = parse_version_ref(args.version)
    reason = args.reason
    expected: Any = UNSET
    if args.check:
        from envs.env import RewardWeights
        from tuner.gate import run_gate

        weights = RewardWeights(args.memory_weight, args.quality_weight, args.task_weight)
        result = run_gate(reg, args.name, version, args.alias, args.check, model=args.model, seed=args.seed,
                          device=args.device, weights=weights)  # fmt: skip
        print(result.table())
        if not result.passed and not args.force:
            raise PromotionRefused(f"{result.verdict()}; not promoted (--force promotes anyway)")
        gate = f"gate on {args.check}/heldout: {result.verdict()}" + ("" if result.passed else " (forced)")
        reason = f"{reason}; {gate}" if reason else gate
        version = result.candidate.version
        expected = result.seen_version  # refuse if the alias moved while the check ran
    elif args.force:
        raise ConfkvError("--force only makes sense with --check")
    move = reg.set_alias(args.name, args.alias, version, reason=reason, expected=expected)
    if not move.changed:
        print(f"{args.name}@{args.alias} already points at version {move.to_version}", file=sys.stderr)
    else:
        frm = "nothing" if move.from_version is None else f"version {move.from_version}"
        print(f"{args.name}@{args.alias}: {frm} -> version {move.to_version}", file=sys.stderr)
    print(json.dumps(move.as_dict()))
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    move = _registry(args).rollback(args.name, args.alias, reason=args.reason)
    print(f"{args.name}@{args.alias}: version {move.from_version} -> version {move.to_version} (rollback)",
          file=sys.stderr)  # fmt: skip
    print(json.dumps(move.as_dict()))
    return 0


# ------------------------------------------------------------------------------------------------ export
def is_registry_target(spec: str) -> bool:
    """``export``'s argument names a registry version when it is ``registry://...`` or has an ``@``; otherwise it
    is an MLflow run id (the command's original meaning)."""
    from store.refs import is_registry_ref

    return is_registry_ref(spec) or "@" in spec


def export_registry(args: argparse.Namespace) -> int:
    from confkv.config import load_policy_file
    from store.refs import is_registry_ref, parse_ref

    name, target = parse_ref(args.run if is_registry_ref(args.run) else f"registry://{args.run}")
    path = _registry(args).export(name, target, args.out)
    load_policy_file(path)  # what was written must load as a policy file
    print(str(Path(args.out)))  # the folder (or YAML file) --policy-file takes, whatever kind of policy it holds
    return 0


def wrap_exit1(command: Any) -> Any:
    """The registry's refusals on valid input exit with 1 (``run_command`` maps other user errors to 2)."""
    from store.errors import NotFoundError, PromotionRefused

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (NotFoundError, PromotionRefused) as err:
            print(f"confkv-tune: error: {err}", file=sys.stderr)
            return 1

    return run
