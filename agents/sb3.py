"""Training wrappers for stable-baselines3 PPO and SAC on the vectorised environment."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stable_baselines3 import PPO, SAC
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv

ALGOS = ("ppo", "sac")


class _EpisodeLogger(BaseCallback):
    """Forwards each finished episode's summary (reward, resident fraction, KL, task) to ``on_episode``."""

    def __init__(self, on_episode: Callable[[int, dict[str, Any]], None]) -> None:
        super().__init__()
        self.on_episode = on_episode
        self.episodes = 0

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            if "summary" in info:
                self.episodes += 1
                self.on_episode(self.num_timesteps, info["summary"])
        return True


def train_sb3(
    algo: str,
    env: VecEnv,
    timesteps: int,
    *,
    seed: int = 0,
    on_episode: Callable[[int, dict[str, Any]], None] | None = None,
    progress: bool = False,
    **hyper: Any,
) -> BaseAlgorithm:
    """Train ``algo`` for ``timesteps`` environment steps (segments). Small networks: the observation is 14 numbers."""
    policy_kwargs = {"net_arch": [64, 64]}
    if algo == "ppo":
        n_steps = hyper.pop("n_steps", max(8, min(128, timesteps // max(1, env.num_envs) // 2)))
        model: BaseAlgorithm = PPO(
            "MlpPolicy", env, n_steps=n_steps, batch_size=hyper.pop("batch_size", min(64, n_steps * env.num_envs)),
            n_epochs=hyper.pop("n_epochs", 5), learning_rate=hyper.pop("learning_rate", 3e-4), seed=seed,
            policy_kwargs=policy_kwargs, device="cpu", verbose=0, **hyper,
        )  # fmt: skip
    elif algo == "sac":
        if env.action_space.__class__.__name__ != "Box":
            raise ValueError("SAC needs the continuous (knobs) action")
        model = SAC(
            "MlpPolicy", env, learning_starts=hyper.pop("learning_starts", min(100, timesteps // 4)),
            batch_size=hyper.pop("batch_size", 64), seed=seed, policy_kwargs=policy_kwargs, device="cpu",
            verbose=0, **hyper,
        )  # fmt: skip
    else:
        raise ValueError(f"algo must be one of {ALGOS} (got {algo!r})")
    callback = _EpisodeLogger(on_episode) if on_episode else None
    model.learn(total_timesteps=timesteps, callback=callback, progress_bar=progress)
    return model
