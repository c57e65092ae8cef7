"""The cache manager: turns each sequence's budget into block moves between the device pool and the host tier.

Every sequence carries its own controller (the engine's policy, or the policy with a request's overrides) and an
*applied budget*. After every step a sequence holding more than its applied budget gives up its least important
evictable blocks (never the attention sinks, never the ``min_recent`` most recent tokens), as its controller's scorer
ranks them, to the host tier.

How the applied budget moves:

* while a prompt is read no confidence signal exists yet: an evicting policy keeps up to ``max_size`` tokens and is
  trimmed back to it between prefill chunks (so its peak is ``max_size`` plus one chunk);
* once the prompt is read it comes down to the controller's budget at once (for ``dynamic`` its first budget);
* when the controller's budget rises (an *expansion*) the engine raises the applied budget, as far as the memory
  ledger allows, and ``recall`` brings back the host blocks the current query would attend to most;
* contraction is applied every ``compact_interval`` tokens, so confident runs do not evict block by block; the same
  tick lets a budget that was held below the controller's (by the circuit breaker, or a full memory ledger) grow
  back, as far as the ledger allows, by new tokens and never by recall;
* the circuit breaker lowers the applied budget itself (``shrink``), so what it frees stays free; a sequence still
  reading its prompt (kept at up to ``max_size``) is capped there too (``cap``), and the cap rises, like a held
  budget, only as far as the ledger allows; it bounds the budget set when the prompt ends, then is lifted.

``projected_blocks`` is what admission control reserves for a sequence: the most device blocks it can hold before
its budget next changes. Reservations made for a step are undone by ``rollback`` when the forward pass fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from confkv.cache.continuation import SessionContinuation
from confkv.cache.state import Reservation, SequenceKV
from confkv.controllers import Controller
from confkv.kv.block_table import DROPPED, ON_HOST, BlockTable
from confkv.kv.demoted import DemotedTier
from confkv.kv.host import HostTier
from confkv.kv.kv_format import KVFormat
from confkv.kv.pool import BlockPool
from confkv.scorers import BlockView


class CacheManager(SessionContinuation):
    def __init__(self, pool: BlockPool, host: HostTier, scaling: float, demoted: DemotedTier | None = None) -> None:
        self.pool = pool
        self.host = host
        #: Low-precision device copies of evicted blocks, for policies with ``demote_dtype``.
        self.demoted = demoted or DemotedTier(pool.block_size, pool.device, pool.head_dim)
        pool.count_outside(lambda: self.demoted.used_bytes)  # the copies take from the pool's budget
        self.scaling = scaling
        self._seqs: dict[int, SequenceKV] = {}
        # engine-wide counters (for metrics)
        self.evicted_blocks = 0
        self.recalled_blocks = 0
        self.recall_hits = 0
        self.recall_queries = 0
        self.expansions = 0
        self.contractions = 0
        self.reselections = 0

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def host_fmt(self) -> KVFormat:
        """How the host tier (and so session records) stores blocks: ``host_kv_dtype``'s format or the pool's."""
        return self.host.fmt or self.pool.fmt

    @property
    def host_bytes_per_block(self) -> int:
        """Bytes one block takes on the host tier (and in a record), in ``host_fmt``: what room there is checks."""
        return self.host_fmt.bytes_per_token(self.pool.num_layers, self.pool.num_kv_heads) * self.block_size

    def to_host_form(
        self, table: BlockTable, indices: list[int], k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device rows of logical blocks ``indices`` re-encoded in ``host_fmt`` (each block's filled rows named, so
        a sequence's open last block keeps its grid over real tokens)."""
        filled = torch.tensor([table.tokens_in(i) for i in indices], dtype=torch.long)
        return self.pool.fmt.convert_to(self.host_fmt, k, v, filled)

    # ----------------------------------------------------------------------------------------------- lifecycle
    def open(self, seq_id: int, controller: Controller, budget: float) -> SequenceKV:
        kv = SequenceKV(seq_id=seq_id, table=BlockTable(self.block_size), controller=controller, budget=budget)
        self._seqs[seq_id] = kv
        return kv

    def close(self, kv: SequenceKV) -> None:
        """Free everything the sequence holds in every tier."""
        self.pool.free(kv.table.device_blocks())
        self.host.drop_sequence(kv.seq_id)
        self.demoted.drop_sequence(kv.seq_id)
        kv.table = BlockTable(self.block_size)
        kv.stats.host_bytes = 0
        self._seqs.pop(kv.seq_id, None)

    def reset(self, kv: SequenceKV) -> None:
        """Drop every block (preemption: the sequence will be recomputed) but keep its identity and statistics."""
        self.pool.free(kv.table.device_blocks())
        self.host.drop_sequence(kv.seq_id)
        self.demoted.drop_sequence(kv.seq_id)
        kv.table = BlockTable(self.block_size)
        kv.since_compact = 0
        kv.prompt_trimmed = False
        kv.cap = math.inf
        kv.stats.host_bytes = 0

    # ------------------------------------------------------------------------------------------------ allocation
    def blocks_needed(self, kv: SequenceKV, n_new: int) -> int:
        return kv.table.blocks_for(kv.table.num_tokens + n_new) - len(kv.table)

    def room_needed(self, kv: SequenceKV, n_new: int) -> int:
        """Free blocks (``num_free``) a step of ``n_new`` tokens takes: its new blocks, where it leaves a block open
        and the sequence holds no open block's float copy now (per-channel int4 keys; a block brought back open, by a
        swap-in or a session's restore, has none until it is written) the blocks' worth of that copy, and the float
        window's copies of the new blocks less those of the blocks leaving the window and of its spare arena blocks
        (bytes already counted, which a joining block takes first)."""
        bs, n, entries = self.block_size, kv.table.num_tokens, kv.table.entries
        held = n % bs and n // bs < len(entries) and self.pool.has_open_copy(entries[n // bs])
        opens = self.pool.open_copy_bytes and (n + n_new) % bs and not held
        extra = self.pool.open_copy_bytes if opens else 0
        if (window := self.pool.window) is not None:
            joins, leaves = self._window_moves(kv, n_new)
            extra += max(0, len(joins) - len(leaves) - window.spare) * window.block_bytes
        return self.blocks_needed(kv, n_new) + -(-extra // self.pool.bytes_per_block)

    def reserve(self, kv: SequenceKV, n_new: int) -> Reservation:
        """Give the next ``n_new`` tokens slots; the caller has checked ``room_needed`` against free blocks. Under a
        float window the new blocks that hold one of the last ``kv_float_window`` tokens get float copies and the
        blocks that no longer do give theirs up."""
        table = kv.table
        undo = Reservation(len(table.entries), table.num_tokens)
        window = self.pool.window
        leaves = self._window_moves(kv, n_new)[1] if window is not None else []
        table.entries.extend(self.pool.allocate(self.blocks_needed(kv, n_new)))
        table.num_tokens += n_new
        if window is not None:
            first = window.first_block(table.num_tokens)
            window.update([table.entries[i] for i in range(max(first, undo.entries), len(table))], leaves)
            table.window_from = first
            held = sum(1 for b in table.entries[first:] if b >= 0 and window.has(b))
            kv.stats.record_window(held * window.block_bytes)
        return undo

    def _window_moves(self, kv: SequenceKV, n_new: int) -> tuple[list[int], list[int]]:
        """For a step of ``n_new`` tokens: the logical indices of the new blocks that join the float window, and the
        device blocks whose copies leave it (the rule: ``FloatWindow.first_block``)."""
        window, table = self.pool.window, kv.table
        assert window is not None
        first = window.first_block(table.num_tokens + n_new)
        new_blocks = table.blocks_for(table.num_tokens + n_new)
        joins = list(range(max(first, len(table)), new_blocks))
        stop = min(first, len(table))
        leaves = [b for b in table.entries[table.window_from : stop] if b >= 0 and window.has(b)]
        return joins, leaves

    def trim_window(self, kv: SequenceKV, n_new: int) -> None:
        """The pool needs bytes for a step of ``n_new`` tokens: the float window gives back its spare arena blocks,
        but those the step's joins take (``room_needed`` counts those as taken from the spare ones)."""
        if (window := self.pool.window) is not None:
            joins, leaves = self._window_moves(kv, n_new)
            window.trim(keep=max(0, len(joins) - len(leaves)))

    def rollback(self, kv: SequenceKV, undo: Reservation) -> None:
        """Undo ``reserve``: the step's tokens get no slots and the blocks allocated for them go back."""
        table = kv.table
        self.pool.free(table.entries[undo.entries :])
        del table.entries[undo.entries :]
        table.num_tokens = undo.num_tokens

    def prefill_keep(self, kv: SequenceKV) -> float:
        """Tokens an evicting policy keeps while a prompt is read (no signal yet: as much as the policy allows;
        unbounded for one that never evicts)."""
        return kv.controller.max_budget

    def floor_tokens(self, kv: SequenceKV) -> int:
        """The fewest tokens a long sequence keeps: sinks plus the protected recent window."""
        c = kv.controller
        return c.sink_tokens + c.protected_recent

    def projected_blocks(
        self, kv: SequenceKV, total_tokens: int, prompt_tokens: int, chunk: int, step_tokens: int = 1
    ) -> int:
        """Most device blocks the sequence can hold until its budget next changes (what admission reserves), with
        the bytes it may keep beside the pool counted as blocks (``outside_blocks``).

        ``total_tokens`` is the longest the sequence can become, ``chunk`` the largest prefill chunk it may be given,
        ``step_tokens`` what one step adds once the prompt is read (one token; a chunk when teacher-forced). A
        policy that keeps everything needs its whole length; an evicting one its budget plus one step.
        """
        table, c, bs = kv.table, kv.controller, self.block_size
        outside = self.outside_blocks(kv, total_tokens)
        if not c.evicts:
            return table.blocks_for(total_tokens) + outside
        if table.num_tokens < prompt_tokens:  # still reading the prompt
            keep = min(self.prefill_keep(kv), kv.cap) + chunk
        else:
            floor = math.ceil(c.sink_tokens / bs) * bs + c.protected_recent + bs  # what eviction cannot go below
            keep = max(kv.budget, floor) + step_tokens
        return min(table.blocks_for(total_tokens), table.blocks_for(math.ceil(keep)) + 1) + outside

    def outside_blocks(self, kv: SequenceKV, total_tokens: int) -> int:
        """Blocks' worth of device bytes a sequence may keep outside the pool: its open block's float copy of
        per-channel keys (one open block at a time), its float window's copies (``kv_float_window``: the blocks the
        last tokens span), and, under ``demote_dtype``, a demoted copy of every block eviction may take (all but the
        floor: sinks and the protected recent tokens)."""
        pool, c = self.pool, kv.controller
        outside = pool.open_copy_bytes
        if pool.window is not None:  # the float window's copies: the blocks its tokens span, at most
            outside += min(kv.table.blocks_for(total_tokens), pool.window.max_blocks) * pool.window.block_bytes
        if c.evicts and c.policy.demote_dtype != "none":
            floor = kv.table.blocks_for(min(total_tokens, self.floor_tokens(kv)))
            evictable = max(0, kv.table.blocks_for(total_tokens) - floor)
            outside += evictable * self.demoted_block_bytes(c.policy.demote_dtype)
        return -(-outside // pool.bytes_per_block)

    def demoted_block_bytes(self, dtype: str) -> int:
        """Bytes of one block's demoted copy (K and V, every layer) at ``dtype``."""
        pool = self.pool
        return self.block_size * self.demoted.format_named(dtype).token_bytes(pool.num_layers, pool.num_kv_heads)

    # ------------------------------------------------------------------------------------------------- eviction
    def after_step(
        self,
        kv: SequenceKV,
        target: float,
        n_computed: int,
        prompt_done: bool,
        grow_room: Callable[[], float] | None = None,
    ) -> None:
        """Apply the controller's budget ``target`` (contraction on the compaction tick) and evict to it.

        ``grow_room`` says how many tokens the memory ledger lets the applied budget rise by on a tick, or a
        breaker's cap on a prompt being read rise by after a chunk (asked only when either would rise; unbounded
        when not given).
        """
        c = kv.controller
        if not c.evicts:
            return
        if not prompt_done:
            if kv.cap < self.prefill_keep(kv):  # shrunk by the breaker: grows back only as the ledger allows
                room = grow_room() if grow_room is not None else math.inf
                kv.cap += max(0.0, room)
            keep = min(self.prefill_keep(kv), kv.cap)
            if kv.table.resident_tokens() > keep:
                self.evict_to(kv, keep)
            return
        if not kv.prompt_trimmed:  # the prompt was just read: come down to the post-prompt size at once
            kv.prompt_trimmed = True
            kv.budget = min(target, kv.cap)
            kv.cap = math.inf
            kv.since_compact = 0
        else:
            kv.since_compact += n_computed
            if kv.since_compact >= c.policy.compact_interval:
                kv.since_compact = 0
                if target < kv.budget:
                    kv.budget = target
                    self.contractions += 1
                elif target > kv.budget:  # held below the controller's budget: grow back by new tokens only
                    room = grow_room() if grow_room is not None else math.inf
                    kv.budget = min(target, kv.budget + max(0.0, room))
        if kv.table.resident_tokens() > kv.budget:
            self.evict_to(kv, kv.budget)

    def shrink(self, kv: SequenceKV, target: float) -> int:
        """Circuit breaker: lower the applied budget to ``target`` tokens (never below the floor); blocks freed."""
        if not kv.controller.evicts:
            return 0
        kv.budget = min(kv.budget, max(float(self.floor_tokens(kv)), target))
        if not kv.prompt_trimmed:  # reading its prompt, which keeps up to max_size whatever the budget
            kv.cap = kv.budget
        return self.evict_to(kv, kv.budget)

    def _evictable(self, kv: SequenceKV) -> list[int]:
        c, bs, table = kv.controller, self.block_size, kv.table
        first_unprotected = math.ceil(c.sink_tokens / bs)
        recent = c.protected_recent
        if c.policy.recent_share and kv.budget != math.inf:
            recent = max(recent, int(c.policy.recent_share * kv.budget))
        first_recent = max(0, table.num_tokens - max(1, recent)) // bs
        return [i for i in range(first_unprotected, min(first_recent, len(table))) if table.entries[i] >= 0]

    def evict_to(self, kv: SequenceKV, target: float) -> int:
        """Move the least important evictable blocks to the host tier until at most ``target`` tokens stay."""
        excess = kv.table.resident_tokens() - target
        candidates = self._evictable(kv)
        if excess <= 0 or not candidates:
            return 0
        table, bs = kv.table, self.block_size
        scorer = kv.controller.scorer
        if scorer is None:
            ranked = candidates
        else:
            ids = torch.tensor([table.entries[i] for i in candidates], device=self.pool.device)
            scores = scorer.score(BlockView(self.pool, candidates, ids)).tolist()
            order = sorted(range(len(candidates)), key=lambda j: (scores[j], candidates[j]))
            ranked = [candidates[j] for j in order]
        victims = ranked[: min(len(ranked), math.ceil(excess / bs))]
        return self._to_host(kv, sorted(victims))

    def _to_host(self, kv: SequenceKV, victims: list[int], evicted: bool = True) -> int:
        """Move device blocks (logical indices, in order) of a sequence to the host tier; returns how many.
        ``evicted=False`` for a whole parked session, which is not eviction and is not counted as one."""
        if not victims:
            return 0
        table = kv.table
        block_ids = [table.entries[i] for i in victims]
        k, v, score = self.pool.read_blocks(block_ids)
        demote = kv.controller.policy.demote_dtype
        if evicted and demote != "none":  # the budget left them out: still attended to, at low precision
            self.demoted.put(kv.seq_id, victims, self.pool.dequant_k(k), self.pool.dequant(v), demote)
            kv.stats.demoted_peak_bytes = max(kv.stats.demoted_peak_bytes, self.demoted.bytes_of(kv.seq_id))
        k, v = self.to_host_form(table, victims, k, v)
        dropped = self.host.put(kv.seq_id, victims, k, v, score)
        for i in victims:
            table.entries[i] = ON_HOST
        self.pool.free(block_ids)
        self.mark_dropped(dropped)
        if not evicted:
            return len(victims)
        kv.stats.evicted_blocks += len(victims)
        kv.stats.host_bytes = self.host.bytes_of(kv.seq_id)
        kv.stats.host_peak_bytes = max(kv.stats.host_peak_bytes, kv.stats.host_bytes)
        self.evicted_blocks += len(victims)
        return len(victims)

    def _to_device(
        self, kv: SequenceKV, indices: list[int], k: torch.Tensor, v: torch.Tensor, score: torch.Tensor
    ) -> None:
        """Write blocks taken from the host tier (logical ``indices``, in order) into newly allocated device blocks."""
        k, v = self.host_fmt.convert_to(self.pool.fmt, k, v)
        ids = self.pool.allocate(len(indices), zero=False)  # every slot is written next
        self.pool.write_blocks(ids, k, v, score)
        self.demoted.drop(kv.seq_id, indices)  # back at the pool's precision
        for i, block in zip(indices, ids, strict=True):
            kv.table.entries[i] = block

    # ------------------------------------------------------------------------------------ whole-sequence moves
    def offload_all(self, kv: SequenceKV) -> int:
        """Move every device block of a sequence to the host tier (a parked session under memory pressure);
        returns the blocks freed on the device. Its demoted copies go too: a parked session holds no device memory
        (its evicted blocks stay recallable from the host tier at full precision)."""
        self.demoted.drop_sequence(kv.seq_id)
        return self._to_host(kv, kv.table.resident_indices(), evicted=False)

    def restore_to_device(self, kv: SequenceKV, indices: list[int]) -> int:
        """Bring host blocks back to the device, as many as there are free blocks; returns how many came back."""
        host = [i for i in indices if kv.table.entries[i] == ON_HOST]
        host = host[: self.pool.num_free]
        if not host:
            return 0
        self._to_device(kv, host, *self.host.take(kv.seq_id, host))
        return len(host)

    def mark_dropped(self, dropped: list[tuple[int, int]]) -> None:
        """The host tier dropped these (sequence id, logical block) pairs to make room: their owners' tables say so."""
        for sid, idx in dropped:
            owner = self._seqs.get(sid)
            if owner is not None:
                owner.table.entries[idx] = DROPPED
                owner.stats.dropped_blocks += 1
                owner.stats.host_bytes = self.host.bytes_of(sid)

    # --------------------------------------------------------------------------------------------------- recall
    def recall(
        self,
        kv: SequenceKV,
        q: torch.Tensor,
        lse: torch.Tensor,
        max_blocks: int | None = None,
        min_share: float = 0.0,
    ) -> list[int]:
        """Bring back the host blocks the current query would attend to most, up to the applied budget.

        ``q``: ``[layers, kv_heads, groups, head_dim]`` (after RoPE), ``lse``: ``[layers, kv_heads, groups]``, the
        log-sum-exp of the query's attention logits over the resident keys. A host token's would-be attention
        weight is ``exp(logit - logaddexp(lse_resident, lse_host))``; a block's score is that summed over its
        tokens, heads and layers. ``max_blocks`` bounds the blocks taken from the pool (free memory); ``min_share``
        leaves out blocks that would draw less than that share of a resident block's average attention.
        """
        table, bs = kv.table, self.block_size
        host_idx = table.host_indices()
        room_tokens = kv.budget - table.resident_tokens()
        n = min(len(host_idx), int(room_tokens // bs), self.pool.num_free)
        if max_blocks is not None:
            n = min(n, max_blocks)
        if n <= 0:
            return []
        self.recall_queries += 1
        keys = self.host_fmt.decode_k(self.host.keys_of(kv.seq_id, host_idx), torch.float32)  # [L, n_host, bs, kvh, D]
        qh = q.to("cpu", torch.float32)
        logits = torch.einsum("lkgd,lnbkd->lkgnb", qh, keys) * self.scaling
        lse_host = torch.logsumexp(logits.flatten(-2), dim=-1)
        lse_all = torch.logaddexp(lse.to("cpu", torch.float32), lse_host)
        mass = (logits - lse_all[..., None, None]).exp().sum(dim=(0, 1, 2, 4))  # [n_host]
        # a block's fair share: what an average resident block draws (every layer and head spreads a total of 1)
        heads = q.shape[0] * q.shape[1] * q.shape[2]
        if min_share > 0:
            n = min(n, int((mass >= min_share * heads / max(1, len(table.resident_indices()))).sum()))
            if n <= 0:
                return []
        top = mass.topk(n)
        chosen = sorted(host_idx[j] for j in top.indices.tolist())
        self._to_device(kv, chosen, *self.host.take(kv.seq_id, chosen))
        # a hit: at least the average share of a resident block, the recalled ones included
        hits = int((top.values >= heads / len(table.resident_indices())).sum())
        kv.stats.recalled_blocks += n
        kv.stats.recall_hits += hits
        kv.stats.host_bytes = self.host.bytes_of(kv.seq_id)
        self.recalled_blocks += n
        self.recall_hits += hits
        return chosen

    # ------------------------------------------------------------------------------------ the prompt's last query
    def reselect(self, kv: SequenceKV, q: torch.Tensor, budget: float) -> int:
        """Once the prompt is read: let its last query choose which evictable blocks stay, from the device and the
        host tier alike, and come down to ``budget`` (or the breaker's cap); returns how many host blocks came back
        (the query's token must then be recomputed to see them).

        While a long prompt is read, its chunks are trimmed by what each chunk's own queries attended to, before
        the question at its end exists; a record the question asks for may already be in the host tier. Here every
        candidate block is scored by the largest share of attention any one head of any layer gives it, among the
        candidates (``q`` as in ``recall``): a summed score lets the many heads that spread their attention drown
        the few that look the record up (BENCHMARKS.md, "The question picks the prompt's blocks"). The policy's
        ``reselect_share`` of the blocks that fit are chosen so; the rest are the resident blocks the scorer ranks
        highest, since a question about the whole context (a chat's next turn) draws on what the chunks' votes kept.

        The blocks the query chose are recorded above every resident candidate (each token: the highest token record
        plus the block's score over ``block_size``), so the next contraction does not evict them first, and evicts
        them in the query's order: a block brought back carried the low record that had evicted it.
        """
        table, bs = kv.table, self.block_size
        kv.budget = min(budget, kv.cap)
        resident = self._evictable(kv)
        host = table.host_indices()
        candidates = resident + host
        if not candidates:
            return 0
        fixed = table.resident_tokens() - len(resident) * bs  # sinks and the recent window stay regardless
        keep = max(0, int((kv.budget - fixed) // bs))
        if keep >= len(candidates) and not host:
            return 0
        parts = []
        ids = torch.tensor([table.entries[i] for i in resident], dtype=torch.long, device=self.pool.device)
        view = BlockView(self.pool, resident, ids)
        if resident:
            parts.append(view.keys().to("cpu", torch.float32))
        if host:
            parts.append(self.host_fmt.decode_k(self.host.keys_of(kv.seq_id, host), torch.float32))
        keys = torch.cat(parts, dim=1)  # [L, n, bs, kvh, D]
        logits = torch.einsum("lkgd,lnbkd->lkgnb", q.to("cpu", torch.float32), keys) * self.scaling
        share = logits.flatten(-2).softmax(dim=-1).unflatten(-1, logits.shape[-2:]).sum(dim=-1)  # [L, kvh, g, n]
        score = share.flatten(0, 2).amax(dim=0).tolist()
        by_query = sorted(range(len(candidates)), key=lambda j: (-score[j], candidates[j]))
        n_query = min(keep, math.ceil(kv.controller.policy.reselect_share * keep))
        picked = by_query[:n_query]
        chosen = set(picked)
        scorer = kv.controller.scorer
        if len(chosen) < keep and resident:
            voted = scorer.score(view).tolist() if scorer is not None else [0.0] * len(resident)
            by_vote = sorted(range(len(resident)), key=lambda j: (-voted[j], -candidates[j]))
            chosen.update([j for j in by_vote if j not in chosen][: keep - len(chosen)])
        evict = [candidates[j] for j in range(len(resident)) if j not in chosen]
        # what the device can take once the others have left (less their demoted copies, which join the budget)
        room = self.pool.num_free + len(evict)
        if evict and (demote := kv.controller.policy.demote_dtype) != "none":
            room -= -(-len(evict) * self.demoted_block_bytes(demote) // self.pool.bytes_per_block)
        back = sorted([candidates[j] for j in picked if j >= len(resident)][: max(0, room)])
        self.reselections += 1
        top = float(view.mass.max()) if resident else 0.0
        record = {candidates[j]: top + score[j] / bs for j in picked}  # per token of each picked block
        stay = [j for j in picked if j < len(resident)]
        if stay:
            marks = torch.tensor([record[candidates[j]] for j in stay], dtype=self.pool.score.dtype)
            self.pool.score[self.pool.slots_of(ids[stay])] = marks.repeat_interleave(bs).to(self.pool.device)
        taken = self.host.take(kv.seq_id, back) if back else None
        self._to_host(kv, evict)
        if taken is not None:
            k, v, _ = taken
            self._to_device(kv, back, k, v, torch.tensor([record[i] for i in back])[:, None].expand(-1, bs))
        kv.stats.recalled_blocks += len(back)
        kv.stats.host_bytes = self.host.bytes_of(kv.seq_id)
        self.recalled_blocks += len(back)
        return len(back)
