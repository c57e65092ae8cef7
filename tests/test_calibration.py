"""``confkv calibrate``: thresholds from the model's own signals, written as a policy file that loads and that the
model's default policy then uses."""

from __future__ import annotations

import json

import pytest
import yaml

from confkv.calibration import calibrated_thresholds, calibration_path
from confkv.cli import _make_llm, build_parser
from confkv.cli import main as confkv_main
from confkv.config import load_policy_file
from confkv.errors import ConfkvError
from confkv.llm import LLM
from confkv.policy_source import resolve_policy


def test_calibrate_writes_a_policy_the_default_policy_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONFKV_CALIBRATION", str(tmp_path / "cal"))
    assert calibrated_thresholds("tiny-random") is None
    assert confkv_main(["calibrate", "--model", "tiny-random", "--tokens", "300"]) == 0
    doc = json.loads(capsys.readouterr().out)
    path = calibration_path("tiny-random")
    assert doc["path"] == str(path) == str(tmp_path / "cal" / "tiny-random.yaml")

    # the file is a policy file: its thresholds are the measured quantiles, which it records
    policy = load_policy_file(path)
    meta = yaml.safe_load(path.read_text())["calibration"]
    assert policy.controller == "dynamic" and 250 < meta["tokens"] <= 300
    assert policy.entropy_threshold == pytest.approx(meta["entropy_quantiles"]["0.8"], abs=1e-4)
    assert policy.gap_threshold == pytest.approx(meta["gap_quantiles"]["0.2"], abs=1e-4)
    assert (meta["entropy_quantile"], meta["gap_quantile"]) == (0.8, 0.2) and "train split" in meta["text"]
    assert 0.2 <= meta["uncertain_share"] <= 0.4  # each test alone: a fifth of the tokens
    assert "the entropy 20% of tokens exceed" in path.read_text()

    # ... and the default policy for the model takes it: by name, unnamed, through `confkv generate`
    cal = {"entropy_threshold": policy.entropy_threshold, "gap_threshold": policy.gap_threshold}
    for llm in (LLM("tiny-random", "dynamic"), LLM("tiny-random")):
        assert {k: getattr(llm.policy, k) for k in cal} == cal
    args = build_parser().parse_args(["generate", "--model", "tiny-random", "--policy", "dynamic", "--prompt", "x"])
    assert _make_llm(args).policy.entropy_threshold == policy.entropy_threshold
    # explicit choices still win; other models and other controllers are untouched
    assert LLM("tiny-random", "dynamic", entropy_threshold=1.5).policy.entropy_threshold == 1.5
    assert resolve_policy("dynamic", model="smollm2-135m").entropy_threshold == 3.5
    assert resolve_policy("h2o", model="tiny-random").entropy_threshold == 3.5
    assert resolve_policy("dynamic").entropy_threshold == 3.5  # no model named: the requirement's rule

    # --out writes elsewhere and leaves the default alone; a broken calibration is an error, not ignored
    other = tmp_path / "elsewhere.yaml"
    args = ["calibrate", "--model", "tiny-random", "--tokens", "100", "--gap-quantile", "0.5", "--out", str(other)]
    assert confkv_main(args) == 0
    assert load_policy_file(other).gap_threshold != policy.gap_threshold
    assert calibrated_thresholds("tiny-random") == cal
    path.write_text("cache_policy: {entropy_threshold: -1}\n")
    with pytest.raises(ConfkvError, match="confkv calibrate"):
        LLM("tiny-random")


def test_calibrate_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONFKV_CALIBRATION", "off")
    assert calibration_path("tiny-random") is None and calibrated_thresholds("tiny-random") is None
    assert confkv_main(["calibrate", "--model", "tiny-random"]) == 2
    assert "--out" in capsys.readouterr().err
    out = str(tmp_path / "c.yaml")
    assert confkv_main(["calibrate", "--model", "tiny-random", "--entropy-quantile", "1.5", "--out", out]) == 2
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert confkv_main(["calibrate", "--model", "tiny-random", "--text-file", str(short), "--out", out]) == 2
    assert "too short" in capsys.readouterr().err
    folder = tmp_path / "folder"
    folder.mkdir()
    for bad in (str(folder), str(tmp_path / "new") + "/"):  # refused before the scoring, with no temporary left
        assert confkv_main(["calibrate", "--model", "tiny-random", "--out", bad]) == 2
        assert "is a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "short.txt"]


def test_a_calibration_of_other_weights_is_not_used(tmp_path, monkeypatch, capsys):
    """A local model re-exported in place (new weights, the same path) does not take the thresholds measured on
    the old ones: the calibration records the files it measured."""
    import os

    from confkv.model_loader import tiny_random_model, tiny_random_tokenizer

    monkeypatch.setenv("CONFKV_CALIBRATION", str(tmp_path / "cal"))
    folder = tmp_path / "ckpt"
    tiny_random_model(0).save_pretrained(folder)
    tiny_random_tokenizer().save_pretrained(folder)
    assert confkv_main(["calibrate", "--model", str(folder), "--tokens", "100"]) == 0
    capsys.readouterr()
    assert calibrated_thresholds(str(folder)) is not None
    tiny_random_model(1).save_pretrained(folder)
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert calibrated_thresholds(str(folder)) is None
    assert LLM(str(folder), "dynamic").policy.entropy_threshold == 3.5  # the requirement's, until recalibrated
