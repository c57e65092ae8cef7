"""The state-dependence check: a learned policy against its own constant (the ``dynamic`` rule with the network's
median knobs over the decisions it took), in ``confkv-tune compare`` and in the registry's promotion gate."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM
from envs.constant import median_knobs, own_constant, paired_margin
from envs.episodes import default_base_policy
from store.registry import Registry
from tuner.cli import main as tune_main

BASE = default_base_policy("tiny-random")


def blind_network(where: Path, bias: list[float] | None = None) -> Path:
    """A knobs network that ignores its input: zero weights, so its action is its bias whatever it observes."""
    b = torch.tensor(bias or [0.0] * 5)
    return MLPPolicy(layers=[(torch.zeros(5, OBS_DIM), b, "none")], action="knobs").save(where, BASE)


def seeing_network(where: Path) -> Path:
    """A knobs network whose action depends on what it observes (random weights)."""
    g = torch.Generator().manual_seed(3)
    layers = [(torch.randn(8, OBS_DIM, generator=g), torch.zeros(8), "tanh"),
              (torch.randn(5, 8, generator=g) * 0.3, torch.zeros(5), "none")]  # fmt: skip
    return MLPPolicy(layers=layers, action="knobs").save(where, BASE)


def blind_budget_network(where: Path, action: int) -> Path:
    """A budget network that ignores its input: contract (0), hold (1) or expand (2) whatever it observes."""
    bias = torch.zeros(3)
    bias[action] = 1.0
    return MLPPolicy(layers=[(torch.zeros(3, OBS_DIM), bias, "none")], action="budget").save(where, BASE)


def test_paired_margin_and_median_knobs():
    a = [{"item": f"i{k}", "reward": 1.0 + 0.1 * k} for k in range(8)]
    b = [{"item": f"i{k}", "reward": 0.5 + 0.1 * k + (0.05 if k % 2 else -0.05)} for k in range(8)]
    m = paired_margin(a, list(reversed(b)))  # paired by item, not by order
    assert m.mean == pytest.approx(0.5) and m.lo < 0.5 < m.hi and m.above_zero and m.items == 8
    same = paired_margin(a, a)
    assert (same.mean, same.lo, same.hi, same.above_zero) == (0.0, 0.0, 0.0, False)
    with pytest.raises(ValueError, match="same items"):
        paired_margin(a, b[:4])
    decisions = [{"entropy_threshold": e, "gap_threshold": 0.1, "scaling_factor": 0.8, "base_size": s, "max_size": m}
                 for e, s, m in [(1.0, 32, 96), (2.0, 56, 40), (9.0, 64, 160)]]  # fmt: skip
    knobs = median_knobs(decisions, BASE)
    assert knobs["entropy_threshold"] == 2.0 and knobs["base_size"] == 64  # 56 to whole blocks of 16
    assert knobs["max_size"] == 96 and knobs["max_size"] >= knobs["base_size"]
    constant = own_constant(BASE.replace(controller="learned", learned_path="/x"), knobs)
    assert constant.controller == "dynamic" and constant.learned_path is None and constant.entropy_threshold == 2.0


def test_compare_reports_each_learned_policy_against_its_constant(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blind, seeing = blind_network(tmp_path / "blind"), seeing_network(tmp_path / "seeing")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["compare", "--model", "tiny-random", "--workload", "prose", "--items-scale", "2", "--policy",
            f"blind={blind}", "--policy", f"seeing={seeing}", "--policy", "rule=default", "--out", "cmp",
            "--tracking-uri", uri]  # fmt: skip
    assert tune_main(args) == 0
    out = capsys.readouterr().out
    assert "## State dependence" in out and "| blind constant | dynamic |" in out
    checks = json.loads((tmp_path / "cmp" / "state_dependence.json").read_text())
    assert set(checks) == {"blind", "seeing"}  # the rule policy has no constant of its own
    blind_margin = checks["blind"]["margins"]["constant"]
    # the blind network sets the base knobs every time: its constant is the base rule, which it equals item by item
    assert checks["blind"]["knobs"]["entropy_threshold"] == pytest.approx(BASE.entropy_threshold)
    assert blind_margin == {"mean": 0.0, "lo": 0.0, "hi": 0.0, "items": 4, "above_zero": False}
    assert "vs rule:" in out and checks["blind"]["margins"]["rule"]["mean"] == 0.0
    # networks are paired with each other too (a learned policy against the network it started from), both ways
    assert checks["blind"]["margins"]["seeing"]["mean"] == pytest.approx(-checks["seeing"]["margins"]["blind"]["mean"])
    assert "vs seeing:" in out and "vs blind:" in out
    seen = checks["seeing"]
    assert seen["decisions"] > 4 and seen["margins"]["constant"]["lo"] <= seen["margins"]["constant"]["hi"]
    rows = {r["policy"]: r for r in json.loads((tmp_path / "cmp" / "compare.json").read_text())}
    assert rows["seeing"]["reward"] - rows["seeing constant"]["reward"] == pytest.approx(
        seen["margins"]["constant"]["mean"], abs=1e-9
    )
    mlflow.set_tracking_uri(uri)
    run = mlflow.search_runs(experiment_names=["confkv-tune"], output_format="list")[0]
    assert run.data.metrics["blind.margin_constant"] == 0.0 and "seeing.margin_constant_lo" in run.data.metrics


def test_the_gate_refuses_a_network_that_ignores_its_input(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/reg.db"
    reg = Registry(url)
    # knobs far from the base's: whatever it sets, a network that ignores its input is its own constant
    reg.register("blind", blind_network(tmp_path / "blind", [0.5, -0.5, 0.3, 0.5, 0.5]), model="tiny-random")
    assert tune_main(["promote", "blind", "1", "--check", "prose", "--registry-url", url]) == 1
    out, err = capsys.readouterr()
    assert "its constant: dynamic with entropy_threshold 5.75, gap_threshold 0.075" in out
    assert "does not beat its own constant: margin +0.0000 (95% CI [+0.0000, +0.0000]" in err
    assert reg.alias_version("blind") is None  # refused although nothing was under production to lose against
    (evaluation,) = reg.evaluations("blind")
    assert evaluation.metrics["state_dependence"]["margin"]["above_zero"] is False
    # a rule policy has no network and no constant to beat: promoted as before
    reg.register("blind", BASE, model="tiny-random")
    assert tune_main(["promote", "blind", "2", "--check", "prose", "--registry-url", url]) == 0
    assert reg.alias_version("blind") == 2
    assert np.isfinite(reg.evaluations("blind")[-1].reward)


def test_recording_the_decisions_changes_nothing_the_network_does(tmp_path):
    from confkv.config import load_policy_file
    from envs.constant import evaluate_with_actions
    from envs.env import RewardWeights
    from envs.episodes import build_episodes
    from envs.evaluate import evaluate_policy

    data = build_episodes("tiny-random", workload="prose", split="heldout")
    policy = load_policy_file(seeing_network(tmp_path / "seeing"))
    plain = evaluate_policy(data, policy, RewardWeights())
    recorded, decisions = evaluate_with_actions(data, policy, RewardWeights())
    assert [r["reward"] for r in recorded["per_episode"]] == [r["reward"] for r in plain["per_episode"]]
    assert len(decisions) >= sum(r["segments"] for r in plain["per_episode"]) - len(plain["per_episode"])
    assert len({d["entropy_threshold"] for d in decisions}) > 2  # it acts on what it sees


def test_a_budget_network_is_checked_against_its_most_frequent_action_held_constant(tmp_path, monkeypatch, capsys):
    ties = [{"budget_action": a} for a in (2, 0, 2, 0, 1)]
    assert median_knobs(ties, BASE) == {"budget_action": 0}  # a tie goes to the smallest action
    assert median_knobs([{"budget_action": a} for a in (2, 2, 1)], BASE) == {"budget_action": 2}
    monkeypatch.chdir(tmp_path)
    expand = blind_budget_network(tmp_path / "expand", 2)
    args = ["compare", "--model", "tiny-random", "--workload", "prose", "--items-scale", "2", "--policy",
            f"expand={expand}", "--out", "cmp", "--no-mlflow"]  # fmt: skip
    assert tune_main(args) == 0
    assert "| expand constant | learned |" in capsys.readouterr().out
    check = json.loads((tmp_path / "cmp" / "state_dependence.json").read_text())["expand"]
    # a network that expands whatever it sees is its own constant: margin exactly 0
    assert check["decisions"] > 4 and check["knobs"] == {"budget_action": 2}
    assert check["margins"]["constant"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0, "items": 4, "above_zero": False}


def test_the_gate_refuses_a_budget_network_that_ignores_its_input(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/reg.db"
    reg = Registry(url)
    # a network that holds whatever it sees: its constant is itself
    reg.register("hold", blind_budget_network(tmp_path / "hold", 1), model="tiny-random")
    assert tune_main(["promote", "hold", "1", "--check", "prose", "--registry-url", url]) == 1
    out, err = capsys.readouterr()
    assert "its constant: the budget network that always takes hold" in out
    assert "does not beat its own constant" in err
    assert reg.alias_version("hold") is None
