"""The tuning system on tiny-random: environment checkers, rule agent == engine dynamic, PPO/Optuna/MLflow runs,
export into the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

from agents.rule import RuleAgent
from confkv import LLM, SamplingParams
from confkv.config import load_policy_file
from envs.env import ConfKVEnv, ConfKVVecEnv, RewardWeights
from envs.episodes import build_episodes
from envs.evaluate import evaluate_agent, evaluate_policy
from tuner.cli import main as tune_main


@pytest.fixture(scope="module")
def data():
    return build_episodes("tiny-random", workload="mixed", split="train")


def test_episodes_cover_the_mixed_workload(data):
    kinds = {ep.workload for ep in data.episodes}
    assert kinds == {"prose", "longgen", "chat", "passkey"}
    assert all(ep.item.reference is not None for ep in data.episodes)
    heldout = build_episodes("tiny-random", workload="mixed", split="heldout", loaded=data.loaded)
    train_ids = {tuple(ep.item.token_ids) for ep in data.episodes}
    assert not train_ids & {tuple(ep.item.token_ids) for ep in heldout.episodes}


@pytest.mark.parametrize("action", ["knobs", "budget"])
def test_environment_passes_the_checkers(data, action):
    env = ConfKVEnv(data, action=action)
    gym_check_env(env, skip_render_check=True)
    sb3_check_env(ConfKVEnv(data, action=action), warn=False)


def test_seeded_resets_are_reproducible(data):
    env = ConfKVEnv(data)
    first = env.reset(seed=3)
    again = env.reset(seed=3)
    assert first[1]["item"] == again[1]["item"] and np.array_equal(first[0], again[0])
    rewards = []
    for _ in range(2):
        env.reset(seed=5)
        total, done = 0.0, False
        while not done:
            _, r, done, _, info = env.step(np.zeros(3, dtype=np.float32))
            total += r
        rewards.append(total)
        assert info["summary"]["reward"] == pytest.approx(total)
    assert rewards[0] == pytest.approx(rewards[1])


def test_rule_agent_reproduces_the_engine_dynamic_policy(data):
    by_env = evaluate_agent(data, RuleAgent(data.base_policy))
    by_engine = evaluate_policy(data, data.base_policy)
    assert by_env["kv_fraction"] == pytest.approx(by_engine["kv_fraction"], rel=1e-6)
    assert by_env["kl_mean"] == pytest.approx(by_engine["kl_mean"], rel=1e-4, abs=1e-6)
    assert by_env["reward"] == pytest.approx(by_engine["reward"], rel=1e-4, abs=1e-6)
    assert by_env["passkey_acc"] == by_engine["passkey_acc"]


def test_memory_weight_trades_against_quality(data):
    keep_all = evaluate_policy(data, data.base_policy.replace(controller="full"), RewardWeights(1.0, 10.0, 0.0))
    assert keep_all["kv_fraction"] == pytest.approx(1.0, abs=0.02) and keep_all["kl_mean"] < 1e-5
    small = evaluate_policy(data, data.base_policy.replace(scaling_factor=1.0))
    assert small["kv_fraction"] < 0.8


def test_vec_env_steps_all_slots_in_one_batch(data):
    env = ConfKVVecEnv(data, 3, seed=1)
    obs = env.reset()
    assert obs.shape == (3, 14)
    finished = 0
    for _ in range(40):
        obs, rewards, dones, infos = env.step(np.zeros((3, 3), dtype=np.float32))
        finished += int(dones.sum())
        assert rewards.shape == (3,) and np.isfinite(rewards).all()
        for d, info in zip(dones, infos, strict=True):
            if d:
                assert "terminal_observation" in info and "summary" in info and "r" in info["episode"]
    assert finished > 0
    env.close()
    assert env._slots.engine.pool.num_used == 0


@pytest.mark.parametrize("algo", ["ppo", "optuna"])
def test_train_logs_mlflow_and_exports_a_policy_confkv_runs(tmp_path, monkeypatch, capsys, algo):
    monkeypatch.chdir(tmp_path)
    budget = ["--timesteps", "64", "--n-envs", "2"] if algo == "ppo" else ["--trials", "3"]
    code = tune_main(["train", "--algo", algo, "--model", "tiny-random", *budget, "--out", "run"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    policy_dir = tmp_path / "run" / "policy"
    policy = load_policy_file(policy_dir)
    assert policy.controller == ("learned" if algo == "ppo" else "dynamic")

    import mlflow

    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    run = mlflow.get_run(summary["run_id"])
    assert run.data.params["algo"] == algo
    key = "episode_reward" if algo == "ppo" else "trial_reward"
    assert len(mlflow.MlflowClient().get_metric_history(run.info.run_id, key)) >= (1 if algo == "ppo" else 3)
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "policy")}
    assert "policy/policy.yaml" in names

    # the exported policy, taken back out of MLflow, generates in the engine without stable-baselines3 code
    assert tune_main(["export", summary["run_id"], "--out", "exported"]) == 0
    exported = capsys.readouterr().out.strip()
    llm = LLM("tiny-random", policy_file=exported)
    out = llm.generate("The exported policy runs here. " * 12, SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert len(out.token_ids) == 60
    assert max(out.trace.resident[1:]) <= policy.max_size + 16


def test_eval_and_errors(capsys):
    assert tune_main(["eval", "default", "--model", "tiny-random", "--workload", "prose", "--split", "heldout"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["controller"] == "dynamic" and 0 < doc["kv_fraction"] <= 1 and doc["ppl"] > 1
    assert tune_main(["eval", "nonsense", "--model", "tiny-random"]) == 2
    assert "neither a file" in capsys.readouterr().err
    assert tune_main(["train", "--algo", "ppo", "--trials", "3", "--model", "tiny-random", "--out", "x"]) == 2
    assert tune_main(["eval", "default", "--model", "tiny-random", "--workload", "poetry"]) == 2


def test_decode_environment_checks_and_matches_the_engine(data):
    from envs.decode_env import ConfKVDecodeEnv

    gym_check_env(ConfKVDecodeEnv(data), skip_render_check=True)
    sb3_check_env(ConfKVDecodeEnv(data, action="budget"), warn=False)
    env = ConfKVDecodeEnv(data)
    agent = RuleAgent(data.base_policy)
    for i, ep in enumerate(env.episodes):
        obs, _ = env.reset(options={"episode": i})
        done = False
        while not done:
            obs, _, done, _, info = env.step(agent(obs))
        # the rule agent steering the engine generates exactly what the engine's own dynamic policy generates
        llm = data.llm()
        prompt = ep.item.token_ids[: ep.item.score_from]
        n = len(ep.item.token_ids) - ep.item.score_from
        expected = llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids
        assert info["summary"]["output_token_ids"] == expected
        assert 0.0 <= info["summary"]["divergence"] <= 1.0
    assert env.engine.pool.num_used == 0


def test_train_ppo_in_decode_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["train", "--algo", "ppo", "--mode", "decode", "--model", "tiny-random", "--timesteps", "24", "--out", "d"]
    assert tune_main(args) == 0
    assert load_policy_file(tmp_path / "d" / "policy").controller == "learned"
