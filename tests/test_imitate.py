"""Starting a PPO budget agent as a copy of a teacher network (``--init-network``, ``tuner.imitate``) and the
counterfactual advantages of ``benchmarks/action_advantage.py``, on tiny-random's varied pass keys."""

from __future__ import annotations

import json
from dataclasses import replace

import mlflow
import numpy as np
import pytest
from stable_baselines3 import PPO

from benchmarks import action_advantage
from benchmarks.rule_network import rule_network
from confkv.controllers.observation import obs_names
from envs.env import ConfKVVecEnv, RewardWeights
from envs.episodes import build_episodes, default_base_policy
from envs.evaluate import evaluate_agent
from tuner.cli import main as tune_main
from tuner.imitate import demonstrate, imitate

WEIGHTS = RewardWeights(1.0, 6.0, 1.0)
FEATURE = obs_names(2).index("entropy_max")


@pytest.fixture(scope="module")
def varied():
    data = build_episodes("tiny-random", workload="passkey-varied", split="train")
    data.obs_version = 2
    return data


def a_threshold_both_sides_of(data) -> float:
    """A threshold with decisions of the untrained rule on both sides, so the teacher expands and contracts."""
    demo = demonstrate(data, rule_network("entropy_max", 0.0), WEIGHTS, 0.5)
    return float(np.median(demo.obs[:, FEATURE]))


def test_imitation_copies_the_teachers_decisions_and_values(varied):
    teacher = rule_network("entropy_max", a_threshold_both_sides_of(varied))
    demo = demonstrate(varied, teacher, WEIGHTS, gamma=0.5)
    assert set(demo.actions.tolist()) == {0, 2} and len(demo.obs) == len(demo.returns)
    # returns-to-go: the last decision of an episode returns its own step's reward only
    assert np.isfinite(demo.returns).all()
    env = ConfKVVecEnv(varied, 2, "budget", WEIGHTS)
    model = PPO("MlpPolicy", env, n_steps=8, batch_size=8, seed=0, device="cpu", policy_kwargs={"net_arch": [64, 64]})
    fit = imitate(model, demo, steps=400)
    env.close()
    after = model.policy.predict(demo.obs, deterministic=True)[0]
    assert fit["imitation_agreement"] == pytest.approx(float(np.mean(after == demo.actions)))
    assert fit["imitation_agreement"] >= 0.9
    assert fit["imitation_value_explained_variance"] > 0.5
    # the copy plays as the teacher does in the environment, where it agrees with it on every decision
    if fit["imitation_agreement"] == 1.0:
        act = lambda obs: int(model.policy.predict(obs, deterministic=True)[0])  # noqa: E731
        assert evaluate_agent(varied, act, "budget", WEIGHTS)["reward"] == pytest.approx(
            evaluate_agent(varied, teacher.act, "budget", WEIGHTS)["reward"], abs=1e-6
        )


def test_train_starts_from_the_copy_and_says_so(varied, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rule_network("entropy_max", a_threshold_both_sides_of(varied)).save(
        tmp_path / "rule", default_base_policy("tiny-random")
    )
    common = ["train", "--model", "tiny-random", "--workload", "passkey-varied", "--quality-weight", "6",
              "--out", "run", "--no-register"]  # fmt: skip
    args = [*common, "--algo", "ppo", "--action", "budget", "--observation", "history", "--timesteps", "16",
            "--n-envs", "2", "--n-steps", "8", "--eval-every", "1", "--gamma", "0.5",
            "--init-network", "rule"]  # fmt: skip
    assert tune_main(args) == 0
    captured = capsys.readouterr()
    assert "imitation of rule:" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    run = mlflow.get_run(summary["run_id"])
    assert run.data.params["init_network"] == "rule" and run.data.params["preset_gamma"] == "0.5"
    assert run.data.metrics["imitation_agreement"] >= 0.9 and run.data.metrics["imitation_samples"] > 4

    # refused, each with one line before any model loads
    for extra, message in [
        (["--algo", "ppo", "--init-network", "rule"], "--action budget"),
        (["--algo", "sac", "--init-network", "rule"], "--action budget"),
        (["--algo", "ppo", "--action", "budget", "--init-network", "missing"], "cannot load a budget network"),
        (["--algo", "ppo", "--action", "budget", "--init-network", "rule"], "observation layout 2"),
    ]:
        assert tune_main([*common, *extra, "--timesteps", "8"]) == 2
        assert message in capsys.readouterr().err


def test_action_advantage_forces_one_decision_and_compares_returns(varied):
    few = replace(varied, episodes=varied.episodes[:1])
    rule = action_advantage.threshold_rule(FEATURE, a_threshold_both_sides_of(varied))
    rows = action_advantage.advantages(few, rule, WEIGHTS, batch=4)
    steps = len(rows)
    assert steps >= 2 and [r["before_answer"] for r in rows] == list(range(steps, 0, -1))
    for r in rows:
        # the immediate difference is the first term of both returns; at gamma 1 every later segment counts
        assert np.isfinite([r["immediate"], r["return_0.5"], r["return_1"]]).all()
    last = rows[-1]
    assert last["immediate"] == pytest.approx(last["return_0.5"]) == pytest.approx(last["return_1"])
    text = action_advantage.table(rows, lambda r: str(r["before_answer"]), "segments before the answer")
    assert text.startswith("| segments before the answer | decisions |") and len(text.splitlines()) == 2 + steps
