"""Continuous batching: which sequences run this step, with how many tokens each, and whether a new one fits.

Every step takes up to ``max_num_batched_tokens`` tokens: first the second passes of sequences that recalled blocks
(each whole), then one token for each running sequence that is decoding (or the next chunk of one still reading
its prompt), then new requests. A prompt is read in chunks, so one
long prompt never stalls the decodes of the others, and under an evicting policy it is trimmed between chunks.

**Admission by what a policy keeps.** Each running sequence is *committed* the most device blocks it can hold
before its budget next changes (``CacheManager.projected_blocks``): its whole length under ``full``, its budget plus
one step (or, while it reads its prompt, ``max_size``, or the breaker's cap on it, plus one chunk) under an
evicting policy. A request is
admitted only while the commitments fit: under the pool size for policies that keep everything, under the low
watermark for evicting ones, so the band up to the high watermark stays free for expansions (recall). Memory a
confident sequence gives up is therefore immediately room for another request, and preemption is the exception.

**Circuit breaker with hysteresis.** When pool use passes ``memory_high_watermark`` (which the commitments should
prevent: a policy swap or per-request overrides can still get there) the breaker trips once, lowers the budgets of
the largest evicting sequences toward their floor until use is back under ``memory_low_watermark``, and refuses
expansions until use is under the low mark. Because it lowers the budgets themselves, nothing regrows into what it
freed except through the ledger.

**Teacher-forced scoring** (sequences with ``forced`` text) runs through the same schedule, with one difference: a
scored sequence gets its whole next chunk every step (``max_num_batched_tokens`` of prompt, then ``forced_chunk``
tokens of the text) outside the token budget, so chunk boundaries, and with them what is recorded and evicted, do
not depend on what else runs: a text scores the same alone or in any batch.

**Preemption** is the last resort: if a running sequence still cannot get a block (once the float window has given
back the spare arena blocks it keeps for later joins and parked sessions have left), the most recently admitted
sequence gives back its blocks and returns to the front of the queue, to be recomputed from its tokens. A request
that cannot fit even in an empty pool is reported as failed instead of being retried forever.

**On-demand admission** (``admission="on_demand"``, vLLM's way) commits nothing ahead: blocks are taken as tokens
are computed, and a request is admitted while the pool (under the low watermark for evicting policies) has room for
its next chunk plus one block for every running sequence's next step. When a running sequence cannot get a block,
the most recently admitted one is preempted as above, but *swapped*: its device blocks move to the host tier when
that tier has room for them, and come back, unchanged, when it is admitted again (its computed tokens are kept).
Without room, or when the host tier has since dropped one of them, it is recomputed. The circuit breaker does not
trip on demand: use past the high mark is then the pool filling as admitted sequences grow, which preemption
answers without touching any sequence's budget (so every answer is the one it gets alone), where the breaker would
shrink budgets again and again as admission refilled the pool. Parked sessions are still reclaimed first.
``reserve`` (the commitments above) never needs to preempt under a policy that keeps everything, at the price of
running fewer sequences than the pool could hold until they have grown; ``on_demand`` fills the pool and pays with
preemptions.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from confkv.cache.manager import CacheManager
from confkv.cache.state import Reservation
from confkv.engine.sequence import Sequence, Status
from confkv.kv.block_table import ON_HOST

Admission = Literal["reserve", "on_demand"]
ADMISSION_MODES: tuple[str, ...] = ("reserve", "on_demand")


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    undo: Reservation | None = None  # how to give the slots back if the forward pass fails
    rerun: bool = False  # tokens computed before, computed again after a recall (their slots are kept)

    @property
    def decodes(self) -> bool:
        """One token after the prompt: a row of the padded decode batch. A prompt's last token read alone is a
        prefill chunk, so that it votes (and is recorded) by the prompt's rules."""
        return self.num_tokens == 1 and self.start >= self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass
class Schedule:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    #: Sequences that can never run (they do not fit in the whole pool), with the reason; the engine fails them.
    failed: list[tuple[Sequence, str]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        manager: CacheManager,
        max_batch_size: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        admission: Admission = "on_demand",
    ) -> None:
        if admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, not {admission!r}")
        self.manager = manager
        self.admission = admission
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.recomputed_tokens = 0
        #: on-demand preemptions that kept their blocks on the host tier, and the tokens those blocks held
        self.swap_preemptions = 0
        self.swapped_tokens = 0
        self.breaker_trips = 0
        self.refused_expansions = 0
        self.tripped = False
        #: Frees device blocks held outside the running set (parked sessions) when memory runs short.
        self.reclaim: Callable[[int], int] = lambda blocks: 0
        self.set_watermarks(high_watermark, low_watermark)

    def set_watermarks(self, high: float, low: float) -> None:
        n = self.manager.pool.num_blocks
        self.high_blocks = max(1, int(high * n))
        self.low_blocks = max(1, min(self.high_blocks, int(low * n)))

    # ----------------------------------------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------------------------------- ledger
    def total_tokens(self, seq: Sequence) -> int:
        if seq.forced is not None:
            return len(seq.forced)
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)

    def committed(self, seq: Sequence) -> int:
        """Blocks the sequence holds now or may hold before its budget next changes (on demand: what it holds)."""
        kv = seq.kv
        if self.admission == "on_demand" and seq.status is Status.RUNNING:
            return len(kv.table.device_blocks())
        projected = self.manager.projected_blocks(
            kv,
            self.total_tokens(seq),
            seq.num_prompt_tokens,
            self.max_num_batched_tokens,
            step_tokens=max(1, seq.forced_chunk),
        )
        return max(len(kv.table.device_blocks()), projected)

    def committed_total(self) -> int:
        return sum(self.committed(s) for s in self.running)

    def expansion_room(self, seq: Sequence) -> float:
        """Tokens by which ``seq``'s applied budget may rise: what the commitments (on demand: the blocks in use)
        leave under the high mark."""
        if self.tripped:
            return 0.0
        used = self.manager.pool.num_used if self.admission == "on_demand" else self.committed_total()
        spare = self.high_blocks - used
        return max(0, spare) * self.manager.block_size

    # ------------------------------------------------------------------------------------------------ breaker
    def _breaker(self) -> None:
        pool, manager = self.manager.pool, self.manager
        if self.tripped and pool.num_used <= self.low_blocks:
            self.tripped = False
        if not self.tripped and pool.num_used > self.high_blocks:  # parked sessions go first
            self.reclaim(pool.num_used - self.low_blocks)
        if self.tripped or pool.num_used <= self.high_blocks or self.admission == "on_demand":
            return
        evicting = [s for s in self.running if s.kv.controller.evicts]
        if not evicting:
            return
        self.tripped = True
        self.breaker_trips += 1
        for seq in sorted(evicting, key=lambda s: -len(s.kv.table.device_blocks())):
            if pool.num_used <= self.low_blocks:
                break
            manager.shrink(seq.kv, 0.0)

    def _preempt(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running set to the front of the queue: swapped (on demand, when the host tier
        has room) or to be recomputed."""
        self.running.remove(seq)
        if not (self.admission == "on_demand" and self._swap_out(seq)):
            self._drop(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _swap_out(self, seq: Sequence) -> bool:
        """Move a preempted sequence's device blocks to the host tier when it has room for all of them (a scored
        text, or one waiting for its second pass, is recomputed instead); whether it did."""
        kv, host = seq.kv, self.manager.host
        if seq.scored or seq.rerun:
            return False
        indices = kv.table.resident_indices()
        if host.capacity_bytes - host.used_bytes < len(indices) * self.manager.host_bytes_per_block:
            return False
        self.manager.offload_all(kv)
        seq.swapped = indices
        self.swap_preemptions += 1
        self.swapped_tokens += seq.num_computed
        return True

    def _swap_in(self, seq: Sequence) -> bool:
        """Bring a swapped sequence's blocks back (the caller has checked there is room); False, and the sequence
        is left to be recomputed, when the host tier dropped one of them meanwhile."""
        kv, swapped = seq.kv, seq.swapped or []
        seq.swapped = None
        if any(kv.table.entries[i] != ON_HOST for i in swapped):
            self._drop(seq)
            return False
        self.manager.restore_to_device(kv, swapped)
        return True

    def _drop(self, seq: Sequence) -> None:
        """Give back every block of a preempted sequence: it is recomputed from its tokens."""
        seq.swapped = None
        self.recomputed_tokens += seq.num_computed
        self.manager.reset(seq.kv)
        seq.num_computed = 0
        seq.rerun = 0
        seq.stale_from = None
        if seq.scored:  # scoring restarts from its prompt: rows recorded so far would be recorded twice
            seq.token_ids = list(seq.prompt_token_ids)
            seq.ctrl = seq.controller.init_state()
            seq.recorder.restart()

    # ----------------------------------------------------------------------------------------------- schedule
    def schedule(self) -> Schedule:
        self._breaker()
        manager, pool = self.manager, self.manager.pool
        budget = self.max_num_batched_tokens
        out = Schedule()

        # second passes first: one can be as long as a whole step, and after the others' tokens it would not fit
        # until they had all finished
        for seq in self.running:
            if seq.rerun and not seq.paused and budget >= seq.rerun:  # its slots are kept: nothing to reserve
                out.chunks.append(ScheduledChunk(seq, seq.num_computed - seq.rerun, seq.rerun, rerun=True))
                budget -= seq.rerun
        for seq in list(self.running):
            # preempted while making room for an earlier one, or waiting for its second pass
            if seq not in self.running or seq.paused or seq.rerun:
                continue
            if seq.scored:  # fixed chunks whatever else runs, so a text scores the same alone or in any batch
                n = self._scored_chunk(seq)
            elif budget <= 0:
                continue
            else:
                n = min(seq.num_uncomputed, budget)
            if manager.room_needed(seq.kv, n) > pool.num_free:  # spare window arena, then parked sessions
                manager.trim_window(seq.kv, n)
            if manager.room_needed(seq.kv, n) > pool.num_free:
                self.reclaim(manager.room_needed(seq.kv, n) - pool.num_free)
            while manager.room_needed(seq.kv, n) > pool.num_free:
                if len(self.running) == 1:  # alone and still too big: it can never run
                    self.running.remove(seq)
                    out.failed.append((seq, self._too_big(seq)))
                    break
                victim = self.running[-1]
                self._preempt(victim)
                if taken := [c for c in out.chunks if c.seq is victim]:  # its second pass, scheduled above
                    out.chunks = [c for c in out.chunks if c.seq is not victim]
                    budget += sum(c.num_tokens for c in taken)
                if seq not in self.running:
                    break
            if seq not in self.running:
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n, manager.reserve(seq.kv, n)))
            if not seq.scored:
                budget -= n

        committed = self.committed_total()
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch_size:
                break
            if seq.paused or seq.restoring:
                continue
            if budget <= 0 and not seq.scored:
                break
            need = self.committed(seq)
            if need > pool.num_blocks:
                self.waiting.remove(seq)
                out.failed.append((seq, self._too_big(seq)))
                continue
            limit = self.low_blocks if seq.kv.controller.evicts else pool.num_blocks
            n = self._scored_chunk(seq) if seq.scored else min(seq.num_uncomputed, budget)
            swapped = len(seq.swapped or ())
            if self.admission == "on_demand":
                # its next chunk (and its blocks on the host), and a block for every running sequence's next step
                need = swapped + manager.room_needed(seq.kv, n)
                over = pool.num_used + need + len(self.running) - limit
                if self.running and over > 0 and self.reclaim(over) < over:  # parked sessions leave first
                    break
            elif self.running and committed + need > limit:
                break
            if swapped + manager.room_needed(seq.kv, n) > pool.num_free:
                self.reclaim(swapped + manager.room_needed(seq.kv, n) - pool.num_free)
            if swapped + manager.room_needed(seq.kv, n) > pool.num_free:
                break
            if seq.swapped is not None and not self._swap_in(seq):  # recomputed from its first token instead
                n = min(seq.num_uncomputed, budget) if not seq.scored else self._scored_chunk(seq)
                if manager.room_needed(seq.kv, n) > pool.num_free:
                    break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n, manager.reserve(seq.kv, n)))
            committed += need
            if not seq.scored:
                budget -= n
        # decodes first: the attention function handles them as one padded batch
        out.chunks.sort(key=lambda c: not c.decodes)
        return out

    def _scored_chunk(self, seq: Sequence) -> int:
        """A scored text's prompt is read ``max_num_batched_tokens`` at a time; its forced text one whole chunk per
        step, even a chunk longer than that: a chunk's rows are recorded only once it is computed to its end, so
        splitting one would lose the rows of all but its last piece."""
        if seq.prompt_done:
            return seq.num_uncomputed
        return min(seq.num_uncomputed, self.max_num_batched_tokens)

    def _too_big(self, seq: Sequence) -> str:
        pool = self.manager.pool
        return (
            f"the request needs {self.committed(seq)} KV blocks under policy {seq.kv.controller.name!r} but the pool "
            f"holds {pool.num_blocks} ({pool.total_bytes / 2**20:.1f} MiB)"
        )
