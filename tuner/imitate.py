"""Start a PPO budget agent as a copy of a given budget network, for RL to fine-tune (``--init-network``).

On ``passkey-varied`` PPO from scratch collapses to expanding at every decision (TUNING.md): one decision per
episode, the one after the question, swings the reward by about 17, and the advantages of the other decisions,
a few tenths, are lost beside it. A hand rule that reads the question (``benchmarks/rule_network.py``) is far
ahead. Starting PPO from that rule's behaviour (its policy fitted to the rule's decisions on the training
episodes by cross-entropy, its value function to the rule's discounted returns, so that the first advantages
measure departures from the rule rather than the value function's errors) makes the result *learned by
imitation, then RL*, never RL from scratch: the run records the teacher and how well the copy matches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from stable_baselines3 import PPO

from confkv.controllers.learned import MLPPolicy
from envs.env import RewardWeights
from envs.episodes import TuneData
from envs.evaluate import play_episodes


@dataclass
class Demonstrations:
    """The teacher's observations, actions and discounted returns-to-go over the training episodes."""

    obs: np.ndarray
    actions: np.ndarray
    returns: np.ndarray


def demonstrate(data: TuneData, teacher: MLPPolicy, weights: RewardWeights, gamma: float) -> Demonstrations:
    """Play ``teacher`` once over every training episode in the environment the agent trains in."""
    runs = play_episodes(data, lambda _i, _k, obs: teacher.act(obs), "budget", weights, data.episodes)
    obs, actions, returns = [], [], []
    for o, a, rewards in runs:
        g, to_go = 0.0, []
        for r in reversed(rewards):
            g = r + gamma * g
            to_go.append(g)
        obs.extend(o)
        actions.extend(int(x) for x in a)
        returns.extend(reversed(to_go))
    return Demonstrations(np.stack(obs).astype(np.float32), np.array(actions), np.array(returns, dtype=np.float32))


def imitate(model: PPO, demo: Demonstrations, steps: int = 400, lr: float = 1e-3) -> dict[str, float]:
    """Fit ``model``'s policy to ``demo``'s actions (cross-entropy) and its value function to the returns (squared
    error), full batch with Adam; returns the deterministic copy's agreement with the teacher, its mean policy
    entropy and the value function's explained variance on the demonstrations.

    The value function is fitted to the standardised returns and its output layer rescaled after: returns of tens
    (a lost pass key) are out of reach of a few hundred small steps from an output near zero."""
    policy = model.policy
    obs = torch.as_tensor(demo.obs)
    actions = torch.as_tensor(demo.actions)
    returns = torch.as_tensor(demo.returns)
    mean, scale = returns.mean(), returns.std().clamp_min(1e-6)
    standard = (returns - mean) / scale
    optimiser = torch.optim.Adam(policy.parameters(), lr=lr)
    policy.set_training_mode(True)
    for _ in range(steps):
        values, log_prob, _ = policy.evaluate_actions(obs, actions)
        loss = -log_prob.mean() + torch.nn.functional.mse_loss(values.flatten(), standard)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    policy.set_training_mode(False)
    with torch.no_grad():
        policy.value_net.weight.mul_(scale)
        policy.value_net.bias.mul_(scale).add_(mean)
    with torch.no_grad():
        values, _, entropy = policy.evaluate_actions(obs, actions)
        chosen = policy.get_distribution(obs).get_actions(deterministic=True)
    residual = float(torch.var(returns - values.flatten()))
    return {
        "imitation_agreement": float((chosen == actions).float().mean()),
        "imitation_entropy": float(entropy.mean()),
        "imitation_value_explained_variance": 1.0 - residual / max(float(torch.var(returns)), 1e-12),
        "imitation_samples": float(len(actions)),
    }
