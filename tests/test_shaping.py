"""Potential-based reward shaping on the budget's headroom (``envs.env.Shaping``, ``train --shaping-headroom``), on
tiny-random's varied pass keys: the shaped step rewards differ from the plain ones by exactly the potential's
difference, the episode summaries and evaluations keep the plain reward, and bad values are refused in one line."""

from __future__ import annotations

import json
from typing import Any

import mlflow
import pytest

from confkv.errors import ConfkvError
from envs.decode_env import ConfKVDecodeEnv
from envs.env import ConfKVEnv, RewardWeights, Shaping
from envs.episodes import build_episodes
from tuner.cli import main as tune_main

WEIGHTS = RewardWeights(1.0, 6.0, 1.0)
#: contract, expand twice, hold, contract twice, ...: every kind of budget move, in both directions
ACTIONS = [0, 2, 2, 1, 0, 0, 2, 1]


@pytest.fixture(scope="module")
def varied():
    data = build_episodes("tiny-random", workload="passkey-varied", split="train")
    data.obs_version = 2
    return data


def headroom(data, budget: float) -> float:
    """The share of ``base_size``..``max_size`` left above ``budget``, computed here from the policy's sizes."""
    lo, hi = data.base_policy.base_size, data.base_policy.max_size
    return (hi - budget) / (hi - lo)


def play(env: Any, episode: int) -> tuple[float, list[float], list[float], float]:
    """One episode under ``ACTIONS`` (cycled): the budget of the first state, the step rewards, each step's budget
    after its action, and the summary's episode reward."""
    env.reset(options={"episode": episode})
    start = float(_sequence(env).ctrl.budget)
    rewards, budgets = [], []
    for step in range(1000):
        _, reward, done, _, info = env.step(ACTIONS[step % len(ACTIONS)])
        rewards.append(reward)
        budgets.append(info["action"]["budget"])
        if done:
            return start, rewards, budgets, info["summary"]["reward"]
    raise AssertionError("the episode did not end")


def _sequence(env: Any) -> Any:
    if isinstance(env, ConfKVDecodeEnv):
        return env._seq()
    slots = env._slots
    return slots.session.state(slots.index[0]).seq


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_shaped_rewards_differ_by_the_potential_and_summaries_keep_the_plain_reward(varied, gamma):
    k = 3.0
    plain_env = ConfKVEnv(varied, "budget", WEIGHTS)
    shaped_env = ConfKVEnv(varied, "budget", WEIGHTS, shaping=Shaping(k, gamma))
    for episode in range(2):
        start, plain, budgets, plain_total = play(plain_env, episode)
        start_s, shaped, budgets_s, shaped_total = play(shaped_env, episode)
        assert len(plain) >= 3 and start_s == start and budgets_s == budgets  # the same episode, the same moves
        assert len(set(budgets)) > 2  # the budget moved both ways
        states = [start, *budgets]
        for t, (r, s) in enumerate(zip(plain, shaped, strict=True)):
            expected = gamma * k * headroom(varied, states[t + 1]) - k * headroom(varied, states[t])
            assert s - r == pytest.approx(expected, abs=1e-9)
            if states[t + 1] < states[t]:  # a contraction is paid at once, an expansion charged (at gamma 1)
                assert gamma < 1 or s > r
            elif states[t + 1] > states[t]:
                assert s < r
        if gamma == 1.0:  # the episode's shaping telescopes to Phi(end) - Phi(start)
            telescoped = k * (headroom(varied, budgets[-1]) - headroom(varied, start))
            assert sum(shaped) - sum(plain) == pytest.approx(telescoped, abs=1e-9)
        # what an episode summary (rollout curves, SB3's ep_rew_mean) reports is the plain reward
        assert plain_total == pytest.approx(sum(plain), abs=1e-9)
        assert shaped_total == pytest.approx(plain_total, abs=1e-9)
    plain_env.close()
    shaped_env.close()


def test_the_decode_environment_shapes_alike(varied):
    k, gamma = 2.0, 1.0
    plain_env = ConfKVDecodeEnv(varied, "budget", WEIGHTS)
    shaped_env = ConfKVDecodeEnv(varied, "budget", WEIGHTS, shaping=Shaping(k, gamma))
    start, plain, budgets, plain_total = play(plain_env, 0)
    _, shaped, _, shaped_total = play(shaped_env, 0)
    telescoped = k * (headroom(varied, budgets[-1]) - headroom(varied, start))
    assert sum(shaped) - sum(plain) == pytest.approx(telescoped, abs=1e-9)
    assert shaped_total == pytest.approx(plain_total, abs=1e-9)
    plain_env.close()
    shaped_env.close()


def test_train_logs_the_shaping_and_evaluates_on_the_plain_reward(tmp_path, monkeypatch, capsys):
    """Two runs from the same seed, with and without shaping: the evaluation before the first update (the same
    untrained network) and the default rule's reward are the same in both, so neither is shaped."""
    monkeypatch.chdir(tmp_path)
    common = ["train", "--model", "tiny-random", "--workload", "passkey-varied", "--quality-weight", "6",
              "--no-register", "--algo", "ppo", "--action", "budget", "--observation", "history",
              "--timesteps", "16", "--n-envs", "2", "--n-steps", "8", "--eval-every", "1"]  # fmt: skip
    runs = {}
    for name, extra in (("plain", []), ("shaped", ["--shaping-headroom", "10"])):
        assert tune_main([*common, *extra, "--out", name]) == 0
        captured = capsys.readouterr()
        assert ("training reward shaped" in captured.err) == (name == "shaped")
        runs[name] = json.loads(captured.out.strip().splitlines()[-1])["run_id"]
    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    client = mlflow.MlflowClient()
    shaped, plain = (mlflow.get_run(runs[n]) for n in ("shaped", "plain"))
    assert shaped.data.params["shaping_headroom"] == "10.0"
    assert plain.data.params.get("shaping_headroom") in (None, "None")
    first = {n: min(client.get_metric_history(runs[n], "eval_reward"), key=lambda m: m.step) for n in runs}
    assert first["shaped"].step == first["plain"].step == 0
    assert first["shaped"].value == pytest.approx(first["plain"].value, abs=1e-9)
    assert shaped.data.metrics["default_reward"] == pytest.approx(plain.data.metrics["default_reward"], abs=1e-9)


def test_bad_shaping_values_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def boom(*_: Any) -> None:
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("tuner.options.tune_data", boom)
    common = ["train", "--model", "tiny-random", "--no-register", "--out", "o"]
    ppo = [*common, "--algo", "ppo", "--action", "budget"]
    for extra, message in [
        ([*ppo, "--shaping-headroom", "nan"], "--shaping-headroom must be a finite number above 0 (got nan)"),
        ([*ppo, "--shaping-headroom", "inf"], "--shaping-headroom must be a finite number above 0 (got inf)"),
        ([*ppo, "--shaping-headroom", "-1"], "--shaping-headroom must be a finite number above 0 (got -1.0)"),
        ([*ppo, "--shaping-headroom", "0"], "--shaping-headroom must be a finite number above 0 (got 0.0)"),
        ([*common, "--algo", "optuna", "--shaping-headroom", "5"], "--shaping-headroom is for ppo or sac"),
    ]:
        assert tune_main(extra) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as stop:  # compare has no such option: what it measures is never shaped
        tune_main(["compare", "--model", "tiny-random", "--shaping-headroom", "5"])
    assert stop.value.code == 2
    with pytest.raises(ConfkvError):
        Shaping(1.0, 1.5)
