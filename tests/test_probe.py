"""``confkv-tune probe``: the gain of a larger budget and how well each observed feature predicts it, with
bootstrap intervals over items; the statistics on data whose answer is known."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest

from envs.probe import SEGMENT_FEATURES, TOKEN_FEATURES, ItemProbe
from tuner.cli import main as tune_main
from tuner.probe_stats import feature_table, markdown


def _synthetic(n_items: int, seed: int) -> list[ItemProbe]:
    """Items whose ``entropy`` is the gain plus a little noise, ``gap`` its negative and the rest noise."""
    rng = np.random.default_rng(seed)
    probes = []
    for i in range(n_items):
        seg = rng.gamma(2.0, 1.0, 20)
        tok = rng.gamma(2.0, 1.0, 60)
        sf = {f: rng.normal(size=seg.size) for f in SEGMENT_FEATURES}
        sf["entropy"], sf["gap"] = seg + 0.01 * rng.normal(size=seg.size), -seg
        tf = {f: rng.normal(size=tok.size) for f in TOKEN_FEATURES}
        tf["entropy"] = tok
        probes.append(ItemProbe(f"item-{i}", "prose", seg, sf, tok, tf))
    return probes


def test_a_feature_that_is_the_gain_predicts_it_and_noise_does_not():
    rows, gains = feature_table(_synthetic(12, 0), resamples=200, seed=0)
    by = {(r.level, r.feature): r for r in rows}
    ent, gap, pos = by["segment", "entropy"], by["segment", "gap"], by["segment", "position"]
    assert ent.auc > 0.95 and ent.auc_lo > 0.9 and ent.rho > 0.95
    assert gap.auc < 0.05 and gap.rho < -0.95  # a smaller gap means a larger gain: informative too
    assert pos.auc_lo < 0.5 < pos.auc_hi and pos.rho_lo < 0 < pos.rho_hi  # noise: the interval holds 0.5 and 0
    assert by["token", "entropy"].auc == pytest.approx(1.0)
    assert {g.level for g in gains} == {"segment", "token"} and all(g.items == 12 for g in gains)
    seg_gain = next(g for g in gains if g.level == "segment")
    assert seg_gain.gain_lo < seg_gain.gain_mean < seg_gain.gain_hi
    assert "| entropy | 1.00 [" in markdown(rows, gains, "t")


def test_probe_writes_its_table_with_intervals_and_logs_mlflow(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["probe", "--model", "tiny-random", "--workloads", "prose,passkey", "--items", "3", "--resamples", "100",
            "--out", "p", "--tracking-uri", uri]  # fmt: skip
    assert tune_main(args) == 0
    doc = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert {g["workload"] for g in doc["gain"]} == {"prose", "passkey"}
    assert doc["budgets"]["small"]["max_size"] == doc["budgets"]["small"]["base_size"]
    prose = [r for r in doc["features"] if r["workload"] == "prose" and r["level"] == "token"]
    assert {r["feature"] for r in prose} == set(TOKEN_FEATURES)
    for r in prose:  # hundreds of tokens from three items: every interval is defined and holds its estimate
        assert r["items"] == 3 and r["n"] > 100
        assert r["auc_lo"] <= r["auc_hi"] and r["rho_lo"] <= r["rho_hi"]
    table = (tmp_path / "p" / "probe.md").read_text()
    assert "## prose, per segment (3 items" in table and "## passkey, per token" in table
    assert " [" in table and table in capsys.readouterr().out
    mlflow.set_tracking_uri(uri)
    run = mlflow.search_runs(experiment_names=["confkv-tune"], output_format="list")[0]
    assert run.data.tags["confkv.kind"] == "probe"
    assert "prose.token.entropy.auc_lo" in run.data.metrics
    assert {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)} >= {"probe.md", "probe.json"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workloads", "prose,poetry"], "--workloads takes names from"),
        (["--items", "1"], "--items must be at least 2"),
    ],
)
def test_probe_refuses_bad_input_in_one_line(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    assert tune_main(["probe", "--model", "tiny-random", "--out", "p", "--no-mlflow", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
