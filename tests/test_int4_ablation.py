"""``benchmarks/int4_ablation.py`` (issue 35): its ``engine_vgG`` modes round as the engine's int4 pool does, so
their measurements of other value groups stand beside ``kv_cache_dtype: int4`` itself."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench_scripts import ROOT


def _run(script: str, *args: str) -> dict:
    run = [sys.executable, str(ROOT / "benchmarks" / script), "--model", "tiny-random", "--json", "--threads", "1"]
    return json.loads(subprocess.run([*run, *args], check=True, capture_output=True, text=True, cwd=ROOT).stdout)


def test_engine_mode_is_the_engines_int4_and_values_exact_cost_less() -> None:
    fake = _run("int4_ablation.py", "--modes", "engine_vg32,engine_vg0")
    engine = _run("kv_dtypes.py", "--dtypes", "auto,int4", "--no-step")
    assert fake["auto_ppl"] == engine["auto_ppl"]
    assert abs(fake["engine_vg32_ppl"] / engine["int4_ppl"] - 1) < 1e-6, (fake, engine["int4_ppl"])
    assert fake["engine_vg0_ppl"] != fake["engine_vg32_ppl"]
