"""Training wrappers for stable-baselines3 PPO and SAC on the vectorised environment, with presets that say how
long a run trains.

A PPO *update* is one rollout of ``n_steps`` segments in each of ``n_envs`` episodes followed by ``n_epochs``
passes of minibatch gradient steps over it; a run of ``timesteps`` makes ``ceil(timesteps / (n_steps * n_envs))``
updates (SB3 finishes the last rollout, so it may step a little past ``timesteps``). The quick preset makes 32
updates of 64 segments (4 episodes x 16), each 10 epochs of 2 minibatches of 32: 640 gradient steps.
``log_std_init=-1`` starts the Gaussian policy at a standard deviation of 0.37 around its mean; with the knob map
centred on the base policy (``confkv.controllers.learned.KnobSpace``) and the mean's output layer starting at zero, an
untrained agent is exactly the base policy plus moderate exploration, not a uniform draw over the whole box.

Learning curves: SB3's own logger (``rollout/ep_rew_mean``, ``train/approx_kl``, ``train/loss`` ... per update,
at the timestep reached) goes to ``log_metrics``; every finished episode to ``on_episode``; and every
``eval_every`` updates (and before the first and after the last) the deterministic policy, the one that is
exported, is run once over every training episode by ``evaluate`` and its figures go to ``on_eval``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from stable_baselines3 import PPO, SAC
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import KVWriter, Logger
from stable_baselines3.common.utils import LinearSchedule
from stable_baselines3.common.vec_env import VecEnv

from confkv.progress import Stage

ALGOS = ("ppo", "sac")
LR_SCHEDULES = ("constant", "linear")
#: The best evaluation of a run: its reward, the updates made before it, and the policy's weights then.
Best = tuple[float, int, dict[str, Any]]


@dataclass(frozen=True)
class Preset:
    """How long and how a run trains; every field can be overridden on the command line."""

    name: str
    timesteps: int
    n_envs: int
    n_steps: int  # PPO: segments per episode slot per rollout
    batch_size: int
    n_epochs: int  # PPO: passes over each rollout
    learning_rate: float = 3e-4
    #: ``constant``, or ``linear``: the learning rate falls in a straight line from ``learning_rate`` at the first
    #: update to zero at the last (SB3's ``progress_remaining``), so late updates move a policy that has found its
    #: behaviour in ever smaller steps instead of on past it (``--lr-schedule``)
    lr_schedule: str = "constant"
    log_std_init: float = -1.0
    eval_every: int = 8  # updates (PPO) or ``eval_every * n_steps * n_envs`` timesteps (SAC) between evaluations
    learning_starts: int = 128  # SAC: steps of uniformly random actions before the first gradient step
    #: Discount of later segments' rewards (SB3's default). A knobs action governs its own segment (the replay
    #: rule), so a lower value credits it mostly with that segment, but also discounts a retrieval answer's reward,
    #: which comes at the episode's end, some 14 segments after the haystack's first decisions
    gamma: float = 0.99
    #: Entropy bonus: None is SB3's default (PPO 0.0; SAC "auto", which starts its coefficient at 1.0, large
    #: against relative rewards of a few hundredths per segment; "auto_0.01" starts it at 0.01)
    ent_coef: float | str | None = None
    relative_reward: bool = False  # train on rewards relative to the base policy's (``--relative-reward``)
    #: Share of the training items held out to choose the exported checkpoint (``--validation-fraction``; 0: the
    #: evaluations run on the episodes trained on)
    validation_fraction: float = 0.0


PRESETS: dict[str, Preset] = {
    # 32 updates of 64 segments; the mixed workload's 10 training episodes average about 11 segments (smollm2 sizes),
    # so a run sees about 190 episodes
    "quick": Preset("quick", timesteps=2048, n_envs=4, n_steps=16, batch_size=32, n_epochs=10),
    # four times the quick run's experience in larger rollouts: 32 updates of 256 segments
    "standard": Preset("standard", timesteps=8192, n_envs=8, n_steps=32, batch_size=64, n_epochs=10),
    # the quick schedule for refining a tuned policy (``--init-policy``): a narrow start (0.08 in action units),
    # a third of the step size and rewards relative to the tuned policy's, so that training moves a policy that is
    # already tuned in small steps (the runs that chose these settings: docs/history/2026-12-05-tuning.md)
    "refine": Preset(
        "refine",
        timesteps=2048,
        n_envs=4,
        n_steps=16,
        batch_size=32,
        n_epochs=10,
        learning_rate=1e-4,
        log_std_init=-2.5,
        relative_reward=True,
    ),
}


def schedule(algo: str, timesteps: int, n_envs: int, preset: Preset) -> dict[str, int]:
    """How many updates (and gradient steps) a run of ``timesteps`` makes: what the run prints and logs."""
    if algo == "ppo":
        rollout = preset.n_steps * n_envs
        updates = math.ceil(timesteps / rollout)
        minibatches = math.ceil(rollout / preset.batch_size)
        grads = updates * preset.n_epochs * minibatches
        return {"updates": updates, "rollout_steps": rollout, "minibatches": minibatches, "gradient_steps": grads,
                "timesteps_run": updates * rollout}  # fmt: skip
    starts = min(preset.learning_starts, timesteps // 4)
    steps = math.ceil(max(0, timesteps - starts) / n_envs)  # one gradient step per vectorised step
    return {"updates": steps, "rollout_steps": n_envs, "minibatches": 1, "gradient_steps": steps,
            "timesteps_run": math.ceil(timesteps / n_envs) * n_envs, "learning_starts": starts}  # fmt: skip


def describe(algo: str, timesteps: int, n_envs: int, preset: Preset) -> str:
    s = schedule(algo, timesteps, n_envs, preset)
    if algo == "ppo":
        return (f"ppo ({preset.name} preset): {timesteps} timesteps = {s['updates']} updates of {s['rollout_steps']} "
                f"segments ({n_envs} episodes x {preset.n_steps}), each {preset.n_epochs} epochs x {s['minibatches']} "
                f"minibatches of {preset.batch_size}: {s['gradient_steps']} gradient steps")  # fmt: skip
    return (f"sac ({preset.name} preset): {timesteps} timesteps over {n_envs} episodes, {s['learning_starts']} "
            f"random first, then one gradient step (batch {preset.batch_size}) per step: {s['gradient_steps']} "
            "updates")  # fmt: skip


class _MetricsOutput(KVWriter):
    """SB3's logger as learning curves: every numeric value it records, at the timestep it dumps at."""

    def __init__(self, sink: Callable[[dict[str, float], int], None]) -> None:
        self.sink = sink

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0) -> None:
        metrics = {
            k: float(v)
            for k, v in key_values.items()
            if isinstance(v, (int, float, np.number))
            and not isinstance(v, bool)
            and "mlflow" not in (key_excluded.get(k) or ())
        }
        if metrics:
            self.sink(metrics, step)

    def close(self) -> None:
        pass


class _Progress(BaseCallback):
    """Episodes to ``on_episode``; the deterministic policy's evaluation every ``eval_every`` updates to
    ``on_eval`` (also before the first update and after the last)."""

    def __init__(
        self,
        on_episode: Callable[[int, dict[str, Any]], None] | None,
        evaluate: Callable[[Callable[[np.ndarray], Any]], dict[str, Any]] | None,
        on_eval: Callable[[int, int, dict[str, Any]], None] | None,
        eval_every: int,
        rollouts_per_update: int = 1,
        progress: Stage | None = None,
        on_best: Callable[[BaseAlgorithm], None] | None = None,
        on_checkpoint: Callable[[BaseAlgorithm, Best | None], None] | None = None,
        best: Best | None = None,
    ) -> None:
        super().__init__()
        self.progress = progress
        self.on_best = on_best
        self.on_checkpoint = on_checkpoint
        self.on_episode = on_episode
        self.evaluate = evaluate
        self.on_eval = on_eval
        self.eval_every = max(1, eval_every)
        self.rollouts_per_update = rollouts_per_update
        self.rollouts = 0
        self.episodes = 0
        self.last_eval = -1
        #: The best evaluation so far: (reward, updates, a copy of the policy's weights then); a resumed run starts
        #: from the best of the run it continues.
        self.best: Best | None = best

    def _act(self, obs: np.ndarray) -> Any:
        return self.model.predict(obs, deterministic=True)[0]

    def _eval(self) -> None:
        done = self.rollouts // self.rollouts_per_update  # what the schedule counts: one evaluation per value
        if self.evaluate is None or done == self.last_eval:
            return
        self.last_eval = done
        # labelled in the unit the run's schedule states: PPO updates, SAC gradient steps
        updates = self.model._n_updates if isinstance(self.model, SAC) else done
        metrics = self.evaluate(self._act)
        if self.best is None or metrics["reward"] > self.best[0]:
            self.best = (float(metrics["reward"]), updates, copy.deepcopy(self.model.policy.state_dict()))
            if self.on_best:
                self.on_best(self.model)
        if self.on_eval:
            self.on_eval(self.num_timesteps, updates, metrics)
        if self.on_checkpoint:
            self.on_checkpoint(self.model, self.best)

    def _on_training_start(self) -> None:
        self._eval()

    def _on_rollout_start(self) -> None:
        # a rollout starts after the previous one's update
        if self.rollouts and (self.rollouts // self.rollouts_per_update) % self.eval_every == 0:
            self._eval()

    def _on_rollout_end(self) -> None:
        self.rollouts += 1

    def _on_step(self) -> bool:
        if self.progress is not None:
            self.progress.set(self.num_timesteps)
        for info in self.locals.get("infos", []):
            if "summary" in info:
                self.episodes += 1
                if self.on_episode:
                    self.on_episode(self.num_timesteps, info["summary"])
        return True

    def _on_training_end(self) -> None:
        self._eval()


def train_sb3(
    algo: str,
    env: VecEnv,
    timesteps: int,
    *,
    preset: Preset | None = None,
    seed: int = 0,
    on_episode: Callable[[int, dict[str, Any]], None] | None = None,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
    evaluate: Callable[[Callable[[np.ndarray], Any]], dict[str, Any]] | None = None,
    on_eval: Callable[[int, int, dict[str, Any]], None] | None = None,
    progress: Stage | None = None,
    keep: str = "best",
    on_select: Callable[[int, float], None] | None = None,
    on_best: Callable[[BaseAlgorithm], None] | None = None,
    on_checkpoint: Callable[[BaseAlgorithm, Best | None], None] | None = None,
    resume: str | Path | None = None,
    best: Best | None = None,
    before_learn: Callable[[BaseAlgorithm], None] | None = None,
    **hyper: Any,
) -> BaseAlgorithm:
    """Train ``algo`` for ``timesteps`` environment steps (segments) with ``preset``'s settings (default quick;
    ``hyper`` passes anything else to the SB3 class). Small networks: the observation is 14 numbers.

    ``progress``: a ``confkv.progress`` stage counting the timesteps (SB3's own bar draws on terminals only).
    ``keep`` "best" returns the policy as it was at its best evaluation on the training episodes (PPO's reward
    is not monotone in updates; the untrained, base-centred policy counts too), "last" as training left it.
    ``on_select(updates, reward)`` says which evaluation the returned policy is (not called for "last", nor
    without ``evaluate``).

    Stopping is planned for: ``on_best(model)`` runs at every evaluation that beats the best so far (the model then
    holds that policy: export it), ``on_checkpoint(model, best)`` after every evaluation and when training stops
    on an exception or an interrupt (save the model and the best weights). ``resume`` (a file ``model.save`` wrote)
    continues that model for ``timesteps`` more, its timestep count going on from where it stopped, with ``best``
    (the best of the earlier part) as the best so far. SAC's replay buffer is not saved: a resumed SAC run refills
    it. ``before_learn(model)`` runs on a new model before its first evaluation (``tuner.imitate``: start from a
    copy of a teacher network)."""
    if keep not in ("best", "last"):
        raise ValueError(f"keep must be best or last (got {keep!r})")
    p = preset or PRESETS["quick"]
    if p.ent_coef is not None:
        hyper.setdefault("ent_coef", p.ent_coef)
    continuous = env.action_space.__class__.__name__ == "Box"
    policy_kwargs: dict[str, Any] = {"net_arch": [64, 64]}
    if resume is not None:
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS} (got {algo!r})")
        cls = PPO if algo == "ppo" else SAC
        model: BaseAlgorithm = cls.load(str(resume), env=env, device="cpu")
        per_update = 1 if algo == "ppo" else p.n_steps
    elif algo == "ppo":
        if continuous:
            policy_kwargs["log_std_init"] = p.log_std_init
        model = PPO(
            "MlpPolicy", env, n_steps=p.n_steps, batch_size=p.batch_size, n_epochs=p.n_epochs,
            learning_rate=learning_rate_of(p), gamma=p.gamma, seed=seed, policy_kwargs=policy_kwargs, device="cpu",
            verbose=0, **hyper,
        )  # fmt: skip
        per_update = 1
    elif algo == "sac":
        if not continuous:
            raise ValueError("SAC needs the continuous (knobs) action")
        policy_kwargs["log_std_init"] = p.log_std_init
        model = SAC(
            "MlpPolicy", env, learning_starts=min(p.learning_starts, timesteps // 4), batch_size=p.batch_size,
            learning_rate=learning_rate_of(p), gamma=p.gamma, seed=seed, policy_kwargs=policy_kwargs, device="cpu",
            verbose=0, **hyper,
        )  # fmt: skip
        per_update = p.n_steps  # SAC collects one vectorised step per "rollout": evaluate every n_steps * eval_every
    else:
        raise ValueError(f"algo must be one of {ALGOS} (got {algo!r})")
    if continuous and resume is None:
        _start_at_the_centre(model)
    if before_learn is not None and resume is None:
        before_learn(model)
    if log_metrics is not None:
        model.set_logger(Logger(folder=None, output_formats=[_MetricsOutput(log_metrics)]))
    callback = _Progress(on_episode, evaluate, on_eval, p.eval_every, per_update, progress, on_best, on_checkpoint,
                         best)  # fmt: skip
    log_interval = 1 if algo == "ppo" else 4  # SAC: every 4 episodes
    try:
        model.learn(total_timesteps=timesteps, callback=callback, progress_bar=False, log_interval=log_interval,
                    reset_num_timesteps=resume is None)  # fmt: skip
    except BaseException:
        if on_checkpoint is not None:
            on_checkpoint(model, callback.best)
        raise
    if keep == "best" and callback.best is not None:
        reward, updates, weights = callback.best
        model.policy.load_state_dict(weights)
        if on_select:
            on_select(updates, reward)
    return model


def learning_rate_of(preset: Preset) -> float | LinearSchedule:
    """The learning rate as SB3 takes it: a number, or for ``linear`` a schedule of ``progress_remaining`` (1 at the
    start, 0 when ``timesteps`` are done) that SB3 applies to every optimiser before each update; a PPO run of N
    updates thus makes update k at ``learning_rate x (1 - k/N)``, its last at zero. A resumed run keeps the schedule
    its saved model holds, over the whole run's timesteps."""
    if preset.lr_schedule == "constant":
        return preset.learning_rate
    if preset.lr_schedule == "linear":
        return LinearSchedule(preset.learning_rate, 0.0, 1.0)
    raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES} (got {preset.lr_schedule!r})")


def _start_at_the_centre(model: BaseAlgorithm) -> None:
    """Zero the layer that outputs the action's mean, so the untrained deterministic policy is exactly the action 0
    (the base policy, or ``--init-policy``) and exploration is spread around it. Left random, its small weights put
    the start near it, not at it."""
    head = model.policy.action_net if isinstance(model, PPO) else model.actor.mu
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()


def preset_params(preset: Preset) -> dict[str, Any]:
    """A preset as run parameters (``preset_*``)."""
    return {f"preset_{k}": v for k, v in asdict(preset).items()}
