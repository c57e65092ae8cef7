"""A policy's life outside one training run, on tiny-random with MLflow and the registry in a temporary folder:
``export`` writes what ``--policy-file`` loads from every source, an interrupted or failed training ends its MLflow
run KILLED or FAILED with its best policy saved and ``--resume`` goes on, and ``eval``/``compare`` explain the
reward."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from confkv.cli import main as confkv_main
from confkv.config import CachePolicy, load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM
from tuner.cli import main as tune_main
from tuner.explain import lost_retrieval, reward_lines

RULE = CachePolicy(controller="dynamic", base_size=32, max_size=128, min_recent=16, scaling_factor=0.9)


def _mlflow_run(run_id: str) -> Any:
    import mlflow

    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    return mlflow.get_run(run_id)


def _generates(policy_file: str | Path, capsys) -> None:
    """``confkv generate --policy-file`` loads it and runs (the command the issue's user ran)."""
    args = ["generate", "--model", "tiny-random", "--policy-file", str(policy_file), "--prompt", "Hello there. " * 8,
            "--max-tokens", "4", "--json"]  # fmt: skip
    assert confkv_main(args) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["generated_tokens"] == 4


def _same(a: CachePolicy, b: CachePolicy) -> bool:
    return a.model_dump(exclude={"learned_path"}) == b.model_dump(exclude={"learned_path"})


def test_export_writes_what_policy_file_loads_from_a_run_a_registry_reference_and_a_folder(
    tmp_path, monkeypatch, capsys
):
    from store.registry import Registry
    from tuner.tracking import log_artifacts, mlflow_run

    monkeypatch.chdir(tmp_path)
    rule_dir = tmp_path / "rule"
    rule_dir.mkdir()
    (rule_dir / "policy.yaml").write_text(yaml.safe_dump({"cache_policy": RULE.model_dump(mode="json")}))
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(8, OBS_DIM, generator=g) * 0.3, torch.zeros(8), "tanh"),
              (torch.randn(5, 8, generator=g) * 0.3, torch.zeros(5), "none")]  # fmt: skip
    learned_dir = MLPPolicy(layers, "knobs").save(tmp_path / "learned", RULE)
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    reg = Registry(url)
    sources: dict[str, tuple[str, Path]] = {}
    for kind, folder in (("rule", rule_dir), ("learned", learned_dir)):
        with mlflow_run(None, f"export-{kind}", {}) as run:
            log_artifacts(folder, "policy")
        info = reg.register(f"rt-{kind}", folder)
        reg.set_alias(f"rt-{kind}", "production", info.version)
        sources[f"{kind} run id"] = (run.info.run_id, folder)
        sources[f"{kind} NAME@VERSION"] = (f"rt-{kind}@{info.version}", folder)
        sources[f"{kind} registry://NAME@ALIAS"] = (f"registry://rt-{kind}@production", folder)
        sources[f"{kind} folder"] = (str(folder), folder)
    for i, (form, (source, folder)) in enumerate(sources.items()):
        out = tmp_path / f"my-policy-{i}"
        assert tune_main(["export", source, "--out", str(out), "--registry-url", url]) == 0, form
        assert capsys.readouterr().out.strip() == str(out), form
        assert (out / "policy.yaml").is_file(), form  # the folder itself holds the policy, no policy/ inside
        assert _same(load_policy_file(out), load_policy_file(folder)), form
        _generates(out, capsys)
    # a rule policy also exports to a YAML file name, from each source
    for i, source in enumerate((sources["rule run id"][0], "rt-rule@production", str(rule_dir))):
        out = tmp_path / f"rule-{i}.yaml"
        assert tune_main(["export", source, "--out", str(out), "--registry-url", url]) == 0
        assert capsys.readouterr().out.strip() == str(out)
        assert _same(load_policy_file(out), RULE)
        _generates(out, capsys)
    assert tune_main(["export", str(learned_dir), "--out", str(tmp_path / "net.yaml")]) == 2
    assert "learned policy: it exports to a folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ stopping
def _interrupt_on_call(monkeypatch, target: str, n: int, action: Any) -> None:
    """Patch ``target`` (a function looked up at call time) to run ``action()`` on its ``n``-th call."""
    module, name = target.rsplit(".", 1)
    import importlib

    real = getattr(importlib.import_module(module), name)
    calls = {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(target, wrapper)


def _stop(kind: str) -> Any:
    def raise_it() -> None:
        if kind == "SIGINT":
            raise KeyboardInterrupt
        if kind == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises at the next bytecode, inside the trial
        raise RuntimeError("the evaluation broke")

    return raise_it


@pytest.mark.parametrize(("kind", "status", "code"), [("SIGINT", "KILLED", 130), ("SIGTERM", "KILLED", 143),
                                                       ("error", "FAILED", None)])  # fmt: skip
def test_a_stopped_optuna_run_ends_killed_or_failed_with_its_best_policy_and_resumes(
    tmp_path, monkeypatch, capsys, kind, status, code
):
    """Trial 0 (the default rule, two groups of episodes) finishes; trial 1 is stopped at its first group."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "--algo", "optuna", "--model", "tiny-random", "--trials", "3", "--out", "run", "--no-register"]
    with monkeypatch.context() as m:
        _interrupt_on_call(m, "tuner.search.evaluate_policy", 3, _stop(kind))
        if code is None:
            with pytest.raises(RuntimeError, match="the evaluation broke"):
                tune_main(args)
        else:
            assert tune_main(args) == code
    err = capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == status and summary["policy"] == str(Path("run") / "policy")
    run = _mlflow_run(summary["run_id"])
    assert run.info.status == status
    assert run.data.tags["confkv.best_so_far_saved"] == "True"
    assert f"ends {status}; the best policy so far is in run/policy" in err and "--resume" in err
    kept = load_policy_file(tmp_path / "run" / "policy")
    assert (kept.base_size, kept.max_size, kept.entropy_threshold) == (32, 128, 3.5)  # trial 0: the default rule
    import mlflow

    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "policy")}
    assert "policy/policy.yaml" in names

    assert tune_main([*args, "--resume"]) == 0
    out = capsys.readouterr()
    assert "1 trials done, 2 to go" in out.err
    resumed = json.loads(out.out.strip().splitlines()[-1])
    assert _mlflow_run(resumed["run_id"]).info.status == "FINISHED"
    import optuna

    study = optuna.load_study(study_name="confkv-tiny-random-mixed-reward", storage="sqlite:///run/optuna.db")
    assert sum(t.state.name == "COMPLETE" for t in study.trials) == 3
    assert tune_main([*args, "--resume"]) == 2  # nothing left to resume
    assert "already has 3 of 3 trials" in capsys.readouterr().err


def test_an_interrupted_ppo_run_keeps_a_checkpoint_and_its_best_policy_and_resumes(tmp_path, monkeypatch, capsys):
    """Evaluations at 0 and 32 timesteps; the second is interrupted: the model at 32 timesteps is saved, the
    policy of the first (the best so far) exported, and --resume trains the 32 timesteps left."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "--algo", "ppo", "--model", "tiny-random", "--timesteps", "64", "--n-envs", "2",
            "--eval-every", "1", "--out", "run", "--no-register"]  # fmt: skip
    with monkeypatch.context() as m:
        _interrupt_on_call(m, "envs.evaluate.evaluate_agent", 2, _stop("SIGINT"))
        assert tune_main(args) == 130
    capsys.readouterr()
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert _mlflow_run(summary["run_id"]).info.status == "KILLED"
    state = json.loads((run_dir / "checkpoint.json").read_text())
    assert state["timesteps"] == 32 and state["best_updates"] == 0 and state["run_id"] == summary["run_id"]
    assert (run_dir / "ppo_sb3.zip").is_file() and (run_dir / "best_policy.pt").is_file()
    assert load_policy_file(run_dir / "policy").controller == "learned"

    assert tune_main([*args, "--resume"]) == 0
    out = capsys.readouterr()
    assert "resuming from ppo_sb3.zip at 32 timesteps" in out.err
    resumed = json.loads(out.out.strip().splitlines()[-1])
    run = _mlflow_run(resumed["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["confkv.resumed_from"] == summary["run_id"]
    assert json.loads((run_dir / "checkpoint.json").read_text())["timesteps"] == 64
    assert load_policy_file(run_dir / "policy").controller == "learned"
    assert tune_main([*args, "--resume"]) == 2
    assert "already made 64 of 64 timesteps" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the reward
def test_eval_and_compare_explain_the_reward(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert tune_main(["eval", "default", "--model", "tiny-random", "--no-mlflow"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    terms = result["reward_terms"]
    assert set(terms) == {"memory", "kl", "passkey", "multikey"}
    assert sum(t["contribution"] for t in terms.values()) == pytest.approx(result["reward"], abs=1e-9)
    assert terms["memory"]["weight"] == 1.0 and terms["kl"]["weight"] == 2.0 and terms["passkey"]["weight"] == 1.0
    assert f"reward {result['reward']:.3f} per episode" in out.err
    for words in ("memory: weight 1", "KL: weight 2", "pass keys: weight 1", "multi-keys: weight 1"):
        assert words in out.err
    assert tune_main(["compare", "--model", "tiny-random", "--out", "cmp", "--no-mlflow"]) == 0
    capsys.readouterr()
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "## How the reward is made (mean per episode)" in md and "| retrieval |" in md
    assert "| policy | reward | = memory | + KL | + pass keys | + multi-keys | retrieval against full |" in md
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert all("reward_terms" in r and "retrieval_lost" in r for r in rows)
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0


def test_a_policy_that_loses_retrieval_is_flagged():
    metrics = {"reward": 2.149, "episodes": 10, "segments_mean": 11.0, "passkey_acc": 0.0, "full_passkey_acc": 1.0,
               "multikey_acc": 1.0, "full_multikey_acc": 1.0,
               "reward_terms": {"memory": {"weight": 1.0, "contribution": 2.5},
                                "kl": {"weight": 2.0, "contribution": -0.351},
                                "passkey": {"weight": 1.0, "contribution": 0.0, "episodes": 2, "of": 10},
                                "multikey": {"weight": 1.0, "contribution": 0.1, "episodes": 1, "of": 10}}}  # fmt: skip
    assert lost_retrieval(metrics) == ["pass keys 0% (full 100%)"]
    text = "\n".join(reward_lines(metrics))
    assert "RETRIEVAL LOST: pass keys 0% (full 100%)" in text
    assert "+ 2.500  memory" in text and "- 0.351  KL" in text
    assert not lost_retrieval({**metrics, "passkey_acc": 1.0})


# ------------------------------------------------------------------------------------------------ make run's demo
def test_demo_prints_a_summary_table_and_writes_the_figures(tmp_path, capsys):
    run = tmp_path / "runs" / "quick"
    (run / "policy").mkdir(parents=True)
    (run / "policy" / "policy.yaml").write_text(yaml.safe_dump({"cache_policy": RULE.model_dump(mode="json")}))
    train = {"run_id": "abc123", "tracking_uri": "sqlite:///mlflow.db",
             "train": {"reward": 1.5, "kv_fraction": 0.3, "kl_mean": 0.17, "passkey_acc": 0.0},
             "default": {"reward": 1.2, "kv_fraction": 0.6, "kl_mean": 0.06, "passkey_acc": 1.0},
             "registry": {"name": "tiny-random-mixed", "version": 3, "ref": "registry://tiny-random-mixed@3",
                          "url": "sqlite:///reg.db"}}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(train))
    assert tune_main(["demo", "--model", "tiny-random", "--policy-file", str(run / "policy")]) == 0
    text = capsys.readouterr().out
    expected = ("policy", "KV share", "pass keys", "chat answer vs full", "full cache (keeps everything)",
                "default rule", "tuned (", "What the numbers mean:", "MLflow run abc123",
                "Registry version registry://tiny-random-mixed@3",
                "confkv-tune promote tiny-random-mixed 3")  # fmt: skip
    for words in expected:
        assert words in text, words
    result = json.loads((run / "demo.json").read_text())
    rows = {r["policy"]: r for r in result["policies"]}
    assert set(rows) == {"full", "default", "tuned"} and rows["full"]["kv_share"] == pytest.approx(1.0, abs=0.02)
    assert rows["full"]["chat_rougeL_vs_full"] == pytest.approx(1.0)
    assert min(rows["default"]["kv_share"], rows["tuned"]["kv_share"]) < 0.9  # the prompts are long enough to evict
