"""Continuous batching: which sequences run this step, with how many tokens each.

Every step takes up to ``max_num_batched_tokens`` tokens: first one token for each running sequence that is
decoding (or the next chunk of one still reading its prompt), then new requests, admitted while their first chunk
fits in free blocks and the batch has room. A request's prompt is read in chunks, so one long prompt never stalls
the decodes of the others.

Memory pressure is handled in two stages. Above ``memory_high_watermark`` pool use, the circuit breaker shrinks
every running sequence to its floor (sinks plus the recent window, the rest moved to the host tier). If a running
sequence still cannot get a block, the most recently admitted sequence is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed from its tokens (prompt and output so far) when room returns.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from confkv.engine.sequence import Sequence, Status
from confkv.kv.manager import CacheManager


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, manager: CacheManager, max_batch_size: int, max_num_batched_tokens: int) -> None:
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        pool = manager.pool
        self._watermark_blocks = max(1, pool.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _breaker(self) -> None:
        pool, manager = self.manager.pool, self.manager
        if pool.usage <= manager.controller.policy.memory_high_watermark or not manager.controller.evicts:
            return
        manager.breaker_trips += 1
        for seq in self.running:
            manager.shrink_to_floor(seq.kv)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.manager.close(seq.kv)
        seq.kv = self.manager.open(seq.seq_id, seq.kv.budget)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledChunk]:
        self._breaker()
        manager, pool = self.manager, self.manager.pool
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []

        for seq in list(self.running):
            if seq not in self.running:  # preempted while making room for an earlier one
                continue
            if budget <= 0:
                break
            n = min(seq.num_uncomputed, budget, manager.max_chunk(seq.kv))
            while manager.blocks_needed(seq.kv, n) > pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            manager.reserve(seq.kv, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget, manager.max_chunk(seq.kv))
            if manager.blocks_needed(seq.kv, n) > pool.num_free - (self._watermark_blocks if self.running else 0):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            manager.reserve(seq.kv, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        # decodes first: the attention function handles them as one padded batch
        chunks.sort(key=lambda c: c.num_tokens != 1)
        return chunks
