"""A budget decision means the same through the engine as in the training environment (issue 37).

The environment applies an agent's decision between segments (``LLMEngine.resize``: the segment's tokens were
already trimmed to the budget in force, then the expansion recalls into the room the new budget gives). Through the
engine (``LearnedController``, what ``confkv-tune compare`` and serving run) the same decision is taken inside a
teacher-forced chunk's rows; the expansion must recall into the same room, not into what the chunk's own
not-yet-trimmed tokens leave of it, or a pass key's block does not come back for the answer.
"""

from __future__ import annotations

import pytest
import torch

from confkv.bench.scored import score_items
from confkv.config import load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import POSITION_SCALE, obs_names
from envs.env import RewardWeights
from envs.episodes import build_episodes
from envs.evaluate import _play

SLOPE = 1e4


@pytest.fixture(scope="module")
def passkeys():
    data = build_episodes("tiny-random", workload="passkey-varied", split="heldout")
    data.obs_version = 2
    return data


def schedule_network(after: int) -> MLPPolicy:
    """A budget network that contracts before position ``after`` (tokens) and expands from there."""
    names = obs_names(2)
    w = torch.zeros(3, len(names))
    i = names.index("position")
    w[0, i], w[2, i] = -SLOPE, SLOPE  # contract, hold, expand
    t = after / POSITION_SCALE
    b = torch.tensor([SLOPE * t, -1.0, -SLOPE * t])
    return MLPPolicy(layers=[(w, b, "none")], action="budget", obs_version=2)


def test_an_expansion_recalls_through_the_engine_what_it_recalls_in_the_environment(passkeys, tmp_path):
    mlp = schedule_network(after=150)
    folder = mlp.save(tmp_path / "net", passkeys.base_policy)
    episodes = passkeys.episodes
    by_env, _ = _play(passkeys, mlp.act, "budget", RewardWeights(), episodes)
    engine = passkeys.llm(load_policy_file(folder), max_batch_size=len(episodes)).engine
    by_engine = score_items(engine, [ep.item for ep in episodes])
    for env, eng in zip(by_env, by_engine, strict=True):
        assert env.kv["recalled_blocks"] > 0  # the schedule expands, and the expansions recall
        assert eng.kv["recalled_blocks"] == env.kv["recalled_blocks"]
        assert torch.equal(eng.resident, env.resident)
        # the same blocks resident at every token: the same distributions
        torch.testing.assert_close(eng.token_logprobs, env.token_logprobs, atol=1e-4, rtol=0)
