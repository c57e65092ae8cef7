"""One way to judge every policy: the same episodes, the same metrics, the same reward.

``evaluate_policy`` runs a ``CachePolicy`` (a baseline, the requirement's dynamic rule, an Optuna result or an
exported learned policy) through ``confkv.scoring``; ``evaluate_agent`` runs an agent acting in the environment.
Both report the resident KV fraction, KL to full, perplexity of the prose episodes, pass-key accuracy and the
environment's reward per episode, segmenting tokens exactly as the environment does.

The reward is a sum of terms, and ``reward_terms`` says what each contributed to the mean episode reward: memory
(``memory_weight`` x the share of the cache not resident, summed over an episode's segments), KL (minus
``quality_weight`` x the mean KL of each segment, summed likewise) and one term per retrieval workload
(``task_weight`` for an answer the policy gets right, once per pass-key or multi-key episode). Memory is earned on
every segment of every episode and a retrieval answer once, on a few episodes, so a policy can rank first while it
loses every pass key; ``full_passkey_acc`` and ``full_multikey_acc`` (what the full cache answers, read from the
references) are the bar a policy's retrieval is held to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from confkv.bench.scored import score_items
from confkv.config import CachePolicy
from confkv.controllers import Controller
from confkv.progress import stage
from confkv.scoring import ScoreResult
from envs.env import ConfKVVecEnv, RewardWeights, reward_of
from envs.episodes import Episode, TuneData


def segments(n: int, chunk: int) -> list[slice]:
    """The environment's segments: the first scored token alone, then ``chunk`` tokens at a time."""
    out = [slice(0, 1)]
    i = 1
    while i < n:
        out.append(slice(i, min(n, i + chunk)))
        i += chunk
    return out


def task_accuracy(rows: list[dict[str, Any]], workload: str | None = None) -> float | None:
    """Share of retrieval episodes (of ``workload``, or all) whose answer was the policy's greedy choice."""
    done = [r["task_correct"] for r in rows if "task_correct" in r and workload in (None, r["workload"])]
    return float(np.mean(done)) if done else None


def full_task_correct(ep: Episode) -> float | None:
    """Whether the full cache's top-1 choice is the answer at every answer token of a retrieval episode (from the
    reference's top-k, which the references keep sorted): what a policy's retrieval is compared with."""
    ref = ep.item.reference
    if ep.task is None or ref is None:
        return None
    a, b = ep.task
    start = ep.item.score_from
    answer = torch.tensor(ep.item.token_ids[start + a : start + b])
    return float(bool((ref.ids[a:b, 0] == answer).all()))


def _mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(values)) if values else None


def reward_terms(rows: list[dict[str, Any]], weights: RewardWeights) -> dict[str, dict[str, Any]]:
    """Each term's weight and contribution to the mean episode reward (the contributions sum to it)."""
    n = len(rows)
    terms: dict[str, dict[str, Any]] = {
        "memory": {"weight": weights.memory_weight, "contribution": sum(r["reward_memory"] for r in rows) / n,
                   "per": "segment: weight x (1 - resident KV share)"},
        "kl": {"weight": weights.quality_weight, "contribution": sum(r["reward_kl"] for r in rows) / n,
               "per": "segment: -weight x mean KL to full"},
    }  # fmt: skip
    for workload in ("passkey", "multikey"):
        done = [r for r in rows if r["workload"] == workload and "task_correct" in r]
        if done:
            terms[workload] = {"weight": weights.task_weight, "contribution": sum(r["reward_task"] for r in done) / n,
                               "per": f"{workload} episode answered", "episodes": len(done), "of": n}  # fmt: skip
    return terms


def _summarise(rows: list[dict[str, Any]], tokens: dict[str, float], weights: RewardWeights) -> dict[str, Any]:
    full = [dict(r, task_correct=r["full_correct"]) for r in rows if r.get("full_correct") is not None]
    out: dict[str, Any] = {
        "episodes": len(rows),
        "reward": float(np.mean([r["reward"] for r in rows])),
        "kv_fraction": tokens["resident"] / tokens["full"],
        "kl_mean": tokens["kl"] / tokens["n"],
        "ppl": float(np.exp(tokens["prose_nll"] / tokens["prose_n"])) if tokens["prose_n"] else None,
        "passkey_acc": task_accuracy(rows, "passkey"),
        "multikey_acc": task_accuracy(rows, "multikey"),
        "task_acc": task_accuracy(rows),
        "full_passkey_acc": task_accuracy(full, "passkey"),
        "full_multikey_acc": task_accuracy(full, "multikey"),
        "segments_mean": _mean_of(rows, "segments"),
        "reward_terms": reward_terms(rows, weights),
        "per_episode": rows,
    }
    return out


def evaluate_policy(
    data: TuneData,
    policy: CachePolicy,
    weights: RewardWeights | None = None,
    episodes: list[Episode] | None = None,
    label: str | None = None,
    controller: Controller | None = None,
) -> dict[str, Any]:
    """Every episode scored once under ``policy``, all in one batch: the figures and reward of the module docstring.
    ``label`` names the progress stage (``confkv.progress``) that counts the episodes as they finish; ``controller``
    (built for ``policy``) replaces the engine's own, e.g. to record a network's decisions (``envs.constant``)."""
    weights = weights or RewardWeights()
    episodes = episodes or data.episodes
    llm = data.llm(policy, max_batch_size=len(episodes))
    with stage(label or f"evaluate {policy.controller}", total=len(episodes), unit="episodes") as progress:
        results = score_items(llm.engine, [ep.item for ep in episodes], on_done=lambda _: progress.update(1),
                              controller=controller)  # fmt: skip
    return _from_results(episodes, results, policy.compact_interval, weights)


def _from_results(
    episodes: list[Episode], results: list[ScoreResult], chunk: int, weights: RewardWeights
) -> dict[str, Any]:
    rows = []
    tok = {"resident": 0.0, "full": 0.0, "kl": 0.0, "n": 0.0, "prose_nll": 0.0, "prose_n": 0.0}
    for ep, r in zip(episodes, results, strict=True):
        kl = r.kl if r.kl is not None else torch.zeros(r.num_tokens)
        segs = segments(r.num_tokens, chunk)
        reward = sum(reward_of(weights, r.resident[s], r.full[s], kl[s]) for s in segs)
        row: dict[str, Any] = {
            "item": ep.item_id,
            "workload": ep.workload,
            "kv_fraction": r.kv_fraction,
            "kl": float(kl.mean()),
            "segments": len(segs),
            "reward_memory": weights.memory_weight
            * sum(1.0 - float((r.resident[s].float() / r.full[s].float()).mean()) for s in segs),
            "reward_kl": -weights.quality_weight * sum(float(kl[s].mean()) for s in segs),
        }
        if ep.task is not None and r.greedy_match is not None:
            a, b = ep.task
            row["task_correct"] = float(bool(r.greedy_match[a:b].all()))
            row["reward_task"] = weights.task_weight * row["task_correct"]
            row["full_correct"] = full_task_correct(ep)
            reward += weights.task_weight * row["task_correct"]
        row["reward"] = reward
        rows.append(row)
        tok["resident"] += float(r.resident.sum())
        tok["full"] += float(r.full.sum())
        tok["kl"] += float(kl.sum())
        tok["n"] += r.num_tokens
        if ep.workload == "prose":
            tok["prose_nll"] += float(-r.token_logprobs.sum())
            tok["prose_n"] += r.num_tokens
    return _summarise(rows, tok, weights)


#: One played episode: its observations, the actions taken on them and each step's reward, as the environment gave them.
Played = tuple[list[np.ndarray], list[Any], list[float]]


def _run_episodes(
    data: TuneData, decide: Callable[[int, int, np.ndarray], Any], action: str, weights: RewardWeights,
    episodes: list[Episode], name: str,
) -> tuple[list[ScoreResult], list[Played]]:  # fmt: skip
    """Every episode once, all in one batch, ``decide(episode, decision, observation)`` choosing each action;
    returns each episode's scored tokens and what was played."""
    env = ConfKVVecEnv(data, len(episodes), action, weights)
    slots = env._slots
    obs = [slots.start(i, ep) for i, ep in enumerate(episodes)]
    played: list[Played] = [([], [], []) for _ in episodes]
    live = set(range(len(episodes)))
    with stage(name, total=len(episodes), unit="episodes") as progress:
        while live:
            order = sorted(live)
            actions = [decide(i, len(played[i][1]), obs[i]) for i in order]
            for i, a, (o, reward, done, _info) in zip(order, actions, slots.advance_some(order, actions), strict=True):
                played[i][0].append(obs[i])
                played[i][1].append(a)
                played[i][2].append(float(reward))
                obs[i] = o
                if done:
                    live.discard(i)
                    progress.update(1)
    scored = [slots.session.result(slots.index[i]) for i in range(len(episodes))]  # type: ignore[arg-type]
    env.close()
    return scored, played


def _play(
    data: TuneData, act: Callable[[np.ndarray], Any], action: str, weights: RewardWeights, episodes: list[Episode]
) -> tuple[list[ScoreResult], list[list[float]]]:
    """Every episode once, the agent choosing each segment's action from its observation; returns each episode's
    scored tokens and the reward of each of its steps."""
    scored, played = _run_episodes(data, lambda _i, _k, obs: act(obs), action, weights, episodes, "evaluate the agent")
    return scored, [rewards for _, _, rewards in played]


def play_episodes(
    data: TuneData, decide: Callable[[int, int, np.ndarray], Any], action: str, weights: RewardWeights,
    episodes: list[Episode],
) -> list[Played]:  # fmt: skip
    """Every episode once, ``decide(episode, decision, observation)`` choosing each action; returns each episode's
    observations, actions and step rewards: what an imitation fits, or a counterfactual (one decision forced, the
    rest by a rule) compares."""
    return _run_episodes(data, decide, action, weights, episodes, "play the episodes")[1]


def evaluate_agent(
    data: TuneData,
    act: Callable[[np.ndarray], Any],
    action: str = "knobs",
    weights: RewardWeights | None = None,
    episodes: list[Episode] | None = None,
) -> dict[str, Any]:
    """Every episode once, all in one batch, the agent choosing each segment's action from its observation."""
    weights = weights or RewardWeights()
    episodes = episodes or data.episodes
    scored, _ = _play(data, act, action, weights, episodes)
    return _from_results(episodes, scored, data.base_policy.compact_interval, weights)


def reference_rewards(
    data: TuneData, action: str = "knobs", weights: RewardWeights | None = None, episodes: list[Episode] | None = None
) -> dict[str, list[float]]:
    """Each episode's step rewards (by item id) under the constant action an untrained agent takes: 0, the base
    policy the knob space is centred on, or *hold* for budget actions. What ``ConfKVVecEnv(reference=...)``
    subtracts, step by step, to reward an agent relative to that policy."""
    weights = weights or RewardWeights()
    episodes = episodes or data.episodes
    ids = [ep.item_id for ep in episodes]
    if len(set(ids)) != len(ids):
        raise ValueError("reference rewards need distinct item ids")
    constant = np.zeros(data.knob_space().dim, dtype=np.float32) if action == "knobs" else 1
    _, steps = _play(data, lambda _obs: constant, action, weights, episodes)
    return dict(zip(ids, steps, strict=True))
