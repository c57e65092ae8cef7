"""Prometheus metrics for the server, all named ``confkv:...`` and spelled as vLLM spells its own where one exists.

Three sources, each read where it is cheap and safe:

* The engine's own counters and gauges (``LLMEngine.stats()``: pool use, evictions, recalls, breaker trips, policy
  swaps ...) are copied into a snapshot by the engine thread after every step, and a custom ``Collector`` turns the
  snapshot into metric families at scrape time. A scrape therefore never touches the engine from the HTTP thread,
  and counters stay monotonic because the engine's are.
* Per-token and per-request distributions (signals, resident KV, TTFT, inter-token and end-to-end latency, token
  counts, finish reasons) are observed by the engine thread from each step's outputs.
* Device memory through NVML (``nvidia-ml-py``, imported as ``pynvml``), only when the engine runs on CUDA and the
  package is installed; on a CPU machine those metrics are absent rather than zero.

Sessions (``confkv.sessions.tiers``) come from the same snapshot (``stats()["session_*"]``): hits by the tier the
session was found in, misses, mismatches, reused tokens, offloads to the object store, store faults by kind, the
sessions and bytes held per tier, and whether the store answered its last call. The restore latency histogram is
observed by the engine thread from ``engine.sessions.drain_restore_seconds()`` (every restore from the store, also
those whose request was aborted meanwhile).

``confkv:request_errors_total{kind}`` joins the first two: the kinds the server counts itself (``ERROR_KINDS``: the
4xx answers, 503s, a step that raised, internal errors) and the engine's own count of the requests it failed
(``stats()["request_errors_by_kind"]``, exported as ``engine_<kind>``). Each failure is counted once, by whichever
side saw it.

Each server gets its own ``CollectorRegistry`` so several apps (tests) can live in one process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

#: kinds of request errors the server counts in ``confkv:request_errors``; zero-initialised so every series exists.
#: ``engine`` is a request failed because an exception escaped ``step()`` (the engine did not count it itself).
ERROR_KINDS: tuple[str, ...] = (
    "bad_request",
    "unauthorized",
    "not_found",
    "conflict",
    "too_large",
    "timeout",
    "unavailable",
    "engine",
    "internal",
)
#: kinds of ``stats()["request_errors_by_kind"]``: a request that can never fit the pool, a forward pass that raised
#: for it alone, a failed sampling step. Exported as ``engine_<kind>`` (``too_large`` alone would read as the 413).
ENGINE_ERROR_KINDS: tuple[str, ...] = ("too_large", "forward", "sampling")
ENGINE_ERROR_PREFIX = "engine_"
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
#: session tiers and store fault kinds (``confkv.sessions.state.TIERS``, ``confkv.sessions.store.FAULT_KINDS``),
#: restated so that every series exists from the start (and this module imports no torch).
SESSION_TIERS: tuple[str, ...] = ("device", "host", "store")
SESSION_FAULT_KINDS: tuple[str, ...] = ("unavailable", "corrupt", "foreign", "error")
#: session counters read from ``engine.stats()``: metric name (without _total) -> (stats key, help)
SESSION_COUNTERS: dict[str, tuple[str, str]] = {
    "confkv:session_misses": (
        "session_misses",
        "Session requests that found no kept KV (new session, expired, deleted) and computed the whole prompt.",
    ),
    "confkv:session_mismatches": (
        "session_mismatches",
        "Session requests whose prompt did not extend the kept history (only the common prefix was reused).",
    ),
    "confkv:session_tokens_reused": ("session_tokens_reused", "Prompt tokens whose KV came from a session."),
    "confkv:session_offloads": (
        "session_offloads",
        "Sessions the object store confirmed written (and freed from memory); attempts and failures are apart.",
    ),
    "confkv:session_offload_attempts": ("session_offload_attempts", "Sessions handed to the object-store writer."),
    "confkv:session_offload_failures": (
        "session_offload_failures",
        "Session writes the object store did not take (the session then lives only in what its next request sends).",
    ),
    "confkv:session_store_tokens_repaired": (
        "session_tokens_repaired",
        "Damaged tokens objects found beside a sound record and written again from it (also counted as corrupt).",
    ),
}

#: gauges read from ``engine.stats()``: metric name -> (stats key, help)
ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "confkv:num_requests_running": ("running", "Requests in the running batch."),
    "confkv:num_requests_waiting": ("waiting", "Requests waiting to be scheduled."),
    "confkv:kv_cache_usage_perc": ("pool_usage", "Fraction of the device KV pool in use (1 = full)."),
    "confkv:kv_cache_used_blocks": ("pool_used_blocks", "KV pool blocks in use."),
    "confkv:kv_cache_blocks": ("pool_blocks", "KV pool blocks in all."),
    "confkv:kv_cache_used_bytes": ("pool_used_bytes", "Bytes of the device KV pool in use."),
    "confkv:kv_cache_total_bytes": ("pool_total_bytes", "Bytes of the device KV pool."),
    "confkv:kv_cache_tokens": ("pool_tokens", "Tokens the device KV pool holds when full (at its kv_cache_dtype)."),
    "confkv:kv_cache_bytes_per_token": ("pool_bytes_per_token", "Bytes one token's K and V take in the pool."),
    "confkv:kv_cache_committed_blocks": (
        "committed_blocks",
        "KV blocks promised to admitted requests (on demand: those they hold).",
    ),
    "confkv:host_cache_used_bytes": ("host_used_bytes", "Bytes of evicted KV held in the host tier."),
    "confkv:demoted_kv_used_bytes": ("demoted_used_bytes", "Bytes of demoted (low-precision) KV on the device."),
    "confkv:float_window_used_bytes": (
        "float_window_used_bytes",
        "Bytes of the float window's exact copies of the newest tokens' KV (kv_float_window).",
    ),
    "confkv:breaker_tripped": ("breaker_tripped", "1 while the circuit breaker holds sequences at their floor."),
}
#: counters read from ``engine.stats()`` (monotonic there): metric name (without _total) -> (stats key, help)
ENGINE_COUNTERS: dict[str, tuple[str, str]] = {
    "confkv:evicted_blocks": ("evicted_blocks", "KV blocks moved from the device to the host tier."),
    "confkv:recalled_blocks": ("recalled_blocks", "KV blocks brought back from the host tier."),
    "confkv:recall_hits": ("recall_hits", "Recall queries that brought back at least one block."),
    "confkv:recall_queries": ("recall_queries", "Recall queries (hit rate = recall_hits / recall_queries)."),
    "confkv:prompt_reselections": ("reselections", "Prompts whose last query re-picked the blocks they keep."),
    "confkv:budget_expansions": ("expansions", "Times a sequence's KV budget grew (uncertain steps)."),
    "confkv:budget_contractions": ("contractions", "Times a sequence's KV budget shrank."),
    "confkv:budget_expansions_refused": ("refused_expansions", "Budget expansions refused for lack of free blocks."),
    "confkv:breaker_trips": ("breaker_trips", "Circuit-breaker trips (pool use above the high watermark)."),
    "confkv:num_preemptions": ("preemptions", "Sequences preempted for memory (swapped or recomputed)."),
    "confkv:swap_preemptions": ("swap_preemptions", "Preemptions that swapped the sequence's blocks to the host."),
    "confkv:swapped_tokens": ("swapped_tokens", "Computed tokens whose KV was swapped to the host on preemption."),
    "confkv:preempted_recomputed_tokens": (
        "preempted_recomputed_tokens",
        "Computed tokens dropped on preemption (to be recomputed).",
    ),
    "confkv:recomputed_tokens": ("recomputed_tokens", "Tokens recomputed after preemption or recall."),
    "confkv:engine_steps": ("steps", "Engine steps (forward passes)."),
    "confkv:policy_swaps": ("policy_swaps", "Cache-policy swaps applied while serving."),
    "confkv:policy_swaps_refused": ("policy_swaps_refused", "Cache-policy swaps refused (invalid or corrupt)."),
}

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_ENTROPY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 11.0)
_GAP_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
_RESIDENT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_RESTORE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineCollector(Collector):
    """Turns the engine thread's latest ``stats()`` snapshot, policy and health into metric families at scrape."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        policy_info: Callable[[], dict[str, Any]],
        health: Callable[[], tuple[bool, bool]],
    ) -> None:
        self._snapshot = snapshot
        self._policy_info = policy_info
        self._health = health

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked collector: families are produced at collect time

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot() or {}
        for name, (key, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0) or 0))
        for name, (key, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0) or 0))
        info = self._policy_info() or {}
        fam = GaugeMetricFamily(
            "confkv:policy_info", "The cache policy in force (value 1).", labels=["name", "version", "source"]
        )
        fam.add_metric([str(info.get("name", "")), str(info.get("version") or ""), str(info.get("source", ""))], 1.0)
        yield fam
        healthy, draining = self._health()
        yield GaugeMetricFamily("confkv:healthy", "1 while /health answers 200.", value=1.0 if healthy else 0.0)
        yield GaugeMetricFamily("confkv:draining", "1 after SIGTERM, while requests drain.", value=float(draining))
        yield from session_families(stats)


def session_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """The session metrics of one ``engine.stats()`` snapshot; every series exists (at 0) before the first session."""

    def labelled(
        fam: CounterMetricFamily | GaugeMetricFamily, values: dict[str, Any] | None, keys: tuple[str, ...]
    ) -> CounterMetricFamily | GaugeMetricFamily:
        values = values or {}
        for key in keys:
            fam.add_metric([key], float(values.get(key, 0) or 0))
        return fam

    yield labelled(
        CounterMetricFamily(
            "confkv:session_hits",
            "Session requests that reused kept KV, by the tier the session was found in (store = restored).",
            labels=["tier"],
        ),
        stats.get("session_hits"),
        SESSION_TIERS,
    )
    for name, (key, doc) in SESSION_COUNTERS.items():
        yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0) or 0))
    yield labelled(
        CounterMetricFamily(
            "confkv:session_store_faults",
            "Session store faults by kind (unreachable or slow, corrupt record, record of another model, any other "
            "failure of a store call); each one "
            "fell back to recomputation or, for a write, left the session to its next request's prompt.",
            labels=["kind"],
        ),
        stats.get("session_faults"),
        SESSION_FAULT_KINDS,
    )
    yield labelled(
        GaugeMetricFamily("confkv:sessions", "Sessions kept between requests, by tier.", labels=["tier"]),
        stats.get("sessions"),
        SESSION_TIERS,
    )
    yield labelled(
        GaugeMetricFamily(
            "confkv:session_bytes", "Bytes of KV kept for sessions between requests, by tier.", labels=["tier"]
        ),
        stats.get("session_bytes"),
        ("device", "host"),
    )
    written = (stats.get("session_bytes") or {}).get("store_written", 0)
    yield CounterMetricFamily(
        "confkv:session_store_written_bytes", "Bytes written to the session store.", value=float(written or 0)
    )
    reachable = stats.get("session_store_reachable")
    yield GaugeMetricFamily(
        "confkv:session_store_reachable",
        "0 while the session store's last call failed; 1 otherwise (also with no store configured).",
        value=0.0 if reachable is False else 1.0,
    )


class RequestErrors(Collector):
    """``confkv:request_errors``: the server's own kinds, counted here, with the engine's, read from its snapshot."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)

    def inc(self, kind: str) -> None:
        with self._lock:
            self._counts[kind if kind in ERROR_KINDS else "internal"] += 1

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = dict(self._counts)
        engine = dict.fromkeys(ENGINE_ERROR_KINDS, 0)
        engine.update((self._snapshot() or {}).get("request_errors_by_kind", {}))
        fam = CounterMetricFamily(
            "confkv:request_errors",
            "Failed requests by kind: the server's (4xx, unavailable, engine, internal) and the engine's (engine_*).",
            labels=["kind"],
        )
        for kind, n in counts.items():
            fam.add_metric([kind], float(n))
        for kind, n in engine.items():
            fam.add_metric([ENGINE_ERROR_PREFIX + kind], float(n))
        yield fam


class NvmlCollector(Collector):
    """Device memory of the engine's GPU from NVML; the handle is found by UUID so CUDA_VISIBLE_DEVICES is honoured."""

    def __init__(self, device_index: int) -> None:
        import pynvml
        import torch

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._label = str(device_index)
        handle = None
        try:
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:
            handle = None
        self._handle = handle if handle is not None else pynvml.nvmlDeviceGetHandleByIndex(device_index)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        try:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        except Exception as err:  # a driver hiccup must not break the whole scrape
            log.warning("NVML read failed: %s", err)
            return
        for name, doc, value in (
            ("confkv:device_memory_used_bytes", "Device memory in use (NVML, all processes).", mem.used),
            ("confkv:device_memory_total_bytes", "Device memory in all (NVML).", mem.total),
            ("confkv:device_utilization_perc", "GPU utilisation over the last sample period (NVML, 0..1).", None),
        ):
            fam = GaugeMetricFamily(name, doc, labels=["device"])
            fam.add_metric([self._label], float(value) if value is not None else util.gpu / 100.0)
            yield fam


def make_nvml_collector(device: Any) -> NvmlCollector | None:
    """An NVML collector for a CUDA device, or None on CPU / without nvidia-ml-py / without a driver."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    try:
        import torch

        index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
        return NvmlCollector(int(index))
    except ImportError:
        log.warning("running on CUDA without nvidia-ml-py: device memory metrics are off (pip install nvidia-ml-py)")
    except Exception as err:
        log.warning("NVML unavailable, device memory metrics are off: %s", err)
    return None


class ServerMetrics:
    """Every metric of one server; observation methods are called from the engine thread (prometheus_client locks)."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        policy_info: Callable[[], dict[str, Any]],
        health: Callable[[], tuple[bool, bool]],
        device: Any = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = histogram(
            "confkv:time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "confkv:inter_token_latency_seconds", "Time between two generated tokens of one request.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "confkv:e2e_request_latency_seconds", "Time from request arrival to its last token.", _LATENCY_BUCKETS
        )
        self.entropy = histogram(
            "confkv:token_entropy_nats",
            "Entropy of the next-token distribution at each generated token.",
            _ENTROPY_BUCKETS,
        )
        self.gap = histogram(
            "confkv:token_top1_gap", "Top-1 minus top-2 probability at each generated token.", _GAP_BUCKETS
        )
        self.resident = histogram(
            "confkv:resident_kv_tokens",
            "KV tokens a sequence attended over on the device, per generated token.",
            _RESIDENT_BUCKETS,
        )
        self.session_restore = histogram(
            "confkv:session_restore_seconds",
            "Time to read and check a session's record from the object store (request waiting meanwhile).",
            _RESTORE_BUCKETS,
        )
        self.prompt_tokens = Counter("confkv:prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("confkv:generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(
            "confkv:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.request_errors = RequestErrors(snapshot)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        r.register(self.request_errors)
        r.register(EngineCollector(snapshot, policy_info, health))
        nvml = make_nvml_collector(device) if device is not None else None
        if nvml is not None:
            r.register(nvml)

    def error(self, kind: str) -> None:
        """Count a failure the server saw itself (``ERROR_KINDS``; anything else counts as ``internal``)."""
        self.request_errors.inc(kind)
