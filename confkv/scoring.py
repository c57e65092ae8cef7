"""Teacher-forced scoring under any cache policy, as a mode of the engine's own step.

Free decoding costs one forward pass per token; scoring a fixed continuation in chunks of ``compact_interval``
tokens costs one pass per chunk, which is what makes quality measurement (and reinforcement learning) affordable
on a CPU. The engine runs it (``LLMEngine.add_scored``): the context is read as a prompt (the policy keeps up to
``max_size``), then each chunk of the continuation attends over the resident blocks plus itself; the controller sees
every token's signals in order, and between chunks the cache manager expands (recalling host blocks with the
chunk's last query), contracts and evicts exactly as it does between decode steps, through the same code, so what a
tuner trains on is what serving runs. What differs from decoding: a recall set off inside a chunk takes effect
from the next chunk, not for the token itself. Chunks of one token (``compact_interval: 1``) score exactly as
decoding would: a recall is applied to the token that set it off, computed again. This module only keeps what each
chunk's rows say.

A scored item is ``token_ids`` with ``score_from``: token ``i >= score_from`` is scored by the distribution the
model gives after reading tokens ``0 .. i-1``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from confkv.confidence import Signals
from confkv.controllers import Controller
from confkv.engine.engine import LLMEngine
from confkv.engine.sequence import Sequence
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
    """One item in flight, and the recorder the engine hands each chunk's rows to.

    ``last`` holds the rows of the latest session step, one chunk (the segment an RL step observes); ``controller``
    may be replaced between steps, which is how an agent changes the knobs of one sequence.
    """

    index: int
    item: ScoreItem
    seq: Sequence = field(init=False)
    keep_topk: int = 0
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    last: dict[str, torch.Tensor] = field(default_factory=dict)
    chunk_resident: list[int] = field(default_factory=list)
    budgets: list[float] = field(default_factory=list)
    done: bool = False
    fresh: bool = False  # rows arrived in the latest step

    @property
    def controller(self) -> Controller:
        return self.seq.controller

    @controller.setter
    def controller(self, value: Controller) -> None:
        self.seq.controller = value

    def add(self, **tensors: torch.Tensor) -> None:
        for key, value in tensors.items():
            self.rows.setdefault(key, []).append(value)
            self.last[key] = torch.cat((self.last[key], value)) if key in self.last else value

    def record(self, first: int, signals: Signals, resident: int, budgets: list[float]) -> None:
        """Called by the engine: rows predicting tokens ``first + 1 ...`` were computed over ``resident`` keys."""
        count = int(signals.entropy.numel())
        ids = self.item.token_ids
        targets = torch.tensor(ids[first + 1 : first + 1 + count], device=signals.logprobs.device)
        lp = signals.logprobs
        host = signals.stacked().cpu()
        self.add(
            token_logprobs=lp.gather(-1, targets[:, None])[:, 0].cpu(),
            entropy=host[0],
            gap=host[1],
            top1_prob=host[2],
            resident=torch.arange(resident - count + 1, resident + 1),
            full=torch.arange(first + 1, first + count + 1),
            greedy_match=(signals.top1_id == targets).cpu(),
        )
        ref = self.item.reference
        if ref is not None:
            done_rows = sum(t.numel() for t in self.rows["kl"]) if "kl" in self.rows else 0
            part = TopK(ref.ids[done_rows : done_rows + count], ref.logprobs[done_rows : done_rows + count])
            self.add(kl=kl_from_topk(part, lp))
        if self.keep_topk:
            top = lp.topk(self.keep_topk, dim=-1)
            self.add(topk_ids=top.indices.cpu(), topk_logprobs=top.values.cpu())
        self.chunk_resident.append(resident)
        evicts = self.seq.controller.evicts
        self.budgets.extend(b if evicts else math.inf for b in budgets)
        self.fresh = True
        self.done = first + count >= len(ids) - 1

    def restart(self) -> None:
        """The engine preempted the sequence and scores it again from its prompt."""
        self.rows.clear()
        self.last.clear()
        self.chunk_resident.clear()
        self.budgets.clear()

    def result(self, bytes_per_block: int) -> ScoreResult:
        cat = {k: torch.cat(v) for k, v in self.rows.items()}
        n = int(cat["token_logprobs"].numel())
        return ScoreResult(
            token_logprobs=cat["token_logprobs"],
            entropy=cat["entropy"],
            gap=cat["gap"],
            top1_prob=cat["top1_prob"],
            resident=cat["resident"],
            full=cat["full"],
            budget=torch.tensor(self.budgets[:n]),
            chunk_resident=self.chunk_resident,
            kv=self.seq.kv.stats.summary(len(self.item.token_ids), bytes_per_block, self.seq.kv.table.block_size),
            greedy_match=cat["greedy_match"],
            kl=cat.get("kl"),
            topk=TopK(cat["topk_ids"], cat["topk_logprobs"]) if self.keep_topk else None,
        )


class Scorer:
    """Scores items on an idle engine, sharing its model, pool, cache manager and controller."""

    def __init__(self, engine: LLMEngine, chunk_size: int | None = None) -> None:
        self.engine = engine
        self.chunk_size = chunk_size

    def session(self, keep_topk: int = 0) -> ScoringSession:
        if self.engine.has_unfinished_requests():
            raise ConfkvError("scoring needs an idle engine (requests are running)")
        return ScoringSession(self, keep_topk)

    def score(self, items: list[ScoreItem], *, keep_topk: int = 0, use_tqdm: bool = False) -> list[ScoreResult]:
        """Score every item; ``keep_topk > 0`` also returns that many top log-probs per token (a reference)."""
        with self.session(keep_topk) as session:
            indices = [session.add(item) for item in items]
            bar = tqdm(total=sum(len(it.token_ids) for it in items), disable=not use_tqdm, desc="score", unit="tok")
            with bar:
                while not session.finished:
                    for st in session.step():
                        if st.done:
                            bar.update(len(st.item.token_ids))
            return [session.result(i) for i in indices]


_sessions = itertools.count()


class ScoringSession:
    """Items scored chunk by chunk through the engine's step, added at any time: ``Scorer.score`` runs them to the
    end; an RL environment steps some of them and changes an item's controller between steps."""

    def __init__(self, scorer: Scorer, keep_topk: int = 0) -> None:
        self.scorer = scorer
        self.keep_topk = keep_topk
        self._name = f"score-{next(_sessions)}"
        self._live: dict[int, ItemState] = {}
        self._results: dict[int, ScoreResult] = {}
        self._count = 0

    def __enter__(self) -> ScoringSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rid(self, index: int) -> str:
        return f"{self._name}-{index}"

    def add(self, item: ScoreItem, controller: Controller | None = None) -> int:
        """Queue an item (scored from the next ``step``); a text that cannot fit raises ``ConfkvError``."""
        index = self._count
        st = ItemState(index, item, keep_topk=self.keep_topk)
        st.seq = self.scorer.engine.add_scored(
            self._rid(index), item.token_ids, item.score_from, st, controller=controller, chunk=self.scorer.chunk_size
        )
        self._count += 1
        self._live[index] = st
        return index

    @property
    def finished(self) -> bool:
        return not self._live

    def state(self, index: int) -> ItemState | None:
        return self._live.get(index)

    def result(self, index: int) -> ScoreResult:
        return self._results[index]

    def step(self, only: set[int] | None = None) -> list[ItemState]:
        """One engine step over the live items (``only``: just these; the others wait); returns the items that
        scored rows, ``done`` once finished."""
        if not self._live:
            return []
        stepped = [st for st in self._live.values() if only is None or st.index in only]
        for st in self._live.values():
            st.fresh = False
        for st in stepped:
            st.last = {}
        self._engine_step(stepped)
        # a one-token chunk that set off a recall is not done until its second pass
        while rerun := [st for st in stepped if st.seq.rerun and not st.seq.finished]:
            self._engine_step(rerun)
        self._raise_failed()
        reported = [st for st in self._live.values() if st.fresh]
        for st in reported:
            if st.done:
                del self._live[st.index]
                self._results[st.index] = st.result(self.scorer.engine.pool.bytes_per_block)
        return reported

    def _raise_failed(self) -> None:
        """An item the engine finished with an error never reports rows again: without this, ``Scorer.score`` would
        wait for it forever. The others stay live (``close`` frees them), as the engine left them intact."""
        failed = [st for st in self._live.values() if st.seq.finished and not st.done]
        for st in failed:
            del self._live[st.index]
        if failed:
            st = failed[0]
            reason = st.seq.error or st.seq.finish_reason
            raise ConfkvError(f"scoring item {st.index} ({len(st.item.token_ids)} tokens) failed: {reason}")

    def _engine_step(self, stepped: list[ItemState]) -> None:
        chosen = {st.index for st in stepped}
        for st in self._live.values():
            st.seq.paused = st.index not in chosen
        try:
            self.scorer.engine.step()
        finally:
            for st in self._live.values():
                st.seq.paused = False

    def close(self) -> None:
        """Free the blocks of items still in flight (an abandoned episode must not leak the pool)."""
        for index in list(self._live):
            self.scorer.engine.abort_request(self._rid(index))
        self._live.clear()
