"""``confkv-tune``: learn the CONF-KV policy, evaluate it on held-out items, compare, register, promote, export.

    confkv-tune train --algo {ppo,sac,optuna} --model M [--workload mixed] [--preset quick|standard|refine]
                      [--timesteps N | --trials N] [--scorer NAME[,NAME...]] --out DIR
                      [--register-as NAME | --no-register] [--resume]
    confkv-tune eval POLICY --workload NAME --split heldout
    confkv-tune compare --policy optuna=DIR/policy.yaml --policy ppo=DIR2/policy --out DIR3
    confkv-tune register NAME (--policy-file F | --artifact DIR | --run RUN_ID)
    confkv-tune policies list | policies show NAME[@VERSION|@ALIAS]
    confkv-tune promote NAME VERSION [--alias production] [--reason TEXT] [--check WORKLOAD] [--force]
    confkv-tune rollback NAME [--alias production]
    confkv-tune export NAME@ALIAS|NAME@VERSION|RUN_ID|FOLDER --out PATH
    confkv-tune probe --model M [--workloads prose,chat,longgen,passkey] [--items 12] --out DIR
    confkv-tune demo --model M --policy-file OUT/policy [--summary OUT/summary.json] [--out OUT/demo.json]

POLICY is a YAML policy file, an exported policy folder, a ``registry://NAME@ALIAS`` reference, a built-in policy
name, ``default`` (the requirement's dynamic rule, sized for the episodes) or ``calibrated`` (that rule with the
model's calibrated thresholds, ``confkv calibrate``). ``train``, ``eval`` and ``compare`` are each an MLflow run of
the experiment ``confkv-tune`` (``--no-mlflow`` for eval/compare), tagged with the git commit. ``train`` registers
its result as a new version (no alias) in the policy registry (``store``; see ``tuner.registry_cli``). ``export``
copies a policy folder or file on disk, reads the registry when its argument has an ``@`` (or is ``registry://...``),
and an MLflow run's exported policy otherwise; it writes what ``confkv generate --policy-file OUT`` loads.
A training stopped by Ctrl-C or SIGTERM ends its MLflow run KILLED (an error: FAILED) with the best policy so far in
``OUT/policy``; ``train ... --resume`` goes on with it. Long work reports progress on stderr (``confkv.progress``).
User errors print one line on stderr and exit with 2; the registry's refusals (a missing version, a promotion
the gate refuses) exit with 1; an interrupt 130 (SIGTERM 143).

This module holds the parser and the dispatch; the commands live in ``tuner.train`` (with ``tuner.train_rl``),
``tuner.review`` (eval, compare, export; ``tuner.explain`` words the reward), ``tuner.demo`` and
``tuner.registry_cli``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from confkv.cli_args import package_version
from confkv.errors import ConfkvError
from tuner.demo import add_demo_command, cmd_demo
from tuner.probe import add_probe_command, cmd_probe
from tuner.review import cmd_compare, cmd_eval, cmd_export
from tuner.train import DEFAULT_TRIALS, cmd_train

#: ``agents.sb3.PRESETS``' names (not imported here: the parser must not load stable-baselines3).
PRESET_NAMES = ("quick", "standard", "refine")


def _common(p: argparse.ArgumentParser) -> None:
    from envs.episodes import TUNE_WORKLOADS  # the list ``tune_data`` checks against, so the help cannot fall behind

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
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
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
    train.add_argument("--lr-schedule", choices=["constant", "linear"], default=None, help="ppo/sac: keep the "
                       "learning rate (default the preset's, constant) or decay it linearly to zero over the run "
                       "(SB3's progress_remaining), so late updates take ever smaller steps")  # fmt: skip
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
        "--init-network", default=None, metavar="DIR",
        help="ppo --action budget: before RL, fit the agent to this exported budget network's decisions on the "
        "training episodes (behaviour cloning; its value function to that network's returns), so the result is "
        "learned by imitation, then RL (e.g. a hand rule from benchmarks/rule_network.py)",
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
        "--shaping-headroom", type=float, default=None, metavar="K",
        help="ppo/sac: while training, add potential-based shaping gamma x Phi(next) - Phi(now) to each segment's "
        "reward, Phi = K x the budget's headroom (its distance below the top of the budget range, as a share of "
        "the range) and gamma the agent's --gamma: a contraction is paid at once for the room it leaves, an "
        "expansion charged at once (Ng et al. 1999); evaluations, exports and compare keep the plain reward",
    )  # fmt: skip
    train.add_argument(
        "--mode", choices=["teacher", "decode"], default="teacher",
        help="episodes scored teacher-forced (fast, KL reward) or decoded freely (divergence reward)",
    )  # fmt: skip
    train.add_argument(
        "--observation", choices=["segment", "history"], default="segment",
        help="ppo/sac: what the agent observes: the latest segment's signals and context (14 entries, the layout "
        "of earlier exports) or those plus the last four segments' mean entropy, gap and top-1 and their trend (20: "
        "what `confkv-tune probe` found informative); the export records which",
    )  # fmt: skip
    train.add_argument("--objectives", choices=["reward", "pareto"], default="reward", help="optuna objective(s)")
    train.add_argument("--storage", default=None, help="optuna storage URL (default sqlite:///OUT/optuna.db)")
    train.add_argument("--study", default=None, help="optuna study name (default confkv-<model>-<workload>)")
    train.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///mlflow.db)")
    train.add_argument("--out", required=True)
    train.add_argument(
        "--resume", action="store_true",
        help="go on with the stopped run in --out: optuna runs the trials left of --trials; ppo/sac load "
        "OUT/<algo>_sb3.zip and train the timesteps left (the best policy so far is in OUT/policy either way)",
    )  # fmt: skip
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
        metavar="NAME@ALIAS|NAME@VERSION|RUN_ID|FOLDER",
        help="an exported policy folder or YAML file on disk, a registry version (anything with '@', or "
        "registry://...), else an MLflow run id",
    )
    ex.add_argument("--out", required=True, help="folder (holds policy.yaml; any policy) or YAML file (rule policies): "
                    "what `confkv generate --policy-file OUT` loads")  # fmt: skip
    ex.add_argument("--tracking-uri", default=None)
    ex.add_argument("--registry-url", default=None, help="policy registry (default $CONFKV_REGISTRY_URL or the "
                    "SQLite file ~/.local/share/confkv/registry.db)")  # fmt: skip

    add_demo_command(sub)
    add_probe_command(sub)
    from tuner.registry_cli import add_registry_commands

    add_registry_commands(sub)
    return parser


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
        "train": cmd_train, "eval": cmd_eval, "compare": cmd_compare, "demo": cmd_demo, "probe": cmd_probe,
        "export": rc.wrap_exit1(cmd_export),
        "register": rc.wrap_exit1(rc.cmd_register), "policies": rc.wrap_exit1(rc.cmd_policies),
        "promote": rc.wrap_exit1(rc.cmd_promote), "rollback": rc.wrap_exit1(rc.cmd_rollback),
    }  # fmt: skip
    # OSError: a path that cannot be read or written, reported as one line when no earlier check caught it
    command = _mlflow_errors_are_user_errors(commands[args.command])
    return run_command("confkv-tune", command, args, user_errors=(ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
