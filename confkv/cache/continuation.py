"""How a session's cache continues in a new request: a prefix kept and the rest forgotten (``truncate``), a parked
cache adopted by the next turn's prompt (``adopt``), a cache rebuilt from a session record (``from_blocks``).

A part of ``CacheManager`` kept in a module of its own: the session tiers call these; the decode step never does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from confkv.cache.state import KVStats, SequenceKV
from confkv.controllers import Controller
from confkv.kv.block_table import DROPPED, ON_HOST, BlockTable

if TYPE_CHECKING:
    from confkv.kv.demoted import DemotedTier
    from confkv.kv.host import HostTier
    from confkv.kv.pool import BlockPool


class SessionContinuation:
    """``CacheManager``'s session operations: it provides the pool, the tiers, the sequences' registry and the
    block moves (``restore_to_device``, ``close``, ``mark_dropped``) these use."""

    pool: BlockPool
    host: HostTier
    demoted: DemotedTier
    _seqs: dict[int, SequenceKV]
    block_size: int

    def truncate(self, kv: SequenceKV, n_tokens: int) -> int:
        """Forget every token from ``n_tokens`` on (a session whose next prompt departs from its history there);
        returns the tokens kept: fewer when the block holding the cut is not on the device (it cannot be
        overwritten in place)."""
        table, bs = kv.table, self.block_size
        n = min(n_tokens, table.num_tokens)
        if n % bs and table.entries[n // bs] < 0:
            n -= n % bs
        keep = table.blocks_for(n)
        self.pool.free([b for b in table.entries[keep:] if b >= 0])
        for i in range(keep, len(table.entries)):
            if table.entries[i] == ON_HOST:
                self.host.take(kv.seq_id, [i])
        self.demoted.drop_from(kv.seq_id, keep)
        del table.entries[keep:]
        table.num_tokens = n
        if n % bs:
            self.pool.forget_from(table.entries[n // bs], n % bs)
        return n

    def adopt(
        self,
        kv: SequenceKV,
        prompt: list[int],
        history: list[int],
        num_computed: int,
        resident: list[int],
        controller: Controller,
    ) -> int:
        """Continue a new prompt from a session's cache: keep the prefix it shares with ``history`` (the tokens
        the cache was computed for), bring the formerly ``resident`` blocks of it back to the device as memory
        allows, forget the rest; returns the tokens kept (0: nothing was worth keeping and the cache is closed).

        The prompt's last token is always left to compute (its logits give the first new token). Under a policy
        that never evicts, a block the host tier had to drop is a hole a full cache cannot continue over, so the
        prefix ends before it.
        """
        common = 0
        limit = min(num_computed, len(prompt) - 1)
        while common < limit and prompt[common] == history[common]:
            common += 1
        if not controller.evicts and DROPPED in kv.table.entries:
            common = min(common, kv.table.entries.index(DROPPED) * kv.table.block_size)
        # back to the device first (only the blocks that stay): a cut inside a block that is on the host would
        # otherwise fall back to the block's start, so a session from the host or the store would recompute up to
        # block_size - 1 tokens a session kept on the device reuses, and (under an evicting policy) continue
        # differently from it
        keep = kv.table.blocks_for(common)
        self.restore_to_device(kv, [i for i in resident if i < min(keep, len(kv.table))])
        kept = self.truncate(kv, common)
        if kept == 0:
            self.close(kv)
            return 0
        kv.controller = controller
        kv.stats = KVStats()
        kv.prompt_trimmed = False  # come down to the budget once the new turn is read
        kv.cap = math.inf
        kv.budget = min(kv.budget, controller.max_budget)
        self._seqs[kv.seq_id] = kv
        return kept

    def from_blocks(
        self,
        seq_id: int,
        num_tokens: int,
        num_blocks: int,
        blocks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        controller: Controller,
        budget: float,
        since_compact: int = 0,
    ) -> SequenceKV:
        """A cache rebuilt from stored blocks (logical index -> K, V, scores), all on the host tier; ``adopt``
        brings the formerly resident ones to the device as memory allows. Blocks not given are dropped."""
        table = BlockTable(self.block_size)
        table.entries = [DROPPED] * num_blocks
        table.num_tokens = num_tokens
        kv = SequenceKV(seq_id=seq_id, table=table, controller=controller, budget=budget, since_compact=since_compact)
        # registered before its blocks go to the host tier: a cache larger than that tier has some of its own
        # blocks dropped by the put, and only a registered sequence's table is told which
        self._seqs[seq_id] = kv
        if blocks:
            order = sorted(blocks, reverse=True)  # the host tier drops the first put first: keep the prefix
            k = torch.stack([blocks[i][0] for i in order], dim=1)
            v = torch.stack([blocks[i][1] for i in order], dim=1)
            score = torch.stack([blocks[i][2] for i in order])
            for i in order:
                table.entries[i] = ON_HOST
            self.mark_dropped(self.host.put(seq_id, order, k, v, score))
        return kv
