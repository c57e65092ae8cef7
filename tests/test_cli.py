import json
import subprocess
import sys

import pytest

from confkv.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_has_every_field(capsys):
    code, out, _ = run_cli(
        capsys, "generate", "--model", "tiny-random", "--policy", "dynamic", "--set", "base_size=32",
        "--set", "max_size=64", "--set", "min_recent=16", "--prompt", "hello there " * 20, "--max-tokens", "12",
        "--ignore-eos", "--json", "--max-num-batched-tokens", "32",
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert {"text", "token_ids", "prompt_tokens", "generated_tokens", "kv", "signals", "timing"} <= doc.keys()
    assert len(doc["token_ids"]) == doc["generated_tokens"] == 12
    assert doc["kv"]["full_tokens"] == doc["prompt_tokens"] + 12
    for key in ("peak_resident_tokens", "mean_resident_tokens", "peak_device_bytes", "evicted_blocks",
                "recalled_blocks", "host_peak_bytes"):  # fmt: skip
        assert key in doc["kv"]
    assert doc["kv"]["peak_resident_tokens"] <= 64 + 32 + 16  # max_size plus one prefill chunk (and a block)
    for sig in ("entropy", "gap", "top1_prob"):
        assert set(doc["signals"][sig]) == {"mean", "min", "max"}
    assert {"prefill_s", "decode_s", "tokens_per_s"} <= doc["timing"].keys()


def test_policy_file_names_the_controller(capsys, tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("cache_policy:\n  controller: window\n  max_size: 48\n  min_recent: 16\n")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("abc " * 40)
    code, out, _ = run_cli(
        capsys, "generate", "--model", "tiny-random", "--policy-file", str(f), "--prompt-file", str(prompt),
        "--max-tokens", "20", "--ignore-eos", "--json", "--max-num-batched-tokens", "16",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["kv"]["peak_resident_tokens"] <= 48 + 16 + 16


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "x" * 5000], "context"),
        (["--prompt", "hi", "--policy", "clever"], "unknown policy 'clever'"),
        (["--prompt", "hi", "--set", "scaling_factor=0"], "scaling_factor"),
        (["--prompt", "hi", "--set", "base_size=4096", "--set", "max_size=1024"], "max_size (1024) must be >="),
        (["--prompt", "hi", "--set", "entropy_threshold=-1"], "entropy_threshold"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt-file", "/no/such/file"], "cannot read prompt file"),
        (["--prompt", "hi", "--set", "nonsense=3"], "unknown policy key"),
        (["--prompt", "hi", "--seed", str(2**64)], "seed"),
        (["--prompt", "hi", "--stop", ""], "stop strings must not be empty"),
        (["--prompt", "hi", "--kv-cache-memory", "0"], "kv_cache_memory"),
        (["--prompt", "hi", "--kv-cache-memory", "100TiB"], "cannot allocate a KV pool"),
    ],
)
def test_bad_input_exits_nonzero_with_a_message(capsys, args, fragment):
    code, out, err = run_cli(capsys, "generate", "--model", "tiny-random", *args)
    assert code == 2 and out == ""
    assert fragment in err and "Traceback" not in err


def test_a_policy_file_that_is_not_text_is_a_user_error(capsys, tmp_path):
    f = tmp_path / "bin.yaml"
    f.write_bytes(b"\xff\xfe\x00garbage")
    code, out, err = run_cli(capsys, "generate", "--model", "tiny-random", "--prompt", "hi", "--policy-file", str(f))
    assert code == 2 and out == ""
    assert "is not UTF-8 text" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--temperature", "1e-300"], ["--temperature", "1", "--top-p", "1e-300"]])
def test_extreme_sampling_values_still_sample(capsys, args):
    """A temperature under float32's range is greedy (as in vLLM), a top_p under it keeps the top token: neither
    may end in NaN probabilities (a failed request once printed a traceback from the summary)."""
    code, out, err = run_cli(
        capsys, "generate", "--model", "tiny-random", "--prompt", "hi", "--max-tokens", "3", "--json", *args
    )
    assert code == 0 and "Traceback" not in err
    doc = json.loads(out)
    assert doc["finish_reason"] == "length" and doc["generated_tokens"] == 3


def test_missing_model_and_usage_errors(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", "/no/such/model", "--prompt", "hi")
    assert code == 2 and "not found" in err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "tiny-random"])  # neither --prompt nor --prompt-file
    assert exc.value.code == 2


def test_console_script_reports_errors_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "confkv.cli", "generate", "--model", "tiny-random", "--prompt", "   "],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "confkv: error: prompt is empty"


def test_score_json(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Scoring a text teacher-forced under a policy. " * 12)
    code, out, _ = run_cli(
        capsys, "score", "--model", "tiny-random", "--policy", "window", "--set", "max_size=128",
        "--set", "min_recent=64", "--text-file", str(text), "--max-tokens", "300", "--json",
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert doc["tokens"] == 300 and doc["ppl"] > 1
    assert doc["kv"]["full_tokens"] == 301
    assert doc["kv"]["mean_resident_tokens"] < 128 + 50 + 16
    for key in ("peak_resident_tokens", "peak_device_bytes", "evicted_blocks", "recalled_blocks", "host_peak_bytes"):
        assert key in doc["kv"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--text-file", "/no/file"], "cannot read text file"),
        (["--text-file", "EMPTY"], "text is empty"),
        (["--text-file", "SHORT", "--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_score_errors(capsys, tmp_path, args, fragment):
    (tmp_path / "EMPTY").write_text("  \n")
    (tmp_path / "SHORT").write_text("abc")
    args = [str(tmp_path / a) if a in ("EMPTY", "SHORT") else a for a in args]
    code, _, err = run_cli(capsys, "score", "--model", "tiny-random", *args)
    assert code == 2 and fragment in err


def test_version_prints_the_installed_package_version(capsys):
    from importlib.metadata import version

    from tuner.cli import main as tune_main

    for prog, entry in (("confkv", main), ("confkv-tune", tune_main)):
        with pytest.raises(SystemExit) as exit_info:
            entry(["--version"])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.strip() == f"{prog} {version('confkv')}"
