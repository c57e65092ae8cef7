"""deploy/: the Prometheus alert rules pass ``promtool check rules`` and their unit tests, and every metric the
rules and the Grafana dashboard read is one the server exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from confkv.server.metrics import ServerMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
REPO_PROMTOOL = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "promtool"
#: present only on a GPU (NVML), so not in a CPU exposition
GPU_ONLY = {"confkv:device_memory_used_bytes", "confkv:device_memory_total_bytes", "confkv:device_utilization_perc"}


def promtool() -> str:
    """The promtool `make test` fetched into .venv (Debian's prometheus package), or one on PATH."""
    path = str(REPO_PROMTOOL) if REPO_PROMTOOL.exists() else shutil.which("promtool")
    if path is None:
        msg = "promtool not found: `make .venv/bin/promtool` fetches it from Debian's prometheus package"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.mark.parametrize(
    "args",
    [
        ["check", "rules", "prometheus-alerts.yml"],
        ["test", "rules", "prometheus-alerts.test.yml"],
        ["check", "config", "prometheus.yml"],
    ],
    ids=["check-rules", "test-rules", "check-config"],
)
def test_promtool(args):
    proc = subprocess.run([promtool(), *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def exported_names() -> set[str]:
    """Every sample name a CPU server exports (a fresh metrics registry over an empty engine snapshot)."""
    m = ServerMetrics(snapshot=dict, policy_info=lambda: {"name": "full"}, health=lambda: (True, False))
    m.ttft.observe(0.1)
    text = generate_latest(m.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def referenced(text: str) -> set[str]:
    return set(re.findall(r"confkv:[a-z0-9_]+", text))


def test_alerts_and_dashboard_read_only_exported_metrics():
    names = exported_names() | GPU_ONLY
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yml").read_text())
    exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    targets = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for what, used in (("alert rules", referenced(exprs)), ("dashboard", referenced(targets))):
        assert used and used <= names, f"{what} read metrics the server does not export: {used - names}"
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {"ConfkvKVPoolNearlyFull", "ConfkvHighErrorRate", "ConfkvUnhealthy", "ConfkvCircuitBreakerTripping",
            "ConfkvPolicySwapRefused", "ConfkvSessionStoreFaults",
            "ConfkvSessionStoreUnreachable"} <= alerts  # fmt: skip
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
