"""``--full-fits``, ``--max-batch-size`` and ``--max-num-batched-tokens``: the operating point of the throughput
and longgen suites (issue 34's pool-size sweep) overrides the stream's spec for every row, and the report says which
point it ran at."""

from __future__ import annotations

import dataclasses
import json

import pytest

from confkv.bench.streams import TINY_LONGGEN, pool_bytes_for
from confkv.cli import main
from tests.conftest import fresh_tiny


def test_full_fits_and_max_batch_size_reach_the_stream_and_its_report(tmp_path, capsys):
    """A pool of 3 full-cache copies of the longest request (the tiny stream's own is 2) and at most 2 sequences a
    step: the pool is the bytes ``pool_bytes_for`` gives for 3, no row runs more than 2 at once although the pool
    holds more, and results.json and report.md record both."""
    out = tmp_path / "op"
    args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,dynamic", "--scenarios",
            "longgen", "--requests", "4", "--full-fits", "3", "--max-batch-size", "2", "--no-hf",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert settings["full_fits"] == 3 and settings["max_batch_size"] == 2 and settings["requests"] == 4
    assert TINY_LONGGEN.full_fits != 3 and TINY_LONGGEN.max_batch_size != 2  # the flags, not the defaults
    expected = pool_bytes_for(fresh_tiny(), dataclasses.replace(TINY_LONGGEN, full_fits=3), 16)
    assert settings["kv_cache_memory_bytes"] == expected
    rows = results["longgen"]["policies"]
    assert all(m["max_running"] == 2 for m in rows.values()), {k: m["max_running"] for k, m in rows.items()}
    assert "= 3 full-cache sequences of the longest request; max_batch_size 2" in (out / "report.md").read_text()


def test_the_longgen_suite_takes_the_operating_point_and_bad_values_are_one_line(tmp_path, capsys):
    out = tmp_path / "curves"
    args = ["bench", "--model", "tiny-random", "--suite", "longgen", "--runs", "2", "--policies", "full",
            "--full-fits", "1", "--max-batch-size", "1", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["full_fits"] == 1 and results["settings"]["max_batch_size"] == 1
    bad = ["bench", "--model", "tiny-random", "--suite", "throughput", "--scenarios", "longgen", "--out", "unused"]
    for flag, value, least in (
        ("--full-fits", "0", 1),
        ("--max-batch-size", "-3", 1),
        ("--max-num-batched-tokens", "8", 16),
    ):
        assert main([*bad, flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} takes a whole number of at least {least}" in err, err
    with pytest.raises(SystemExit) as usage:  # argparse's own usage error
        main([*bad, "--full-fits", "two"])
    assert usage.value.code == 2


def test_max_num_batched_tokens_reaches_every_row_of_the_throughput_suite(tmp_path, capsys):
    """Smaller chunks of 32 tokens (the tiny stream's own are 128): every row, ``full`` too, reads its 200-300
    token prompts in more steps, and the settings and report say which chunk ran. Without the flag the suite ran
    the stream's own chunk whatever was asked (issue 34: the chunk decides how much room admitting a request needs)."""
    steps = {}
    for chunk in (None, 32):
        out = tmp_path / f"chunk-{chunk}"
        args = ["bench", "--model", "tiny-random", "--suite", "throughput", "--policies", "full,dynamic",
                "--scenarios", "longgen", "--requests", "2", "--no-hf", "--out", str(out)]  # fmt: skip
        assert main(args + (["--max-num-batched-tokens", str(chunk)] if chunk else [])) == 0
        capsys.readouterr()
        results = json.loads((out / "results.json").read_text())
        assert results["settings"]["max_num_batched_tokens"] == (chunk or TINY_LONGGEN.max_num_batched_tokens)
        assert (
            f"max_num_batched_tokens {chunk or TINY_LONGGEN.max_num_batched_tokens}" in (out / "report.md").read_text()
        )
        steps[chunk] = {name: len(trace) for name, trace in results["running_trace"]["longgen"].items()}
    assert TINY_LONGGEN.max_num_batched_tokens == 128 and set(steps[None]) == {"full", "dynamic"}
    for name in steps[None]:  # two prompts of 200-300 tokens: 2-3 chunks each at 128, 7-10 at 32
        assert steps[32][name] >= steps[None][name] + 4, (name, steps)
