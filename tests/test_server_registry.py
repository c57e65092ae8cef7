"""A server following a registry alias: each promotion changes the policy the next requests use without a
restart, and a corrupt version is refused and counted while serving goes on."""

from __future__ import annotations

import sqlite3
import time
from concurrent.futures import Future

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from confkv.config import CachePolicy
from tests.server_proc import ServerProcess

registry = pytest.importorskip("store.registry", reason="the policy registry (store/) is not installed")

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('registry') / 'registry.db'}"
    r = registry.Registry(url)
    r.register("srv", CachePolicy(controller="window", max_size=96))
    r.promote("srv", 1)
    return url, r


@pytest.fixture(scope="module")
def server(reg):
    url, _ = reg
    proc = ServerProcess(
        "--model", MODEL, "--kv-cache-memory", "16MiB", "--policy", "registry://srv@production",
        "--registry-url", url, "--policy-poll-interval", "0.1",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.log


def scrape(server) -> dict[str, list]:
    _, text = server.request("GET", "/metrics")
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def total(server, family: str) -> float:
    return next(s.value for s in scrape(server)[family] if s.name == family + "_total")


def current(server) -> dict:
    status, doc = server.request("GET", "/v1/cache_policy")
    assert status == 200
    return doc


def wait_for(pred, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_alias_moves_swap_the_policy_and_corrupt_versions_are_refused(server, reg):
    url, r = reg
    doc = current(server)
    assert doc["version"] == "1" and doc["source"] == "registry://srv@production"
    assert doc["policy"]["controller"] == "window" and doc["policy"]["max_size"] == 96
    swaps = total(server, "confkv:policy_swaps")

    r.register("srv", CachePolicy(controller="full"))
    r.promote("srv", 2)
    wait_for(lambda: current(server)["version"] == "2", "the promotion was not followed")
    assert current(server)["policy"]["controller"] == "full"
    assert total(server, "confkv:policy_swaps") == swaps + 1
    info = [s.labels for s in scrape(server)["confkv:policy_info"]]
    assert len(info) == 1 and info[0]["version"] == "2" and info[0]["source"].startswith("registry:")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="p" * 200, max_tokens=20, extra_body={"ignore_eos": True})
    assert out.model_extra["kv"]["mean_resident_tokens"] >= 200  # full keeps everything: the new policy is in use

    refused = total(server, "confkv:policy_swaps_refused")
    r.register("srv", CachePolicy(controller="window", max_size=32))
    with sqlite3.connect(url.removeprefix("sqlite:///")) as db:  # flip the stored artifact: its checksum fails
        db.execute("UPDATE confkv_policy_versions SET artifact = ? WHERE version = 3", (b"not the policy",))
    r.promote("srv", 3)
    wait_for(lambda: total(server, "confkv:policy_swaps_refused") == refused + 1, "the corrupt version was not refused")
    assert current(server)["version"] == "2"
    assert server.request("GET", "/health")[0] == 200
    out = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert out.usage.completion_tokens >= 1


class _EngineThreadRecorder:
    """What ``follow_policy`` hands policies to, recorded (the engine thread's two calls it makes)."""

    def __init__(self) -> None:
        self.applied: list[CachePolicy] = []
        self.refused: list[str] = []

    def set_policy(self, policy: CachePolicy, *, source: str, version: str | None, name: str | None = None) -> Future:
        self.applied.append(policy)
        done: Future = Future()
        done.set_result(None)
        return done

    def refuse_policy(self, source: str, reason: str) -> None:
        self.refused.append(reason)


def test_a_followed_version_keeps_the_servers_overrides(tmp_path):
    """``confkv serve --policy registry://... --override k=v`` applies the override to every version it swaps in,
    as it did to the start policy; a version the override cannot apply to is refused."""
    from confkv.policy_source import choose_policy
    from confkv.server.main import follow_policy

    url = f"sqlite:///{tmp_path / 'r.db'}"
    r = registry.Registry(url)
    r.register("ovr", CachePolicy(controller="window", max_size=96))
    r.promote("ovr", 1)
    et = _EngineThreadRecorder()
    choice = choose_policy(None, "registry://ovr@production", ["max_size=64"], registry_url=url)
    w = follow_policy(choice, et, interval_s=0.05, registry_url=url)
    try:
        r.register("ovr", CachePolicy(controller="window", max_size=128))
        r.promote("ovr", 2)
        wait_for(lambda: et.applied, "the promotion was not followed")
        assert et.applied[0].max_size == 64 and et.applied[0].controller == "window"
        r.register("ovr", CachePolicy(controller="dynamic", base_size=128, max_size=256, min_recent=32))
        r.promote("ovr", 3)  # max_size 64 under base_size 128: the override does not apply to this version
        wait_for(lambda: et.refused, "the version the override cannot apply to was not refused")
        assert len(et.applied) == 1 and "max_size" in et.refused[0] and w.watcher.current_version == 2
    finally:
        w.stop()
