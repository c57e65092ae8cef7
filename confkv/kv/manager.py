"""The cache manager: turns each sequence's budget into block moves between the device pool and the host tier.

After every step a sequence holding more than its applied budget gives up its least important evictable blocks
(never the attention sinks, never the ``min_recent`` most recent tokens) to the host tier. When the controller
expands the budget, ``recall`` scores the sequence's host blocks against the current query (the attention mass
each block would receive, from the query and the resident keys' log-sum-exp captured during the forward pass) and
moves the best back into free device blocks. Expansion applies at once; contraction every ``compact_interval``
tokens, so that confident runs do not evict block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from confkv.controllers import Controller
from confkv.kv.block_table import DROPPED, ON_HOST, BlockTable
from confkv.kv.host import HostTier
from confkv.kv.pool import BlockPool


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
    resident_sum: int = 0  # over generated tokens: tokens resident when each was computed
    resident_count: int = 0

    def summary(self, full_tokens: int, bytes_per_block: int) -> dict[str, Any]:
        """The ``kv`` fields every output reports (generation and scoring alike)."""
        return {
            "peak_resident_tokens": self.peak_resident_tokens,
            "mean_resident_tokens": self.resident_sum / self.resident_count if self.resident_count else 0.0,
            "full_tokens": full_tokens,
            "peak_device_bytes": self.peak_device_blocks * bytes_per_block,
            "evicted_blocks": self.evicted_blocks,
            "recalled_blocks": self.recalled_blocks,
            "recall_hits": self.recall_hits,
            "dropped_blocks": self.dropped_blocks,
            "expansions": self.expansions,
            "host_peak_bytes": self.host_peak_bytes,
        }

    def record_compute(self, resident: int, device_blocks: int, generated: bool) -> None:
        self.peak_resident_tokens = max(self.peak_resident_tokens, resident)
        self.peak_device_blocks = max(self.peak_device_blocks, device_blocks)
        if generated:
            self.resident_sum += resident
            self.resident_count += 1


@dataclass
class SequenceKV:
    """A sequence's KV state: its block table, applied budget and statistics."""

    seq_id: int
    table: BlockTable
    budget: float
    since_compact: int = 0
    stats: KVStats = field(default_factory=KVStats)


class CacheManager:
    def __init__(self, pool: BlockPool, host: HostTier, controller: Controller, scaling: float) -> None:
        self.pool = pool
        self.host = host
        self.controller = controller
        self.scaling = scaling
        self._seqs: dict[int, SequenceKV] = {}
        # engine-wide counters (for metrics)
        self.evicted_blocks = 0
        self.recalled_blocks = 0
        self.recall_hits = 0
        self.breaker_trips = 0

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # ----------------------------------------------------------------------------------------------- lifecycle
    def open(self, seq_id: int, budget: float) -> SequenceKV:
        kv = SequenceKV(seq_id=seq_id, table=BlockTable(self.block_size), budget=budget)
        self._seqs[seq_id] = kv
        return kv

    def close(self, kv: SequenceKV) -> None:
        """Free everything the sequence holds in every tier."""
        self.pool.free(kv.table.device_blocks())
        self.host.drop_sequence(kv.seq_id)
        kv.table = BlockTable(self.block_size)
        kv.stats.host_bytes = 0
        self._seqs.pop(kv.seq_id, None)

    # ------------------------------------------------------------------------------------------------ allocation
    def blocks_needed(self, kv: SequenceKV, n_new: int) -> int:
        return kv.table.blocks_for(kv.table.num_tokens + n_new) - len(kv.table)

    def reserve(self, kv: SequenceKV, n_new: int) -> None:
        """Give the next ``n_new`` tokens slots; the caller has checked ``blocks_needed`` against free blocks."""
        kv.table.entries.extend(self.pool.allocate(self.blocks_needed(kv, n_new)))
        kv.table.num_tokens += n_new

    def max_chunk(self, kv: SequenceKV) -> int:
        """Largest prefill chunk that keeps the sequence within ``max_size`` plus one block on the device."""
        c = self.controller
        if not c.evicts or not c.evicts_during_prefill:
            return 1 << 30
        room = int(c.max_budget) + self.block_size - kv.table.resident_tokens()
        return max(self.block_size, room)

    # ------------------------------------------------------------------------------------------------- eviction
    def after_step(self, kv: SequenceKV, budget: float, n_computed: int, prompt_done: bool) -> None:
        """Apply the controller's budget (expansion now, contraction on the compaction tick) and evict to it."""
        c = self.controller
        if not c.evicts:
            return
        if not prompt_done:
            # No confidence signal exists while the prompt is read: keep up to max_size, so that the first
            # answer token sees as much of the prompt as the policy allows.
            if c.evicts_during_prefill and kv.table.resident_tokens() > c.max_budget:
                self.evict_to(kv, c.max_budget)
            return
        kv.since_compact += n_computed
        if budget > kv.budget:
            kv.budget = budget
        if kv.since_compact >= c.policy.compact_interval:
            kv.budget = budget
            kv.since_compact = 0
        if kv.table.resident_tokens() > kv.budget:
            self.evict_to(kv, kv.budget)

    def floor_tokens(self) -> int:
        """The fewest tokens a long sequence keeps: sinks plus the protected recent window."""
        return self.controller.sink_tokens + self.controller.protected_recent

    def shrink_to_floor(self, kv: SequenceKV) -> int:
        """Circuit breaker: evict down to the floor; returns the blocks freed."""
        if not self.controller.evicts:
            return 0
        kv.budget = min(kv.budget, float(self.floor_tokens()))
        return self.evict_to(kv, kv.budget)

    def _evictable(self, kv: SequenceKV) -> list[int]:
        c, bs, table = self.controller, self.block_size, kv.table
        first_unprotected = math.ceil(c.sink_tokens / bs)
        first_recent = max(0, table.num_tokens - max(1, c.protected_recent)) // bs
        return [i for i in range(first_unprotected, min(first_recent, len(table))) if table.entries[i] >= 0]

    def evict_to(self, kv: SequenceKV, target: float) -> int:
        """Move the least important evictable blocks to the host tier until at most ``target`` tokens stay."""
        excess = kv.table.resident_tokens() - target
        candidates = self._evictable(kv)
        if excess <= 0 or not candidates:
            return 0
        table, bs = kv.table, self.block_size
        if self.controller.importance == "attention":
            ids = torch.tensor([table.entries[i] for i in candidates], device=self.pool.device)
            scores = self.pool.score.view(-1, bs)[ids].sum(dim=-1).tolist()
            order = sorted(range(len(candidates)), key=lambda j: (scores[j], candidates[j]))
            ranked = [candidates[j] for j in order]
        else:
            ranked = candidates
        victims = ranked[: min(len(ranked), math.ceil(excess / bs))]
        victims.sort()
        block_ids = [table.entries[i] for i in victims]
        k, v, score = self.pool.read_blocks(block_ids)
        dropped = self.host.put(kv.seq_id, victims, k, v, score)
        for i in victims:
            table.entries[i] = ON_HOST
        self.pool.free(block_ids)
        for sid, idx in dropped:
            owner = self._seqs.get(sid)
            if owner is not None:
                owner.table.entries[idx] = DROPPED
                owner.stats.dropped_blocks += 1
                owner.stats.host_bytes = self.host.bytes_of(sid)
        kv.stats.evicted_blocks += len(victims)
        kv.stats.host_bytes = self.host.bytes_of(kv.seq_id)
        kv.stats.host_peak_bytes = max(kv.stats.host_peak_bytes, kv.stats.host_bytes)
        self.evicted_blocks += len(victims)
        return len(victims)

    # --------------------------------------------------------------------------------------------------- recall
    def recall(self, kv: SequenceKV, q: torch.Tensor, lse: torch.Tensor) -> list[int]:
        """Bring back the host blocks the current query would attend to most, up to the applied budget.

        ``q``: ``[layers, kv_heads, groups, head_dim]`` (after RoPE), ``lse``: ``[layers, kv_heads, groups]``, the
        log-sum-exp of the query's attention logits over the resident keys. A host token's would-be attention
        weight is ``exp(logit - logaddexp(lse_resident, lse_host))``; a block's score is that summed over its
        tokens, heads and layers.
        """
        table, bs = kv.table, self.block_size
        host_idx = table.host_indices()
        room_tokens = kv.budget - table.resident_tokens()
        limit = int(self.controller.policy.memory_high_watermark * self.pool.num_blocks) - self.pool.num_used
        n = min(len(host_idx), int(room_tokens // bs), max(0, limit))
        if n <= 0:
            return []
        keys = self.host.keys_of(kv.seq_id, host_idx).float()  # [L, n_host, bs, kvh, D]
        qh = q.to("cpu", torch.float32)
        logits = torch.einsum("lkgd,lnbkd->lkgnb", qh, keys) * self.scaling
        lse_host = torch.logsumexp(logits.flatten(-2), dim=-1)
        lse_all = torch.logaddexp(lse.to("cpu", torch.float32), lse_host)
        mass = (logits - lse_all[..., None, None]).exp().sum(dim=(0, 1, 2, 4))  # [n_host]
        top = mass.topk(n)
        chosen = sorted(host_idx[j] for j in top.indices.tolist())
        ids = self.pool.allocate(n)
        k, v, score = self.host.take(kv.seq_id, chosen)
        self.pool.write_blocks(ids, k, v, score)
        for i, block in zip(chosen, ids, strict=True):
            table.entries[i] = block
        # a hit: the block draws at least a resident block's average share of the attention
        fair_share = q.shape[0] * q.shape[1] * q.shape[2] / max(1, len(table.resident_indices()))
        hits = int((top.values >= fair_share).sum())
        kv.stats.recalled_blocks += n
        kv.stats.recall_hits += hits
        kv.stats.host_bytes = self.host.bytes_of(kv.seq_id)
        self.recalled_blocks += n
        self.recall_hits += hits
        return chosen
