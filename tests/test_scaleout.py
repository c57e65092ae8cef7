"""``confkv serve --replicas N`` on Ray Serve: two tiny-random replicas with half a CPU each on a local Ray cluster
(``ray.init(num_cpus=2)``), started once for the module through the launcher ``confkv serve --replicas`` uses.

What must hold across replicas: the official client streams through the one endpoint; a session's turns stay on one
replica; killing that replica's actor leaves the session's next turn to the other replica, resumed from the shared
store (written through after each turn); a policy swap reaches both; ``/metrics`` and ``/health`` answer for both.
Without Ray (or where it cannot start) these tests skip with the reason; the tests that Ray stays out of a plain
``confkv serve`` and that bad flags are one-line errors run without it.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from confkv.config import CachePolicy
from confkv.scaleout.options import ScaleOut

MODEL = "tiny-random"
KEY = "scaleout-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPO = Path(__file__).resolve().parents[1]


class Endpoint:
    """The deployment's one HTTP endpoint, by the standard library (headers are what these tests read); ``prefix``:
    the application's route prefix on Ray's proxy."""

    def __init__(self, url: str, prefix: str = "") -> None:
        self.url = url + prefix
        u = urlsplit(url)
        self.host, self.port, self.prefix = u.hostname, u.port, prefix

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                timeout: float = 60.0) -> tuple[int, dict[str, str], Any]:  # fmt: skip
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, self.prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            text = resp.read().decode()
            hdrs = {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()
        try:
            return resp.status, hdrs, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, hdrs, text

    def chat(self, messages: list[dict[str, str]], session: str | None = None, **extra: Any):
        headers = {**AUTH, **({"x-session-id": session} if session else {})}
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "ignore_eos": True, **extra}
        return self.request("POST", "/v1/chat/completions", body, headers)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Ray with 2 CPUs, two replicas of 0.5 CPU each, one shared session folder; stopped after the module."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'confkv[ray]')")
    from confkv.cli import build_parser
    from confkv.scaleout import launch
    from confkv.scaleout.options import scaleout_from_args

    store = tmp_path_factory.mktemp("sessions")
    args = build_parser().parse_args(
        ["serve", "--model", MODEL, "--policy", "full", "--api-key", KEY, "--session-store", str(store),
         "--replicas", "2", "--replica-cpus", "0.5", "--host", "127.0.0.1", "--port", "0", "--shutdown-grace", "5"]
    )  # fmt: skip
    scale = scaleout_from_args(args)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster: no token file under ~/.ray
    try:
        url = launch.start(args, scale, num_cpus=2)
    except Exception as err:  # no room for Ray's processes, no /dev/shm, ...
        if ray.is_initialized():
            ray.shutdown()
        pytest.skip(f"Ray Serve could not start here: {type(err).__name__}: {str(err)[:300]}")
    yield Endpoint(url), store
    launch.stop(scale)


def _replicas_seen(ep: Endpoint, path: str, want: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Ask ``path`` until ``want`` different replicas have answered (power of two spreads them); their answers."""
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        status, headers, body = ep.request("GET", path, headers=AUTH)
        assert status == 200, body
        seen[headers["x-confkv-replica"]] = body
    assert len(seen) == want, f"only {sorted(seen)} answered {path}"
    return seen


def test_the_openai_client_streams_through_the_endpoint(cluster):
    openai = pytest.importorskip("openai")
    ep, _ = cluster
    client = openai.OpenAI(base_url=ep.url + "/v1", api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                            max_tokens=8, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    raw = client.models.with_raw_response.list()
    assert raw.headers["x-confkv-replica"] and raw.parse().data[0].id == MODEL


def test_api_key_and_errors_are_the_servers(cluster):
    ep, _ = cluster
    status, headers, body = ep.request("POST", "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["x-confkv-replica"]
    status, _, body = ep.chat([{"role": "user", "content": "hi"}], model="other")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = ep.chat([{"role": "user", "content": "hi"}], session="a", session_id="b")
    assert status == 400 and body["error"]["param"] == "session_id"


def test_health_and_metrics_answer_for_both_replicas(cluster):
    ep, _ = cluster
    answers = _replicas_seen(ep, "/health", 2)
    assert all(a["status"] == "ok" and a["replicas"] == 2 for a in answers.values())
    ep.chat([{"role": "user", "content": "count me"}])
    status, _, text = ep.request("GET", "/metrics")
    assert status == 200
    labels = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith(("confkv:kv_cache_blocks{", "confkv:engine_steps_total{"))}  # fmt: skip
    assert labels == set(answers), text[:2000]
    assert text.count("# TYPE confkv:time_to_first_token_seconds histogram") == 1  # one family, both replicas' series


def test_a_policy_swap_reaches_every_replica(cluster):
    ep, _ = cluster
    status, _, body = ep.request("PUT", "/v1/cache_policy", {"controller": "full", "max_size": 2048}, AUTH)
    assert status == 200, body
    version = body["version"]
    deadline = time.monotonic() + 30
    while True:
        answers = _replicas_seen(ep, "/v1/cache_policy", 2)
        if all(a["version"] == version for a in answers.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {a["policy"]["max_size"] for a in answers.values()} == {2048}
    status, _, _ = ep.request("PUT", "/v1/cache_policy", {"controller": "full", "max_size": 4096}, AUTH)
    assert status == 200


def test_a_sessions_turns_stay_on_one_replica_and_survive_its_death(cluster):
    import ray

    ep, store = cluster
    messages: list[dict[str, str]] = []
    replicas, usages = [], []
    for turn in ("Tell me about the sea.", "And what lives in it?", "Summarise in one line."):
        messages.append({"role": "user", "content": turn})
        status, headers, body = ep.chat(messages, session="sea-1")
        assert status == 200, body
        replicas.append(headers["x-confkv-replica"])
        usages.append(body["usage"])
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert len(set(replicas)) == 1 and all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages[1:])
    assert (store / "sea-1.record").exists()  # written through after each turn
    holder = replicas[0]
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(holder)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    messages.append({"role": "user", "content": "One more thing?"})
    # Ray's router finds the dead actor when it probes it and routes the request on: no request fails, none waits
    status, headers, body = ep.chat(messages, session="sea-1")
    assert status == 200, body
    assert headers["x-confkv-replica"] != holder
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # resumed from the store, not recomputed


def test_scaleout_flags_map_to_ray_serve_options():
    plain = ScaleOut(replicas=2, num_cpus=0.5, max_queued_requests=8).deployment_options()
    assert plain["num_replicas"] == 2 and plain["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert plain["max_queued_requests"] == 8 and "autoscaling_config" not in plain
    auto = ScaleOut(replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=3).deployment_options()
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                          "target_ongoing_requests": 3}  # fmt: skip


def test_write_through_is_on_under_replicas_unless_turned_off():
    from confkv.cli import build_parser
    from confkv.scaleout.options import replica_args

    def given(*flags: str) -> dict[str, Any]:
        return replica_args(build_parser().parse_args(["serve", "--model", MODEL, "--replicas", "2", *flags]))

    assert given()["session_write_through"] is True
    assert given("--no-session-write-through")["session_write_through"] is False
    assert "replicas" not in given() and given()["model"] == MODEL  # the deployment's flags stay out of a replica's


def _cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "confkv.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "replicas"),
        (["--replicas", "3", "--max-replicas", "2"], "outside"),
        (["--replicas", "1", "--max-queued-requests", "0"], "--max-queued-requests"),
    ],
)
def test_bad_scaleout_flags_are_one_line_errors(flags, message):
    out = _cli("serve", "--model", MODEL, *flags)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_ray_stays_out_of_a_plain_server():
    """``import confkv``, the CLI and a plain ``confkv serve``'s modules never import Ray (only ``--replicas`` does)."""
    code = (
        "import sys, confkv, confkv.cli, confkv.server.main\n"
        "confkv.cli.build_parser().parse_args(['serve', '--model', 'tiny-random'])\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = _cli(code=code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_ray_cluster_config_and_application_file_build():
    """``deploy/ray/serve.yaml`` is a valid Serve config, and its application file builds the application from it."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'confkv[ray]')")
    import importlib

    import yaml
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "deploy" / "ray" / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    module, _, attr = app.import_path.partition(":")
    built = getattr(importlib.import_module(module), attr)(app.args)
    assert isinstance(built, Application)
    options = built._bound_deployment._deployment_config
    assert options.max_queued_requests == 128 and options.autoscaling_config.max_replicas == 8


def test_replicas_metrics_merge_into_one_exposition():
    """Two replicas' registries: one family each in the output, every sample labelled with its replica (no Ray)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.parser import text_string_to_metric_families

    from confkv.scaleout.link import labelled, render

    by_replica = {}
    for name, n in (("r1", 2), ("r2", 5)):
        registry = CollectorRegistry()
        Counter("confkv:requests", "requests", ["kind"], registry=registry).labels("chat").inc(n)
        Histogram("confkv:ttft_seconds", "ttft", buckets=(0.1, 1.0), registry=registry).observe(0.5)
        by_replica[name] = labelled(registry.collect(), name)
    text = render(by_replica).decode()
    assert text.count("# TYPE confkv:requests_total counter") == 1
    families = {f.name.removesuffix("_total"): f for f in text_string_to_metric_families(text)}
    totals = {s.labels["replica"]: s.value for s in families["confkv:requests"].samples if s.name.endswith("_total")}
    assert totals == {"r1": 2.0, "r2": 5.0}
    counts = [s for s in families["confkv:ttft_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["replica"] for s in counts) == ["r1", "r2"]


#: The second application's name and route prefix (``tight``).
TIGHT = "confkv-tight"


@pytest.fixture(scope="module")
def tight(cluster, tmp_path_factory):
    """A second application beside the first, on the same Ray Serve and session store, under ``/tight``: two
    replicas that run one request each with one more queued (beyond: 429), follow a registry alias, keep their
    sessions in memory only (``--no-session-write-through``), so that only their drain puts them in the store, and
    autoscale between one and two (Ray scales down only after ten idle minutes: these tests keep both)."""
    registry = pytest.importorskip("store.registry", reason="the policy registry (store/) is not installed")
    from ray import serve

    from confkv.cli import build_parser
    from confkv.scaleout.app import build_application
    from confkv.scaleout.hub import remove_hub
    from confkv.scaleout.options import scaleout_from_args

    ep, store = cluster
    reg_url = f"sqlite:///{tmp_path_factory.mktemp('registry') / 'registry.db'}"
    reg = registry.Registry(reg_url)
    reg.register("tight", CachePolicy(controller="window", max_size=96))
    reg.promote("tight", 1)
    args = build_parser().parse_args(
        ["serve", "--model", MODEL, "--policy", "registry://tight@production", "--registry-url", reg_url,
         "--policy-poll-interval", "0.2", "--api-key", KEY, "--session-store", str(store), "--no-session-write-through",
         "--replicas", "2", "--replica-cpus", "0.5", "--max-ongoing-requests", "1", "--max-queued-requests", "1",
         "--retry-after-s", "3", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "1",
         "--shutdown-grace", "5"]
    )  # fmt: skip
    serve.run(build_application(args, scaleout_from_args(args), app_name=TIGHT), name=TIGHT, route_prefix="/tight")
    yield Endpoint(ep.url, "/tight"), reg
    serve.delete(TIGHT)  # a no-op where the drain test deleted it
    remove_hub(TIGHT)


def test_autoscaling_bounds_reach_ray_serve(tight):
    from ray.serve.context import _get_global_client

    deployment = _get_global_client().get_serve_details()["applications"][TIGHT]["deployments"]["ConfkvReplica"]
    auto = deployment["deployment_config"]["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 2, 1)
    assert deployment["target_num_replicas"] == 2  # --replicas: the initial count
    config = deployment["deployment_config"]
    assert (config["max_ongoing_requests"], config["max_queued_requests"]) == (1, 1)


def test_requests_beyond_the_running_and_queued_limits_get_429_at_once(tight):
    """Two replicas each running one request and one request queued: of eight slow streams sent at once, the rest
    are refused with 429 and ``Retry-After`` at once, and none hangs."""
    ep, _ = tight
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long answer please"}], "max_tokens": 160,
            "ignore_eos": True, "stream": True}  # fmt: skip

    def one(_: int) -> tuple[int, dict[str, str], float]:
        t0 = time.monotonic()
        status, headers, _ = ep.request("POST", "/v1/chat/completions", body, AUTH, timeout=60)
        return status, headers, time.monotonic() - t0

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    statuses = sorted(r[0] for r in results)
    refused = [(headers, dt) for status, headers, dt in results if status == 429]
    assert set(statuses) <= {200, 429} and refused and statuses.count(200) >= 2, statuses
    assert all(h.get("retry-after") == "3" for h, _ in refused), refused
    served = max(dt for status, _, dt in results if status == 200)
    assert all(dt < served for _, dt in refused), results  # refused before the streams they waited behind ended


def test_every_replica_follows_a_moved_registry_alias(tight):
    ep, reg = tight
    first = _replicas_seen(ep, "/v1/cache_policy", 2)
    assert {(a["version"], a["policy"]["controller"]) for a in first.values()} == {("1", "window")}
    reg.register("tight", CachePolicy(controller="full"))
    reg.promote("tight", 2)
    deadline = time.monotonic() + 30
    while True:
        answers = _replicas_seen(ep, "/v1/cache_policy", 2)
        if all(a["version"] == "2" for a in answers.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert set(answers) == set(first)  # the same two replicas, each following the alias on its own
    assert {(a["version"], a["policy"]["controller"]) for a in answers.values()} == {("2", "full")}


def test_a_removed_replica_writes_its_sessions_to_the_store_first(cluster, tight):
    """Without write-through a session lives in its replica's memory; deleting the application (what a scale-down
    does to one replica) drains every replica, which writes the session to the shared store, and the other
    application's replica resumes it from there."""
    from ray import serve

    main, store = cluster
    ep, _ = tight
    messages = [{"role": "user", "content": "Tell me about the mountains."}]
    for follow_up in ("And who climbs them?", None):
        status, _, body = ep.chat(messages, session="drain-1")
        assert status == 200, body
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the second turn reused the first's KV
    assert not (store / "drain-1.record").exists()  # held in memory only
    serve.delete(TIGHT)  # waits for the replicas to stop
    assert (store / "drain-1.record").exists()
    messages.append({"role": "user", "content": "Which is the highest?"})
    status, _, body = main.chat(messages, session="drain-1")
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # resumed from the store, not recomputed
