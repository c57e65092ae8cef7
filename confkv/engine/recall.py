"""Expansion: when a controller's budget rises, raise the applied budget and bring evicted blocks back.

An expansion raises a sequence's applied budget as far as memory allows (the scheduler's ledger; never while the
circuit breaker holds) and recalls the host blocks the current query attends to most (``CacheManager.recall``).
A sequence that got blocks back chooses no token this step: its last tokens are computed again as rows of the next
step's batch (a *rerun*), so the token chosen under uncertainty sees the recalled context without a forward pass of
its own. For that the runner keeps the sampling query of every sequence that might recall (``capture``), and each
sequence remembers its newest query between steps. Under ``recompute: stale`` a rerun also recomputes every token
computed over a trimmed context since the last recomputation (``note_stale`` tracks them).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from confkv.cache.manager import CacheManager
from confkv.engine.runner import ForwardResult
from confkv.engine.scheduler import ScheduledChunk, Scheduler
from confkv.engine.sequence import Sequence
from confkv.kv.host import HostTier


class Recaller:
    """Expansions, recalls and reruns of the engine's sequences, with their engine-wide counts."""

    def __init__(self, manager: CacheManager, scheduler: Scheduler, host: HostTier) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.host = host
        self.num_reruns = 0
        self.rerun_tokens = 0

    def capture(self, chunks: list[ScheduledChunk]) -> set[int]:
        """Sequences whose sampling query is kept: those that might recall host blocks this step, or whose prompt
        ends here and picks the blocks it keeps."""
        return {
            ch.seq.seq_id
            for ch in chunks
            if ch.samples and ch.seq.kv.controller.recalls and (self.host.has_blocks(ch.seq.seq_id) or reselects(ch))
        }

    @staticmethod
    def keep_queries(res: ForwardResult) -> None:
        """Remember each capturing sequence's newest query and log-sum-exp (for a recall between steps)."""
        for ch in res.sampling:
            row = res.captured.get(ch.seq.seq_id)
            if row is not None:
                q = torch.stack([layer_q[row] for layer_q in res.batch.captured_q])
                lse = torch.stack([layer_lse[row] for layer_lse in res.batch.captured_lse])
                ch.seq.last_query = (q, lse)

    @staticmethod
    def note_stale(ch: ScheduledChunk, resident: int) -> None:
        """Track which generated tokens were computed over a trimmed context, for ``recompute: stale``. A rerun
        counts as a fresh computation: it saw what the recall brought back, the most the policy gives."""
        seq = ch.seq
        if ch.rerun:
            seq.stale_from = None
        elif seq.stale_from is None and ch.start >= seq.num_prompt_tokens and resident < ch.start + ch.num_tokens:
            seq.stale_from = ch.start

    def expand(self, seq: Sequence, budget: float, res: ForwardResult | None) -> bool:
        """The controller's budget rose: raise the applied budget as far as memory allows and recall host blocks
        into it, scored with this step's query (or, between steps, the newest one kept). Returns whether blocks came
        back (so the step must be recomputed)."""
        kv, sched = seq.kv, self.scheduler
        kv.stats.expansions += 1
        self.manager.expansions += 1
        if sched.tripped:
            sched.refused_expansions += 1
            return False
        new = min(budget, kv.budget + sched.expansion_room(seq))
        if new <= kv.budget:
            sched.refused_expansions += 1
            return False
        can_recall = (seq.prompt_done and kv.prompt_trimmed and seq.last_query is not None
                      and (res is None or seq.seq_id in res.captured))  # fmt: skip
        if seq.controller.policy.expand_by == "budget":
            kv.budget = new
            return can_recall and bool(self.manager.recall(kv, *seq.last_query))
        if not can_recall:
            return False
        # grow by what recall brings back and is worth it, nothing more: new tokens do not fill a raised budget
        old = kv.budget
        kv.budget = new
        back = self.manager.recall(kv, *seq.last_query, min_share=1.0)
        kv.budget = max(old, float(kv.table.resident_tokens())) if back else old
        return bool(back)

    def resize(self, seq: Sequence, budget: float) -> None:
        """Set a live sequence's budget now, between steps: contract by evicting, expand (as far as memory allows)
        with a recall scored by its newest query."""
        if not seq.controller.evicts:
            return
        seq.ctrl = replace(seq.ctrl, budget=budget)
        if budget > seq.kv.budget:
            self.expand(seq, budget, None)
        elif budget < seq.kv.budget:
            seq.kv.budget = budget
            self.manager.contractions += 1
        if seq.prompt_done and seq.kv.table.resident_tokens() > seq.kv.budget:
            self.manager.evict_to(seq.kv, seq.kv.budget)

    def defer(self, seq: Sequence) -> None:
        """Blocks came back: the token is chosen next step, from this one recomputed with them (only tokens of the
        protected recent window are sure to be resident, and the second pass must fit in one step). Under
        ``recompute: stale`` every token computed over a trimmed context since the last recomputation is computed
        again too: a near-tie is decided by those tokens' keys and values as much as by which older blocks are
        resident (BENCHMARKS.md, "Stale keys")."""
        c = seq.kv.controller
        n = c.policy.recompute_tokens
        if c.policy.recompute == "stale" and seq.stale_from is not None:
            n = max(n, seq.num_computed - seq.stale_from)
        seq.rerun = min(n, max(1, c.protected_recent), seq.num_computed, self.scheduler.max_num_batched_tokens)
        self.num_reruns += 1
        self.rerun_tokens += seq.rerun


def reselects(ch: ScheduledChunk) -> bool:
    """Whether this chunk ends a sequence's prompt under a policy whose question picks what stays."""
    seq = ch.seq
    return (seq.kv.controller.policy.reselect_after_prompt and not ch.rerun and not seq.kv.prompt_trimmed
            and ch.start + ch.num_tokens == seq.num_prompt_tokens)  # fmt: skip
