"""A sequence's KV state as the cache manager keeps it: block table, controller, applied budget, statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from confkv.controllers import Controller
from confkv.kv.block_table import BlockTable


@dataclass
class KVStats:
    """Per-sequence KV accounting, reported with every output."""

    evicted_blocks: int = 0
    recalled_blocks: int = 0
    recall_hits: int = 0
    dropped_blocks: int = 0
    expansions: int = 0
    peak_resident_tokens: int = 0
    peak_device_blocks: int = 0
    host_bytes: int = 0
    host_peak_bytes: int = 0
    demoted_peak_bytes: int = 0  # the most its demoted blocks (``demote_dtype``) held on the device
    window_peak_bytes: int = 0  # the most its float window's copies (``kv_float_window``) held on the device
    window_bytes_sum: int = 0  # over the steps that reserved its slots: its float window's bytes after each
    window_steps: int = 0
    resident_sum: int = 0  # over generated tokens: tokens resident when each was computed
    resident_count: int = 0

    def summary(self, full_tokens: int, bytes_per_block: int, block_size: int) -> dict[str, Any]:
        """The ``kv`` fields every output reports (generation and scoring alike). Tokens come with their bytes at the
        pool's ``kv_cache_dtype``, the measure that compares a quantised cache with a float one."""
        per_token = bytes_per_block / block_size
        mean = self.resident_sum / self.resident_count if self.resident_count else 0.0
        return {
            "peak_resident_tokens": self.peak_resident_tokens,
            "mean_resident_tokens": mean,
            "full_tokens": full_tokens,
            "bytes_per_token": per_token,
            "peak_resident_bytes": round(self.peak_resident_tokens * per_token),
            "mean_resident_bytes": mean * per_token,
            "full_bytes": round(full_tokens * per_token),
            "peak_device_bytes": self.peak_device_blocks * bytes_per_block,
            "evicted_blocks": self.evicted_blocks,
            "recalled_blocks": self.recalled_blocks,
            "recall_hits": self.recall_hits,
            "dropped_blocks": self.dropped_blocks,
            "expansions": self.expansions,
            "host_peak_bytes": self.host_peak_bytes,
            "demoted_peak_bytes": self.demoted_peak_bytes,
            "float_window_peak_bytes": self.window_peak_bytes,
            "float_window_mean_bytes": self.window_bytes_sum / self.window_steps if self.window_steps else 0.0,
        }

    def record_window(self, nbytes: int) -> None:
        """A step reserved slots and left the sequence's float window holding ``nbytes``."""
        self.window_peak_bytes = max(self.window_peak_bytes, nbytes)
        self.window_bytes_sum += nbytes
        self.window_steps += 1

    def record_compute(self, resident: int, device_blocks: int, generated: bool) -> None:
        self.peak_resident_tokens = max(self.peak_resident_tokens, resident)
        self.peak_device_blocks = max(self.peak_device_blocks, device_blocks)
        if generated:
            self.resident_sum += resident
            self.resident_count += 1


@dataclass
class SequenceKV:
    """A sequence's KV state: its block table, the controller that sizes it, its applied budget and statistics."""

    seq_id: int
    table: BlockTable
    controller: Controller
    budget: float
    since_compact: int = 0
    prompt_trimmed: bool = False  # whether the post-prompt size has been applied
    cap: float = math.inf  # the circuit breaker's ceiling for a sequence reading its prompt
    stats: KVStats = field(default_factory=KVStats)


@dataclass(frozen=True)
class Reservation:
    """What ``reserve`` changed, so that a failed forward pass can be undone."""

    entries: int
    num_tokens: int
