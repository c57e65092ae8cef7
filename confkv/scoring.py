"""Teacher-forced scoring through the engine, under any cache policy.

Free decoding costs one forward pass per token; scoring a fixed continuation in chunks of ``compact_interval``
tokens costs one pass per chunk, which is what makes quality measurement (and reinforcement learning) affordable
on a CPU. The cache behaves as in decoding, at chunk granularity: the context is read as a prompt (the policy
keeps up to ``max_size``), then each chunk of the continuation attends over the resident blocks plus itself; the
controller sees every token's signals in order, and between chunks the cache manager expands (recalling host
blocks with the chunk's last query), contracts and evicts exactly as it does between decode steps. What differs
from decoding: a recall triggered inside a chunk takes effect from the next chunk, not for the token itself.

A scored item is ``token_ids`` with ``score_from``: token ``i >= score_from`` is scored by the distribution the
model gives after reading tokens ``0 .. i-1``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from confkv.confidence import confidence_signals
from confkv.controllers import Controller, StepSignals
from confkv.engine.engine import LLMEngine
from confkv.engine.params import SamplingParams
from confkv.engine.scheduler import ScheduledChunk
from confkv.engine.sequence import Sequence, Status
from confkv.errors import ConfkvError

#: Size of the top-k kept from the full-cache distribution for KL estimates.
REFERENCE_TOPK = 32


@dataclass(frozen=True)
class TopK:
    """A distribution's top-k token ids and log-probabilities at every scored position: ``[n, k]`` each."""

    ids: torch.Tensor
    logprobs: torch.Tensor


def kl_from_topk(reference: TopK, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(reference || policy) per row, from the reference's top-k and the policy's full log-probabilities.

    The reference mass outside its top-k is treated as one bucket against the policy's mass outside the same ids,
    which keeps the estimate exact when the two distributions agree and a lower bound of the true KL otherwise.
    """
    ref_lp = reference.logprobs.float()
    p = ref_lp.exp()
    q_lp = logprobs.float().gather(-1, reference.ids.to(logprobs.device)).cpu()
    head = (p * (ref_lp - q_lp)).sum(-1)
    p_tail = (1.0 - p.sum(-1)).clamp_min(0.0)
    q_tail = (1.0 - q_lp.exp().sum(-1)).clamp_min(1e-12)
    tail = torch.where(p_tail > 1e-9, p_tail * (p_tail.clamp_min(1e-12).log() - q_tail.log()), torch.zeros_like(head))
    return (head + tail).clamp_min(0.0)


@dataclass
class ScoreItem:
    token_ids: list[int]
    score_from: int = 1
    reference: TopK | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) < 2:
            raise ConfkvError("a scored text needs at least two tokens")
        if not 1 <= self.score_from < len(self.token_ids):
            raise ConfkvError(f"score_from must lie in [1, {len(self.token_ids) - 1}] (got {self.score_from})")
        if self.reference is not None and self.reference.ids.shape[0] != len(self.token_ids) - self.score_from:
            raise ConfkvError("the reference does not cover the scored tokens")


@dataclass
class ScoreResult:
    """Per scored token (index ``i`` is token ``score_from + i``) plus the sequence's KV statistics."""

    token_logprobs: torch.Tensor
    entropy: torch.Tensor
    gap: torch.Tensor
    top1_prob: torch.Tensor
    resident: torch.Tensor  # keys the token's distribution was computed over
    full: torch.Tensor  # keys a full cache would have held: its position
    budget: torch.Tensor  # the controller's budget after the token
    chunk_resident: list[int]
    kv: dict[str, Any]
    greedy_match: torch.Tensor | None = None  # whether the token was the policy's top-1 choice
    kl: torch.Tensor | None = None
    topk: TopK | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_logprobs.numel())

    @property
    def nll_mean(self) -> float:
        return float(-self.token_logprobs.mean())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_mean)

    @property
    def kv_fraction(self) -> float:
        """Resident keys over the keys a full cache holds, summed over scored tokens."""
        return float(self.resident.sum() / self.full.sum())

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.num_tokens,
            "nll_mean": self.nll_mean,
            "ppl": self.ppl,
            "kl_mean": float(self.kl.mean()) if self.kl is not None else None,
            "kv_fraction": self.kv_fraction,
            "kv": self.kv,
        }


@dataclass
class ItemState:
    """One item in flight: its sequence, the controller that sets its budget, and what it has scored so far.

    ``last`` holds the rows of the most recent chunk (the segment an RL step observes); ``controller`` may be
    replaced between steps, which is how an agent changes the knobs of one sequence.
    """

    index: int
    item: ScoreItem
    seq: Sequence
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    last: dict[str, torch.Tensor] = field(default_factory=dict)
    chunk_resident: list[int] = field(default_factory=list)
    budgets: list[float] = field(default_factory=list)
    done: bool = False

    @property
    def controller(self) -> Controller:
        return self.seq.controller

    @controller.setter
    def controller(self, value: Controller) -> None:
        self.seq.controller = value

    def add(self, **tensors: torch.Tensor) -> None:
        for key, value in tensors.items():
            self.rows.setdefault(key, []).append(value)
            self.last[key] = value


class Scorer:
    """Scores many items at once on an idle engine, sharing its model, pool, cache manager and controller."""

    def __init__(self, engine: LLMEngine, chunk_size: int | None = None) -> None:
        self.engine = engine
        self.chunk_size = chunk_size

    def _chunk(self) -> int:
        return self.chunk_size or self.engine.policy.compact_interval

    def _worst_blocks(self, item: ScoreItem) -> int:
        """Blocks the item may hold at its peak, so admission never has to preempt."""
        e, c = self.engine, self.engine.controller
        bs, n, prompt = e.pool.block_size, len(item.token_ids), item.score_from
        full = -(-n // bs)
        if not c.evicts:
            return full
        peak = int(c.max_budget) + max(self._chunk(), e.config.max_num_batched_tokens) + bs
        if not c.evicts_during_prefill:
            peak = max(peak, prompt + bs)
        return min(full, -(-peak // bs) + 2)

    def check(self, item: ScoreItem) -> None:
        e = self.engine
        if len(item.token_ids) > e.max_model_len:
            raise ConfkvError(f"a scored text has {len(item.token_ids)} tokens; the context is {e.max_model_len}")
        if self._worst_blocks(item) > e.pool.num_blocks:
            raise ConfkvError("a scored text does not fit in the KV pool; raise kv_cache_memory")

    def session(self, keep_topk: int = 0) -> ScoringSession:
        if self.engine.has_unfinished_requests():
            raise ConfkvError("scoring needs an idle engine (requests are running)")
        return ScoringSession(self, keep_topk)

    def score(self, items: list[ScoreItem], *, keep_topk: int = 0, use_tqdm: bool = False) -> list[ScoreResult]:
        """Score every item; ``keep_topk > 0`` also returns that many top log-probs per token (a reference)."""
        for item in items:
            self.check(item)
        with self.session(keep_topk) as session:
            indices = [session.add(item) for item in items]
            bar = tqdm(total=sum(len(it.token_ids) for it in items), disable=not use_tqdm, desc="score", unit="tok")
            with bar:
                while not session.finished:
                    for st in session.step():
                        if st.done:
                            bar.update(len(st.item.token_ids))
            return [session.result(i) for i in indices]

    def _open(self, index: int, item: ScoreItem, controller: Controller | None) -> ItemState:
        e = self.engine
        controller = controller or e.controller
        seq_id = e.new_seq_id()
        state = controller.init_state()
        prompt = list(item.token_ids[: item.score_from])
        seq = Sequence(
            seq_id=seq_id,
            request_id=f"score-{seq_id}",
            prompt=None,
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=len(item.token_ids) - item.score_from),
            kv=e.manager.open(seq_id, controller, state.budget),
            ctrl=state,
            status=Status.RUNNING,
        )
        return ItemState(index=index, item=item, seq=seq)

    def _step(self, active: list[ItemState], keep_topk: int) -> list[ItemState]:
        """One forward pass over every active item; returns the items that scored rows (``done`` when finished)."""
        e, manager = self.engine, self.engine.manager
        # each prompt is read in chunks of max_num_batched_tokens, whatever else runs: chunk boundaries decide
        # which queries vote for importance, so the same item is scored the same alone or in any batch
        prompt_chunk = e.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        owners: list[ItemState] = []
        continuation: set[int] = set()
        for st in active:
            seq = st.seq
            if not seq.prompt_done:
                n = min(seq.num_uncomputed, prompt_chunk)
            else:
                end = min(len(seq.token_ids) + self._chunk(), len(st.item.token_ids) - 1)
                seq.token_ids.extend(st.item.token_ids[len(seq.token_ids) : end])
                n = seq.num_uncomputed
                continuation.add(seq.seq_id)
            manager.reserve(seq.kv, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            owners.append(st)
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens != 1)
        chunks = [chunks[i] for i in order]
        owners = [owners[i] for i in order]
        capture = {
            ch.seq.seq_id
            for ch in chunks
            if ch.samples and ch.seq.controller.recalls and e.host.has_blocks(ch.seq.seq_id)
        }
        res = e.runner.run(chunks, capture=capture, all_rows=continuation)
        e.runner.commit(res)
        signals = confidence_signals(res.logits) if res.logits.shape[0] else None
        host = signals.stacked().cpu() if signals is not None else None

        reported: list[ItemState] = []
        for ch, st, resident, (row0, count) in zip(chunks, owners, res.resident, res.spans, strict=True):
            seq, kv = ch.seq, ch.seq.kv
            seq.num_computed += ch.num_tokens
            kv.stats.record_compute(resident, len(kv.table.device_blocks()), generated=False)
            if count == 0:
                manager.after_step(kv, seq.ctrl.budget, ch.num_tokens, seq.prompt_done)
                continue
            assert signals is not None and host is not None
            rows = slice(row0, row0 + count)
            first_pos = ch.start + ch.num_tokens - count  # position of the first row with logits
            targets = torch.tensor(st.item.token_ids[first_pos + 1 : first_pos + 1 + count], device=res.logits.device)
            lp = signals.logprobs[rows]
            st.last = {}
            keys = torch.arange(resident - count + 1, resident + 1)
            st.add(
                token_logprobs=lp.gather(-1, targets[:, None])[:, 0].cpu(),
                entropy=host[0, rows],
                gap=host[1, rows],
                top1_prob=host[2, rows],
                resident=keys,
                full=torch.arange(first_pos + 1, first_pos + count + 1),
                greedy_match=(signals.top1_id[rows] == targets).cpu(),
            )
            ref = st.item.reference
            if ref is not None:
                done_rows = sum(t.numel() for t in st.rows["kl"]) if "kl" in st.rows else 0
                part = TopK(ref.ids[done_rows : done_rows + count], ref.logprobs[done_rows : done_rows + count])
                st.add(kl=kl_from_topk(part, lp))
            if keep_topk:
                top = lp.topk(keep_topk, dim=-1)
                st.add(topk_ids=top.indices.cpu(), topk_logprobs=top.values.cpu())
            st.chunk_resident.append(resident)
            self._control(res, st, host[:, rows])
            kv.stats.resident_sum += int(keys.sum())
            kv.stats.resident_count += count
            reported.append(st)
            if seq.num_computed >= len(st.item.token_ids) - 1:
                st.done = True
            else:
                manager.after_step(kv, seq.ctrl.budget, ch.num_tokens, True)
        return reported

    def _control(self, res: Any, st: ItemState, signals: torch.Tensor) -> None:
        """Feed every token's signals to the item's controller in order; expand (with recall) at the chunk's end."""
        e, c, seq = self.engine, st.controller, st.seq
        state = seq.ctrl
        keys = st.last["resident"].tolist()
        positions = st.last["full"].tolist()
        usage = e.pool.usage
        for (ent, gap, top1), resident, position in zip(signals.t().tolist(), keys, positions, strict=True):
            state = c.update(state, StepSignals(ent, gap, top1, resident, position, usage))
            st.budgets.append(state.budget if c.evicts else math.inf)
        kv = seq.kv
        if state.budget > kv.budget:
            kv.stats.expansions += 1
            kv.budget = state.budget
            row = res.captured.get(seq.seq_id)
            if row is not None:
                q = torch.stack([layer_q[row] for layer_q in res.batch.captured_q])
                lse = torch.stack([layer_lse[row] for layer_lse in res.batch.captured_lse])
                e.manager.recall(kv, q, lse)
        seq.ctrl = state

    def _finish(self, st: ItemState, keep_topk: int) -> ScoreResult:
        e, seq = self.engine, st.seq
        cat = {k: torch.cat(v) for k, v in st.rows.items()}
        n = int(cat["token_logprobs"].numel())
        kv = seq.kv.stats.summary(len(st.item.token_ids), e.pool.bytes_per_block)
        e.manager.close(seq.kv)
        return ScoreResult(
            token_logprobs=cat["token_logprobs"],
            entropy=cat["entropy"],
            gap=cat["gap"],
            top1_prob=cat["top1_prob"],
            resident=cat["resident"],
            full=cat["full"],
            budget=torch.tensor(st.budgets[:n]),
            chunk_resident=st.chunk_resident,
            kv=kv,
            greedy_match=cat["greedy_match"],
            kl=cat.get("kl"),
            topk=TopK(cat["topk_ids"], cat["topk_logprobs"]) if keep_topk else None,
        )


class ScoringSession:
    """Items scored chunk by chunk, added at any time: ``Scorer.score`` runs one to the end, an RL environment
    steps one and changes an item's controller between steps.

    Admission reserves each item's worst-case blocks, so a step never has to preempt; items that do not fit yet
    wait in order.
    """

    def __init__(self, scorer: Scorer, keep_topk: int = 0) -> None:
        self.scorer = scorer
        self.keep_topk = keep_topk
        self._items: list[ScoreItem] = []
        self._controllers: list[Controller | None] = []
        self._pending: deque[int] = deque()
        self.active: list[ItemState] = []
        self._results: dict[int, ScoreResult] = {}
        self._reserved = 0

    def __enter__(self) -> ScoringSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, item: ScoreItem, controller: Controller | None = None) -> int:
        self.scorer.check(item)
        self._items.append(item)
        self._controllers.append(controller)
        self._pending.append(len(self._items) - 1)
        return len(self._items) - 1

    @property
    def finished(self) -> bool:
        return not self._pending and not self.active

    def state(self, index: int) -> ItemState | None:
        return next((st for st in self.active if st.index == index), None)

    def result(self, index: int) -> ScoreResult:
        return self._results[index]

    @torch.inference_mode()
    def step(self, only: set[int] | None = None) -> list[ItemState]:
        """Admit what fits, run one forward pass, finish completed items; returns the items that scored rows.

        ``only``: advance just these items (the others wait), as an environment resetting one slot needs.
        """
        scorer, e = self.scorer, self.scorer.engine
        while self._pending and len(self.active) < e.config.max_batch_size:
            i = self._pending[0]
            need = scorer._worst_blocks(self._items[i])
            if self.active and self._reserved + need > e.pool.num_blocks:
                break
            self._pending.popleft()
            self.active.append(scorer._open(i, self._items[i], self._controllers[i]))
            self._reserved += need
        if not self.active:
            return []
        running = self.active if only is None else [st for st in self.active if st.index in only]
        if not running:
            return []
        reported = scorer._step(running, self.keep_topk)
        for st in reported:
            if st.done:
                self.active.remove(st)
                self._reserved -= scorer._worst_blocks(st.item)
                self._results[st.index] = scorer._finish(st, self.keep_topk)
        return reported

    def close(self) -> None:
        """Free the blocks of items still in flight (an abandoned episode must not leak the pool)."""
        for st in self.active:
            self.scorer.engine.manager.close(st.seq.kv)
        self.active.clear()
        self._pending.clear()
