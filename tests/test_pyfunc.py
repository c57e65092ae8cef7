"""An exported learned policy as an MLflow pyfunc model: loaded with ``mlflow.pyfunc.load_model``, it predicts the
knobs the exported folder sets, for the same observations."""

from __future__ import annotations

import mlflow
import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch

from confkv.config import load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM, OBS_NAMES
from confkv.errors import ConfkvError
from envs.episodes import default_base_policy
from tuner.pyfunc import log_policy_model
from tuner.tracking import mlflow_run

BASE = default_base_policy("tiny-random")


def _network(where, action: str):
    g = torch.Generator().manual_seed(7)
    out = 5 if action == "knobs" else 3
    layers = [(torch.randn(8, OBS_DIM, generator=g), torch.zeros(8), "tanh"),
              (torch.randn(out, 8, generator=g), torch.randn(out, generator=g), "none")]  # fmt: skip
    return MLPPolicy(layers=layers, action=action).save(where, BASE)


@pytest.mark.parametrize("action", ["knobs", "budget"])
def test_the_mlflow_model_predicts_the_knobs_of_the_exported_folder(tmp_path, action):
    folder = _network(tmp_path / "policy", action)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with mlflow_run(uri, "pyfunc", {}, tags={"confkv.kind": "test"}) as run:
        model_uri = log_policy_model(folder, "registry://p@3")
    assert mlflow.get_run(run.info.run_id).data.tags["confkv.pyfunc_model_uri"] == model_uri
    model = mlflow.pyfunc.load_model(model_uri)
    assert model.metadata.metadata == {"confkv.registry.ref": "registry://p@3"}
    assert model.metadata.get_input_schema().input_names() == list(OBS_NAMES)
    obs = np.random.default_rng(1).random((16, OBS_DIM), dtype=np.float32)
    got = model.predict(pd.DataFrame(obs, columns=list(OBS_NAMES)))
    mlp = MLPPolicy.load(folder)
    if action == "knobs":
        space = mlp.resolved_space(load_policy_file(folder))
        assert list(got.columns) == list(space.names)
        expected = [space.knobs(mlp.act(o)) for o in obs]
        np.testing.assert_allclose(got.to_numpy(), pd.DataFrame(expected)[list(space.names)].to_numpy(), rtol=1e-6)
        assert len({tuple(r.values()) for r in expected}) > 1  # the rows differ: a real test of the mapping
    else:
        assert got["budget_action"].tolist() == [int(mlp.act(o)) for o in obs]
    with pytest.raises(ConfkvError, match="rows of 14 values"):
        model.unwrap_python_model().predict(None, np.zeros((2, 3)))


def test_register_run_logs_the_mlflow_model_of_a_learned_policy(tmp_path, capsys):
    """``confkv-tune register NAME --run RUN_ID`` of a run holding a learned policy adds the pyfunc model to that
    run, linked to the version it became, as ``train`` does; the run keeps its status; a rule policy gets none."""
    from tuner.cli import main as tune_main
    from tuner.tracking import log_artifacts

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    folder = _network(tmp_path / "policy", "knobs")
    with mlflow_run(uri, "trained", {}, tags={"confkv.kind": "train"}) as run:
        log_artifacts(folder, "policy")
    client = mlflow.MlflowClient()
    client.set_terminated(run.info.run_id, status="KILLED")  # a stopped run's best policy is registered too
    assert tune_main(["register", "taken-away", "--run", run.info.run_id, "--tracking-uri", uri]) == 0
    version = capsys.readouterr().out.strip()
    after = client.get_run(run.info.run_id)
    assert after.info.status == "KILLED"
    model = mlflow.pyfunc.load_model(after.data.tags["confkv.pyfunc_model_uri"])
    assert model.metadata.metadata == {"confkv.registry.ref": f"registry://taken-away@{version}"}
    obs = np.random.default_rng(3).random((6, OBS_DIM), dtype=np.float32)
    mlp = MLPPolicy.load(folder)
    space = mlp.resolved_space(load_policy_file(folder))
    expected = pd.DataFrame([space.knobs(mlp.act(o)) for o in obs])[list(space.names)].to_numpy()
    np.testing.assert_allclose(model.predict(pd.DataFrame(obs, columns=list(OBS_NAMES))).to_numpy(), expected,
                               rtol=1e-6)  # fmt: skip

    rule = tmp_path / "rule"
    rule.mkdir()
    (rule / "policy.yaml").write_text("cache_policy:\n  controller: dynamic\n")
    with mlflow_run(uri, "optuna", {}, tags={"confkv.kind": "train"}) as run2:
        log_artifacts(rule, "policy")
    assert tune_main(["register", "a-rule", "--run", run2.info.run_id, "--tracking-uri", uri]) == 0
    assert "confkv.pyfunc_model_uri" not in client.get_run(run2.info.run_id).data.tags
