"""Export a trained stable-baselines3 agent to confkv's torch-only learned-policy folder.

The deterministic action of PPO is its action head applied to the policy branch of the MLP extractor; SAC's is
``tanh`` of its mean head over the actor's latent network. Both are plain linear layers with activations, which
``confkv.controllers.learned.MLPPolicy`` stores as safetensors plus a JSON description and runs inside the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from stable_baselines3 import PPO, SAC
from stable_baselines3.common.base_class import BaseAlgorithm

from confkv.config import CachePolicy
from confkv.controllers.learned import KnobSpace, MLPPolicy
from confkv.controllers.observation import OBS_VERSION


def _linear_stack(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    layers: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            layers.append((m.weight.detach().clone(), m.bias.detach().clone(), "none"))
        elif layers and isinstance(m, (torch.nn.Tanh, torch.nn.ReLU)):
            w, b, _ = layers[-1]
            layers[-1] = (w, b, "tanh" if isinstance(m, torch.nn.Tanh) else "relu")
    return layers


def to_mlp(model: BaseAlgorithm, action: str) -> MLPPolicy:
    if isinstance(model, PPO):
        layers = _linear_stack(model.policy.mlp_extractor.policy_net) + _linear_stack(model.policy.action_net)
        return MLPPolicy(layers, action, {"algo": "ppo"})
    if isinstance(model, SAC):
        layers = _linear_stack(model.actor.latent_pi) + _linear_stack(model.actor.mu)
        return MLPPolicy(layers, action, {"algo": "sac", "squash": "tanh"})
    raise ValueError(f"cannot export {type(model).__name__}")


def export_sb3(
    model: BaseAlgorithm,
    action: str,
    out: str | Path,
    base_policy: CachePolicy,
    extra: dict[str, Any] | None = None,
    space: KnobSpace | None = None,
    obs_version: int = OBS_VERSION,
) -> Path:
    """``space``: the knob space the agent acted in, when it is not the one centred on ``base_policy`` with that
    policy's own bounds (a warm-started agent's); ``obs_version``: the observation layout it was trained on."""
    mlp = to_mlp(model, action)
    mlp.obs_version = obs_version
    if action == "knobs":
        mlp.space = space
    return mlp.save(out, base_policy, extra)
