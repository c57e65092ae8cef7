"""``confkv-tune train --algo ppo|sac``: the preset as the flags change it, a warm start from a tuned policy, and
the training run itself (learning curves to MLflow, the chosen checkpoint exported as a learned policy).

A run can stop and go on: every evaluation that beats the best so far exports that policy to ``OUT/policy``, and
every evaluation (and an interrupt or an error) saves ``OUT/<algo>_sb3.zip`` (the model as it is),
``OUT/best_policy.pt`` (the best evaluation's weights) and ``OUT/checkpoint.json`` (timesteps done, the best
reward); ``--resume`` loads them and trains the timesteps that are left."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from confkv.config import CachePolicy, load_policy_file
from confkv.errors import ConfkvError
from confkv.progress import stage
from tuner.options import check_finite, resolve_policy_arg
from tuner.plots import learning_curve


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


def preset_of(args: argparse.Namespace) -> Any:
    import dataclasses

    from agents.sb3 import PRESETS

    changes = {k: getattr(args, k) for k in ("n_steps", "batch_size", "n_epochs", "learning_rate", "eval_every",
                                             "log_std_init", "gamma", "learning_starts", "ent_coef")
               if getattr(args, k) is not None}  # fmt: skip
    if args.n_envs is not None:
        changes["n_envs"] = args.n_envs
    for name in ("learning_rate", "log_std_init", "gamma"):
        check_finite("--" + name.replace("_", "-"), changes.get(name))
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
    if args.lr_schedule is not None:
        changes["lr_schedule"] = args.lr_schedule  # a name (the parser's choices), not a number to check
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


def warm_start(args: argparse.Namespace, data: Any, scorers: list[str]) -> dict[str, Any]:
    """Centre the agent's space on ``--init-policy``'s knobs, keeping the bounds searched around the tuned base, so
    the untrained agent is that policy (typically an Optuna run's best); with ``--keep best`` the export is never
    below it on the training episodes (held-out items may still differ). Returns the run parameters it sets."""
    from confkv.controllers.learned import KNOB_NAMES

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


def teacher_network(args: argparse.Namespace, obs_version: int) -> Any:
    """``--init-network``'s budget network, checked against the run before the model loads."""
    from confkv.controllers.learned import MLPPolicy

    try:
        teacher = MLPPolicy.load(args.init_network)
    except (OSError, ValueError, ConfkvError) as err:
        raise ConfkvError(f"--init-network: cannot load a budget network from {args.init_network}: {err}") from None
    if teacher.action != "budget":
        raise ConfkvError(f"--init-network must be a budget network (got a {teacher.action} network)")
    if teacher.obs_version != obs_version:
        raise ConfkvError(f"--init-network reads observation layout {teacher.obs_version}; this run observes layout "
                          f"{obs_version} (--observation)")  # fmt: skip
    return teacher


def _imitation(args: argparse.Namespace, data: Any, weights: Any, log_metrics: Any) -> Any:
    """The ``before_learn`` that copies ``--init-network`` into a new PPO model (``tuner.imitate``)."""
    from tuner.imitate import demonstrate, imitate

    teacher = teacher_network(args, data.obs_version)
    demo = demonstrate(data, teacher, weights, args.preset_obj.gamma)

    def before_learn(model: Any) -> None:
        fit = imitate(model, demo)
        log_metrics(fit)
        print(f"  imitation of {args.init_network}: {int(fit['imitation_samples'])} decisions, agreement "
              f"{100 * fit['imitation_agreement']:.1f}%, policy entropy {fit['imitation_entropy']:.3f}, value "
              f"explained variance {fit['imitation_value_explained_variance']:.3f}", file=sys.stderr)  # fmt: skip

    return before_learn


CHECKPOINT = "checkpoint.json"
BEST_WEIGHTS = "best_policy.pt"


def checkpoint_of(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """What ``--resume`` continues from in ``out``: checked before the model loads, so a resume that cannot work
    (no checkpoint, another algorithm or action, nothing left to train) fails at once."""
    path = out / CHECKPOINT
    model = out / f"{args.algo}_sb3.zip"
    if not path.is_file() or not model.is_file():
        raise ConfkvError(f"--resume: no {args.algo} checkpoint in {out} ({path.name} and {model.name}); run without "
                          "--resume to start")  # fmt: skip
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfkvError(f"--resume: cannot read {path}: {err}") from None
    for key in ("algo", "action", "mode", "observation"):
        if state.get(key, "segment" if key == "observation" else None) != getattr(args, key):
            raise ConfkvError(f"--resume: {out} holds a run with --{key} {state.get(key)}, not {getattr(args, key)}")
    if state.get("timesteps", 0) >= args.timesteps:
        raise ConfkvError(f"--resume: the run in {out} already made {state['timesteps']} of {args.timesteps} "
                          "timesteps; raise --timesteps to train on")  # fmt: skip
    return state


def train_rl(
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
    shaping = getattr(args, "shaping", None)  # the training environment's only: evaluations build their own
    if shaping is not None:
        print(f"  training reward shaped: gamma x Phi(next) - Phi(now), Phi = {shaping.weight:g} x headroom, gamma "
              f"{shaping.gamma:g} (evaluations and the export keep the plain reward)", file=sys.stderr)  # fmt: skip
    if args.mode == "decode":
        from stable_baselines3.common.vec_env import DummyVecEnv

        from envs.decode_env import ConfKVDecodeEnv

        env = DummyVecEnv([lambda: ConfKVDecodeEnv(data, args.action, weights, shaping)])
        env.seed(args.seed)
    else:
        reference = None
        if args.relative_reward:
            reference = reference_rewards(data, args.action, weights)
            mean = sum(map(sum, reference.values())) / len(reference)
            log_metrics({"reference_reward": mean})
            print(f"  rewards relative to the base policy's (its mean episode reward {mean:.3f})", file=sys.stderr)
        env = ConfKVVecEnv(data, args.n_envs, args.action, weights, seed=args.seed, reference=reference,
                           shaping=shaping)  # fmt: skip
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

    def export(model: Any) -> None:
        trained = {"workload": args.workload, "model": args.model, "learning_rate": args.preset_obj.learning_rate,
                   "lr_schedule": args.preset_obj.lr_schedule}  # fmt: skip
        export_sb3(model, args.action, policy_dir, data.base_policy, trained,
                   space=data.knob_space() if args.action == "knobs" else None,
                   obs_version=data.obs_version)  # fmt: skip

    def on_checkpoint(model: Any, best: Any) -> None:
        """The model as it is now and the best weights so far, for ``--resume`` (also after an interrupt)."""
        import torch

        model.save(out / f"{args.algo}_sb3.zip")
        if best is not None:
            torch.save(best[2], out / BEST_WEIGHTS)
        state = {"algo": args.algo, "action": args.action, "mode": args.mode, "observation": args.observation,
                 "timesteps": int(model.num_timesteps),
                 "target_timesteps": args.timesteps, "best_reward": None if best is None else best[0],
                 "best_updates": None if best is None else best[1], "run_id": args.run_id}  # fmt: skip
        (out / CHECKPOINT).write_text(json.dumps(state, indent=2))

    before_learn = None
    if args.init_network is not None:
        before_learn = _imitation(args, data, weights, log_metrics)
    resume = best = None
    timesteps = args.timesteps
    if args.resume:
        import torch

        state = checkpoint_of(args, out)
        resume = out / f"{args.algo}_sb3.zip"
        timesteps = args.timesteps - int(state["timesteps"])
        weights_file = out / BEST_WEIGHTS
        if state.get("best_reward") is not None and weights_file.is_file():
            best = (float(state["best_reward"]), int(state["best_updates"]), torch.load(weights_file))
        print(f"  resuming from {resume.name} at {state['timesteps']} timesteps (best reward so far "
              f"{state.get('best_reward')}); {timesteps} timesteps left", file=sys.stderr)  # fmt: skip
    with stage(args.algo, total=args.timesteps, unit="timesteps") as progress:
        progress.set(args.timesteps - timesteps)
        model = train_sb3(args.algo, env, timesteps, preset=args.preset_obj, seed=args.seed, on_episode=on_episode,
                          log_metrics=lambda metrics, step: log_metrics(metrics, step=step), evaluate=evaluate,
                          on_eval=on_eval, progress=progress, keep=args.keep, on_select=on_select, on_best=export,
                          on_checkpoint=on_checkpoint, resume=resume, best=best,
                          before_learn=before_learn)  # fmt: skip
    env.close()
    export(model)
    on_checkpoint(model, None)
    (out / BEST_WEIGHTS).unlink(missing_ok=True)
    held = judge is not data
    learning_curve(
        out, f"{args.algo} on {args.workload} ({args.model})", episodes, evals, default_reward,
        evaluated_on=f"{len(judge.episodes)} validation episodes" if held else "all training episodes",
        baseline="base policy, validation episodes" if held else "default rule",
    )  # fmt: skip
    return load_policy_file(policy_dir)
