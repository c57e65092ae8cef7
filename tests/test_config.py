from pathlib import Path

import pytest

from confkv.config import CachePolicy, load_policy_file, make_policy, parse_overrides
from confkv.errors import ConfkvError
from confkv.policy_source import resolve_policy


def test_defaults_are_the_requirements():
    p = CachePolicy()
    assert (p.base_size, p.max_size, p.entropy_threshold, p.gap_threshold, p.scaling_factor) == (
        1024,
        4096,
        3.5,
        0.15,
        0.8,
    )
    assert (p.min_recent, p.sink_tokens, p.block_size, p.compact_interval, p.memory_high_watermark) == (
        512,
        4,
        16,
        50,
        0.9,
    )


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"base_size": 2048, "max_size": 1024}, "max_size (1024) must be >= base_size (2048)"),
        ({"scaling_factor": 0.0}, "scaling_factor"),
        ({"scaling_factor": 1.5}, "scaling_factor"),
        ({"entropy_threshold": -1}, "entropy_threshold"),
        ({"gap_threshold": -0.1}, "gap_threshold"),
        ({"controller": "nope"}, "controller must be one of"),
        ({"block_size": 0}, "block_size"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_invalid_values_name_the_field(values, fragment):
    with pytest.raises(ConfkvError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make_policy(values)


def test_base_equal_to_max_is_valid():
    assert make_policy({"base_size": 2048, "max_size": 2048}).base_size == 2048


def test_yaml_file_and_overrides(tmp_path: Path):
    f = tmp_path / "p.yaml"
    f.write_text("cache_policy:\n  controller: h2o\n  max_size: 777\n  min_recent: 64\n")
    assert load_policy_file(f).controller == "h2o"
    p = resolve_policy(None, f, ["max_size=900", "scaling_factor=0.5"])
    assert (p.controller, p.max_size, p.scaling_factor, p.min_recent) == ("h2o", 900, 0.5, 64)
    # a controller name given beside the file wins over the file's
    assert resolve_policy("window", f).controller == "window"
    # ... and a preset ranks its own way, whatever scorer the file's dynamic rule named (it was refused)
    ranked = tmp_path / "ranked.yaml"
    ranked.write_text("cache_policy:\n  controller: dynamic\n  scorer: h2o\n  max_size: 1024\n  base_size: 256\n")
    assert resolve_policy("window", ranked).effective_scorer == "recency"


def test_set_values_are_read_as_written():
    """``--set`` numbers are decimal (YAML 1.1 read ``0512`` as octal 330 and ``1:30`` as base-60 90)."""
    got = parse_overrides(["max_size=0512", "scaling_factor=1e-1", "reselect_after_prompt=true", "scorer=h2o",
                           "host_cache_memory=2GiB", "memory_low_watermark=null", "entropy_threshold=-3"])  # fmt: skip
    assert got == {"max_size": 512, "scaling_factor": 0.1, "reselect_after_prompt": True, "scorer": "h2o",
                   "host_cache_memory": "2GiB", "memory_low_watermark": None, "entropy_threshold": -3}  # fmt: skip
    with pytest.raises(ConfkvError, match="compact_interval"):
        resolve_policy(None, None, ["compact_interval=1:30"])


def test_bad_files_and_keys(tmp_path: Path):
    with pytest.raises(ConfkvError, match="not found"):
        load_policy_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_size: 3\n")
    with pytest.raises(ConfkvError, match="cache_policy"):
        load_policy_file(bad)
    with pytest.raises(ConfkvError, match="unknown policy key"):
        parse_overrides(["nope=1"])
    with pytest.raises(ConfkvError, match="KEY=VALUE"):
        parse_overrides(["max_size"])
    with pytest.raises(ConfkvError, match="unknown policy 'best'"):
        resolve_policy("best")
