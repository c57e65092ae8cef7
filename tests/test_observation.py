"""Observation layout 2: the latest segment plus the recent history the probe found informative (the last four
segments' mean entropy, gap and top-1 and their trend). Its values on a known sequence, the same observations in the
environment and inside the engine, the layout recorded in the export (layout-1 folders still load and run), the
MLflow model's signature following it, and ``train --observation history`` on tiny-random."""

from __future__ import annotations

import json

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch

from confkv import LLM, SamplingParams
from confkv.config import load_policy_file
from confkv.controllers import StepSignals
from confkv.controllers.learned import LearnedController, MLPPolicy
from confkv.controllers.observation import (
    ENTROPY_SCALE,
    HISTORY_NAMES,
    OBS_DIM,
    OBS_NAMES,
    history_features,
    obs_dim,
    obs_names,
    push_history,
    segment_observation,
)
from confkv.errors import ConfkvError
from envs.constant import RecordingPolicy
from envs.env import ConfKVEnv
from envs.episodes import build_episodes, default_base_policy
from envs.evaluate import evaluate_agent, evaluate_policy
from tuner.cli import main as tune_main
from tuner.pyfunc import log_policy_model
from tuner.tracking import mlflow_run

BASE = default_base_policy("tiny-random")


def _signals(entropy: float, gap: float, top1: float, n: int = 3) -> list[StepSignals]:
    return [StepSignals(entropy, gap, top1, resident=40, position=50, pool_usage=0.25) for _ in range(n)]


def _network(where, width: int, version: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(16, width, generator=g), torch.zeros(16), "tanh"),
              (torch.randn(5, 16, generator=g), torch.randn(5, generator=g), "none")]  # fmt: skip
    return MLPPolicy(layers, "knobs", obs_version=version).save(where, BASE)


def test_history_entries_on_a_known_sequence():
    """Five segments of known means: the recent mean covers the last four (the latest included), the trend is
    0.5 + the latest minus that mean, and the first 14 entries are layout 1's."""
    means = [(1.2, 0.9, 0.95), (2.4, 0.5, 0.7), (3.6, 0.3, 0.6), (6.0, 0.1, 0.4), (1.2, 0.7, 0.8)]
    history: tuple = ()
    for e, g, t in means:
        history = push_history(history, _signals(e, g, t))
    assert len(history) == 4  # the first segment has left the window
    assert history[-1] == pytest.approx((1.2 / ENTROPY_SCALE, 0.7, 0.8))
    window = np.array([(e / ENTROPY_SCALE, g, t) for e, g, t in means[1:]])
    recent = window.mean(axis=0)  # entropy (0.2+0.3+0.5+0.1)/4 = 0.275, gap 0.4, top-1 0.625
    assert recent == pytest.approx([0.275, 0.4, 0.625])
    feats = history_features(history)
    assert feats == pytest.approx([0.275, 0.4, 0.625, 0.5 + 0.1 - 0.275, 0.5 + 0.7 - 0.4, 0.5 + 0.8 - 0.625])

    segment = _signals(1.2, 0.7, 0.8)
    v1 = segment_observation(segment, 64.0, BASE)
    v2 = segment_observation(segment, 64.0, BASE, history=history)
    assert v1.shape == (OBS_DIM,) and v2.shape == (obs_dim(2),) == (20,)
    np.testing.assert_array_equal(v2[:OBS_DIM], v1)
    np.testing.assert_allclose(v2[OBS_DIM:], feats, rtol=1e-6)
    assert obs_names(2) == OBS_NAMES + HISTORY_NAMES and obs_names(1) == OBS_NAMES

    # one segment: no trend yet; a swing past the clip stays in [0, 1]
    one = push_history((), segment)
    assert history_features(one)[3:] == pytest.approx([0.5, 0.5, 0.5])
    swing = push_history(push_history(push_history(push_history((), _signals(0, 0.0, 0.0)), _signals(0, 0.0, 0.0)),
                                      _signals(0, 0.0, 0.0)), _signals(0, 1.0, 1.0))  # fmt: skip
    obs = segment_observation(_signals(0, 1.0, 1.0), 64.0, BASE, history=swing)
    assert obs[OBS_DIM + 4] == pytest.approx(1.0) and obs.min() >= 0.0 and obs.max() <= 1.0
    with pytest.raises(ConfkvError, match="observation layout"):
        obs_names(3)


def test_the_export_records_its_layout_and_layout_1_folders_still_load(tmp_path):
    old = _network(tmp_path / "v1", OBS_DIM, 1)
    new = _network(tmp_path / "v2", obs_dim(2), 2)
    assert json.loads((old / "policy.json").read_text())["obs_version"] == 1
    doc = json.loads((new / "policy.json").read_text())
    assert (doc["obs_version"], doc["obs_dim"]) == (2, 20)
    assert MLPPolicy.load(old).obs_version == 1 and MLPPolicy.load(new).obs_version == 2
    # a layout-1 folder runs in the engine as before; a layout-2 one reads its 20 entries there
    for folder in (old, new):
        out = LLM("tiny-random", policy_file=folder).generate([5] * 120, SamplingParams(max_tokens=70, ignore_eos=True))
        assert len(out[0].token_ids) == 70
    # a network whose first layer does not read its layout's width, or a layout this code does not know
    doc["obs_version"] = 1
    (new / "policy.json").write_text(json.dumps(doc))
    with pytest.raises(ConfkvError, match="its input is 14 wide"):
        MLPPolicy.load(new)
    doc["obs_version"] = 7
    (new / "policy.json").write_text(json.dumps(doc))
    with pytest.raises(ConfkvError, match="observation layout"):
        MLPPolicy.load(new)


@pytest.fixture(scope="module")
def passkey():
    data = build_episodes("tiny-random", workload="passkey", split="train")
    data.obs_version = 2
    return data


def test_a_layout_2_network_sees_the_same_history_in_the_environment_and_the_engine(passkey, tmp_path):
    """The environment keeps each episode's history as the engine's ``LearnedController`` keeps it in its state:
    the first observation is identical, every observation's history entries are the ones its own last four
    segments give, and the budgets (so the memory) are the same."""
    env = ConfKVEnv(passkey)
    assert env.observation_space.shape == (20,)
    folder = _network(tmp_path / "net", obs_dim(2), 2)
    net = MLPPolicy.load(folder)
    seen_env: list[np.ndarray] = []

    def act(obs: np.ndarray) -> np.ndarray:
        seen_env.append(np.array(obs))
        return net.act(obs)

    by_env = evaluate_agent(passkey, act)
    recorder = RecordingPolicy.wrap(net)
    policy = load_policy_file(folder)
    by_engine = evaluate_policy(passkey, policy, controller=LearnedController(policy, recorder))
    seen_engine = [o for o, _ in recorder.seen]
    assert len(seen_env) == len(seen_engine) > 4
    np.testing.assert_allclose(seen_env[0], seen_engine[0], rtol=1e-5, atol=1e-6)
    for seen in (seen_env, seen_engine):
        history: tuple = ()
        for obs in seen:  # one episode: each observation's segment means are entries 0, 3, 6
            history = (*history[-3:], (float(obs[0]), float(obs[3]), float(obs[6])))
            np.testing.assert_allclose(obs[OBS_DIM:], np.clip(history_features(history), 0, 1), atol=1e-5)
    assert {round(float(o[OBS_DIM + 3]), 4) for o in seen_env} != {0.5}  # the trend moves: a real test
    assert by_env["kv_fraction"] == pytest.approx(by_engine["kv_fraction"], rel=1e-6)


def test_the_mlflow_model_of_a_layout_2_policy_names_its_20_inputs(tmp_path):
    folder = _network(tmp_path / "policy", obs_dim(2), 2)
    with mlflow_run(f"sqlite:///{tmp_path}/mlflow.db", "pyfunc", {}, tags={"confkv.kind": "test"}):
        uri = log_policy_model(folder)
    model = mlflow.pyfunc.load_model(uri)
    assert model.metadata.get_input_schema().input_names() == list(OBS_NAMES + HISTORY_NAMES)
    obs = np.random.default_rng(1).random((8, 20), dtype=np.float32)
    got = model.predict(pd.DataFrame(obs, columns=list(obs_names(2))))
    mlp = MLPPolicy.load(folder)
    space = mlp.resolved_space(load_policy_file(folder))
    expected = pd.DataFrame([space.knobs(mlp.act(o)) for o in obs])[list(space.names)].to_numpy()
    np.testing.assert_allclose(got.to_numpy(), expected, rtol=1e-6)
    with pytest.raises(ConfkvError, match="rows of 20 values"):
        model.unwrap_python_model().predict(None, np.zeros((2, OBS_DIM)))


def test_train_observation_history_exports_a_layout_2_policy(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["train", "--model", "tiny-random", "--workload", "passkey", "--observation", "history", "--out", "run",
            "--no-register"]  # fmt: skip
    assert tune_main([*args, "--algo", "ppo", "--timesteps", "32", "--n-envs", "2", "--eval-every", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    net = MLPPolicy.load(tmp_path / "run" / "policy")
    assert net.obs_version == 2 and net.layers[0][0].shape[1] == 20
    model = mlflow.pyfunc.load_model(summary["pyfunc_model_uri"])
    assert len(model.metadata.get_input_schema().input_names()) == 20
    # an Optuna trial observes nothing: the flag is refused before the model loads
    assert tune_main([*args, "--algo", "optuna", "--trials", "1"]) == 2
    assert "--observation is for ppo or sac" in capsys.readouterr().err
