"""The engine's gauges and counters in one dictionary: what ``/metrics``, ``confkv generate --json`` and the
benchmarks read. Counters are monotonic since the engine started."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from confkv.engine.engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict[str, Any]:
    s, m, pool, host = engine.scheduler, engine.manager, engine.pool, engine.host
    return {
        "pool_blocks": pool.num_blocks,
        "pool_used_blocks": pool.num_used,
        "pool_usage": pool.usage,
        "pool_used_bytes": pool.used_bytes,
        "pool_total_bytes": pool.total_bytes,
        "pool_tokens": pool.num_tokens,
        "pool_bytes_per_token": pool.bytes_per_token,
        "kv_cache_dtype": pool.kv_cache_dtype,
        "kv_float_window": pool.window.tokens if pool.window is not None else 0,
        "float_window_used_bytes": pool.window.used_bytes if pool.window is not None else 0,
        "committed_blocks": s.committed_total(),
        "host_used_bytes": host.used_bytes,
        "host_peak_bytes": host.peak_bytes,
        "demoted_used_bytes": m.demoted.used_bytes,
        "demoted_peak_bytes": m.demoted.peak_bytes,
        "demoted_blocks": m.demoted.demoted_blocks,
        "running": len(s.running),
        "waiting": len(s.waiting),
        "evicted_blocks": m.evicted_blocks,
        "recalled_blocks": m.recalled_blocks,
        "recall_hits": m.recall_hits,
        "recall_queries": m.recall_queries,
        "reselections": m.reselections,
        "expansions": m.expansions,
        "refused_expansions": s.refused_expansions,
        "contractions": m.contractions,
        "breaker_trips": s.breaker_trips,
        "breaker_tripped": s.tripped,
        "admission": s.admission,
        "preemptions": s.preemptions,
        "swap_preemptions": s.swap_preemptions,
        "recompute_preemptions": s.preemptions - s.swap_preemptions,
        "swapped_tokens": s.swapped_tokens,
        "preempted_recomputed_tokens": s.recomputed_tokens,
        "recomputed_tokens": s.recomputed_tokens + engine.recall.rerun_tokens,
        "steps": engine.num_steps,
        "reruns": engine.recall.num_reruns,
        "policy_swaps": engine.policy_swaps,
        "policy_swaps_refused": engine.policy_swaps_refused,
        "request_errors": sum(engine.request_errors.values()),
        "request_errors_by_kind": dict(engine.request_errors),
        **engine.sessions.stats(),
    }
