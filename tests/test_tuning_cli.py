"""The tuner's command line: what it refuses before a model loads, and the exports and learned policies it checks
(split from test_tuning.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from confkv import SamplingParams
from confkv.config import load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM
from confkv.errors import ConfkvError
from envs.env import RewardWeights
from tuner.cli import main as tune_main


# ------------------------------------------------------------------------------------ command-line refusals
def _no_model(monkeypatch) -> None:
    """Make loading the episodes fail loudly: the refusals under test must come before the model loads."""

    def boom(*_: Any) -> None:
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("tuner.options.tune_data", boom)


def test_bad_paths_and_uris_are_one_line_errors_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """An ``--out`` that is a file, an Optuna storage that is no URL and a tracking URI of no MLflow scheme are
    refused up front; an OSError or MLflow error that no check caught is still one line and exit status 2."""
    monkeypatch.chdir(tmp_path)
    _no_model(monkeypatch)
    (tmp_path / "afile").write_text("")
    train = ["train", "--model", "tiny-random", "--no-register"]
    for cmd in ([*train, "--algo", "ppo", "--out", "afile"], [*train, "--algo", "optuna", "--out", "afile"],
                ["compare", "--model", "tiny-random", "--out", "afile"]):  # fmt: skip
        assert tune_main(cmd) == 2
        assert "--out afile is an existing file" in capsys.readouterr().err
    assert tune_main([*train, "--algo", "optuna", "--out", "o", "--storage", "foo.db"]) == 2
    assert "--storage must be a database URL such as sqlite:///foo.db" in capsys.readouterr().err
    for cmd in (["eval", "default", "--model", "tiny-random"], [*train, "--algo", "ppo", "--out", "o"]):
        assert tune_main([*cmd, "--tracking-uri", "foo://x"]) == 2
        err = capsys.readouterr().err
        assert "--tracking-uri 'foo://x' is not a URI MLflow can track to" in err and "sqlite" in err
    from mlflow.exceptions import MlflowException

    for error in (PermissionError(13, "Permission denied", "x.db"), MlflowException("bad store\nmore detail")):

        def fail(*_: Any, error: Exception = error) -> None:
            raise error

        monkeypatch.setattr("tuner.options.tune_data", fail)
        assert tune_main(["eval", "default", "--model", "tiny-random", "--no-mlflow"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("confkv-tune: error: ") and len(err.strip().splitlines()) == 1


def test_ppo_rollouts_and_minibatches_of_one_and_misplaced_flags_are_refused(tmp_path, monkeypatch, capsys):
    """stable-baselines3 asserts a rollout and a minibatch of at least 2 only after the model loads; ``--mode
    decode`` means nothing to Optuna, ``--objectives pareto`` nothing to an agent."""
    monkeypatch.chdir(tmp_path)
    _no_model(monkeypatch)
    ppo = ["train", "--algo", "ppo", "--model", "tiny-random", "--out", "o", "--no-register"]
    assert tune_main([*ppo, "--n-envs", "1", "--n-steps", "1"]) == 2
    assert "ppo needs a rollout of at least 2 segments: --n-steps x --n-envs is 1 x 1" in capsys.readouterr().err
    assert tune_main([*ppo, "--mode", "decode", "--n-steps", "1"]) == 2
    assert "--mode decode runs one episode at a time" in capsys.readouterr().err
    assert tune_main([*ppo, "--batch-size", "1"]) == 2
    assert "ppo needs --batch-size of at least 2" in capsys.readouterr().err
    optuna = ["train", "--algo", "optuna", "--model", "tiny-random", "--out", "o", "--no-register"]
    assert tune_main([*optuna, "--mode", "decode"]) == 2
    assert "--mode decode is for ppo or sac" in capsys.readouterr().err
    for algo in ("ppo", "sac"):
        assert tune_main([*ppo, "--algo", algo, "--objectives", "pareto"]) == 2
        assert "--objectives pareto is for optuna" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--learning-rate", "nan"], "--learning-rate must be a finite number"),
        (["--learning-rate", "inf"], "--learning-rate must be a finite number"),
        (["--log-std-init=-inf"], "--log-std-init must be a finite number"),
        (["--ent-coef", "nan"], "not NaN or infinite (sac also: auto, auto_X with finite X > 0); got 'nan'"),
        (["--algo", "sac", "--ent-coef", "auto_inf"], "not NaN or infinite (sac also: auto, auto_X with finite X > 0)"),
        (["--quality-weight", "nan"], "--quality-weight must be a finite number"),
        (["--memory-weight", "inf"], "--memory-weight must be a finite number"),
        (["--eval-every", "-1"], "--eval-every must be at least 0"),
    ],
)
def test_non_finite_numbers_are_refused(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    _no_model(monkeypatch)
    assert tune_main(["train", "--algo", "ppo", "--model", "tiny-random", "--out", "o", "--no-register", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "--n-envs" not in err


@pytest.mark.parametrize("command", ["eval", "compare"])
def test_eval_and_compare_refuse_non_finite_reward_weights(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    _no_model(monkeypatch)
    args = ["eval", "default"] if command == "eval" else ["compare", "--out", "cmp"]
    assert tune_main([*args, "--model", "tiny-random", "--no-mlflow", "--task-weight", "nan"]) == 2
    assert "--task-weight must be a finite number (got nan)" in capsys.readouterr().err


def test_help_names_every_workload_and_policy_form(capsys):
    from envs.episodes import TUNE_WORKLOADS

    with pytest.raises(SystemExit):
        tune_main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(w in text for w in TUNE_WORKLOADS) and "calibrated" in text and "registry://NAME@ALIAS" in text


def test_export_writes_a_rule_policy_to_a_yaml_name_and_refuses_a_learned_one(data, tmp_path, monkeypatch, capsys):
    """``export RUN --out best.yaml`` writes that file for a rule policy (as a registry export does), not a folder
    named best.yaml; a learned policy, a folder with its network, is refused a file name."""
    import yaml

    from tuner.tracking import log_artifacts, mlflow_run

    monkeypatch.chdir(tmp_path)
    rule = data.base_policy.replace(max_size=64)
    (tmp_path / "rule").mkdir()
    (tmp_path / "rule" / "policy.yaml").write_text(yaml.safe_dump({"cache_policy": rule.model_dump(mode="json")}))
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(4, OBS_DIM, generator=g), torch.zeros(4), "tanh"),
              (torch.randn(5, 4, generator=g), torch.zeros(5), "none")]  # fmt: skip
    learned = MLPPolicy(layers, "knobs").save(tmp_path / "net", data.base_policy)
    ids = {}
    for kind, folder in (("rule", tmp_path / "rule"), ("learned", learned)):
        with mlflow_run(None, kind, {}) as run:
            log_artifacts(folder, "policy")
        ids[kind] = run.info.run_id
    assert tune_main(["export", ids["rule"], "--out", "out/best.yaml"]) == 0
    assert capsys.readouterr().out.strip() == "out/best.yaml"
    assert (tmp_path / "out" / "best.yaml").is_file() and load_policy_file("out/best.yaml") == rule
    assert tune_main(["export", ids["learned"], "--out", "net.yml"]) == 2
    assert "holds a learned policy: it exports to a folder, not to net.yml" in capsys.readouterr().err
    assert not (tmp_path / "net.yml").exists()
    assert tune_main(["export", ids["learned"], "--out", "netdir"]) == 0
    assert load_policy_file(capsys.readouterr().out.strip()).controller == "learned"


def test_compare_takes_policy_names_mlflow_does_not(tmp_path, monkeypatch, capsys):
    """``--policy ppo+init=...``: the name keys a run parameter and metrics, sanitised as MLflow requires."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["compare", "--model", "tiny-random", "--workload", "prose", "--policy", "ppo+init=default", "--out", "c"]
    assert tune_main([*args, "--tracking-uri", uri]) == 0
    assert "| ppo+init |" in capsys.readouterr().out
    mlflow.set_tracking_uri(uri)
    (run,) = mlflow.search_runs(experiment_names=["confkv-tune"], output_format="list")
    assert run.data.params["policy.ppo_init"] == "default" and "ppo_init.kv_fraction" in run.data.metrics


def test_the_promotion_gate_refuses_non_finite_reward_weights():
    """A NaN reward compares false with everything, so the gate's verdict would be an accident: refused before the
    registry is read or the model loads."""
    from tuner.gate import run_gate

    with pytest.raises(ConfkvError, match="--quality-weight must be a finite number"):
        nan = RewardWeights(quality_weight=float("nan"))
        run_gate(None, "p", 1, "production", "prose", weights=nan)  # type: ignore[arg-type]


def test_a_network_steers_the_decode_environment_as_it_steers_the_engine(data, tmp_path):
    """The decode environment builds a learned controller's observations from the signals the engine's controller
    decided on; after a recall the token is chosen from the second pass, whose signals it used before, so a network
    trained there saw other inputs than it gets when serving, and moved the budget elsewhere."""
    from confkv.controllers.learned import LearnedController
    from envs.decode_env import ConfKVDecodeEnv

    g = torch.Generator().manual_seed(2)
    layers = [(torch.randn(16, OBS_DIM, generator=g), torch.zeros(16), "tanh"),
              (torch.randn(5, 16, generator=g), torch.randn(5, generator=g), "none")]  # fmt: skip
    folder = MLPPolicy(layers, "knobs").save(tmp_path / "net", data.base_policy)
    net = MLPPolicy.load(folder)
    env = ConfKVDecodeEnv(data)
    reruns = 0
    for i, ep in enumerate(env.episodes):
        obs, _ = env.reset(options={"episode": i})
        done = False
        while not done:
            obs, _, done, _, info = env.step(net.act(obs))
        llm = data.llm(load_policy_file(folder))
        assert isinstance(llm.engine.controller, LearnedController)
        prompt = ep.item.token_ids[: ep.prompt_len]
        n = len(ep.item.token_ids) - ep.prompt_len
        out = llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert info["summary"]["output_token_ids"] == out.token_ids, ep.item_id
        # the first token is read under the environment's start, before any action
        assert info["summary"]["budgets"][1:] == pytest.approx(out.trace.budget[1:], rel=1e-5), ep.item_id
        reruns += llm.engine.num_reruns
    assert reruns > 0  # the case that differed


def test_a_malformed_learned_policy_is_refused_at_load(data, tmp_path):
    """What would run wrong or fail inside an engine step is refused when the folder is read: an activation this
    code does not apply (it ran as none), layers that do not chain from the observation, a format version that is
    not a positive integer."""
    import json as _json

    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(8, OBS_DIM, generator=g), torch.zeros(8), "tanh"),
              (torch.randn(5, 8, generator=g), torch.zeros(5), "none")]  # fmt: skip
    folder = MLPPolicy(layers, "knobs").save(tmp_path / "net", data.base_policy)
    good = _json.loads((folder / "policy.json").read_text())
    MLPPolicy.load(folder)
    gelu = _json.loads(_json.dumps(good))
    gelu["layers"][0]["activation"] = "gelu"
    for doc, says in ((gelu, "activation 'gelu'"), ({**good, "format_version": "v3"}, "format_version"),
                      ({**good, "format_version": 0}, "format_version")):  # fmt: skip
        (folder / "policy.json").write_text(_json.dumps(doc))
        with pytest.raises(ConfkvError, match=says):
            MLPPolicy.load(folder)
    narrow = [(torch.randn(8, OBS_DIM - 1, generator=g), torch.zeros(8), "tanh"), layers[1]]
    other = MLPPolicy(narrow, "knobs").save(tmp_path / "narrow", data.base_policy)
    with pytest.raises(ConfkvError, match="input is 14 wide"):
        MLPPolicy.load(other)
