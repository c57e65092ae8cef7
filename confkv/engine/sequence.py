"""A request's state inside the engine, and what it reports when done."""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from confkv.cache.state import SequenceKV
from confkv.controllers import BudgetState, Controller, StepSignals
from confkv.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Trace:
    """Per generated token: the signals, the resident KV when it was computed, and the budget after it."""

    entropy: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    top1_prob: list[float] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)
    budget: list[float] = field(default_factory=list)
    expanded: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and, if asked for, the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kv: SequenceKV
    ctrl: BudgetState
    generator: torch.Generator | None = None
    #: Policy keys this request overrides (kept so that a policy swap re-applies them to the new policy).
    overrides: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt then output
    num_computed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    trace: Trace = field(default_factory=Trace)
    #: Per generated token, when ``params.logprobs`` is set: the chosen token's log-probability and the top ones.
    logprobs: list[TokenLogprobs] | None = None
    #: Teacher-forced scoring: the whole text to score (prompt = its first ``num_prompt_tokens``); the engine feeds
    #: it in chunks of ``forced_chunk`` tokens instead of sampling, and hands every chunk's rows to ``recorder``.
    forced: list[int] | None = None
    forced_chunk: int = 0
    recorder: Any = None
    #: Left out of scheduling while set (an environment advancing only some of its episodes).
    paused: bool = False
    #: The newest sampling query and its log-sum-exp over the resident keys (what a recall between steps needs).
    last_query: tuple[torch.Tensor, torch.Tensor] | None = None
    #: Trailing computed tokens to compute again, with the blocks a recall just brought back, before the next token
    #: is chosen: done as a row of the next step's batch rather than a forward pass of its own.
    rerun: int = 0
    #: Per generated token, the signals its controller decided on: after a recall the token is chosen from the
    #: second pass (what ``trace`` records) but the budget moved on the first pass's, which a learned controller
    #: trained on this record (``envs.decode_env``) must see as serving will.
    decided_on: list[StepSignals] = field(default_factory=list)
    pending_signals: StepSignals | None = None
    #: The first generated token computed over a trimmed context since the last recomputation (``recompute:
    #: stale``): its keys and values, and those of every token after it, differ from what the whole context gives.
    stale_from: int | None = None
    #: Sessions: the conversation this request continues, the prompt tokens whose KV it reused, and whether it is
    #: waiting for its record to come back from object storage (and how long that took).
    session_id: str | None = None
    cached_tokens: int = 0
    restoring: bool = False
    restore_started: float = 0.0
    restore_s: float | None = None
    preemptions: int = 0
    #: Preempted by on-demand admission with its blocks swapped to the host tier: their logical indices, which
    #: come back to the device when it is admitted again.
    swapped: list[int] | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def controller(self) -> Controller:
        """What sets this sequence's budget and how its blocks are ranked (an RL agent may replace it)."""
        return self.kv.controller

    @controller.setter
    def controller(self, value: Controller) -> None:
        self.kv.controller = value

    @property
    def scored(self) -> bool:
        return self.forced is not None

    def next_forced_chunk(self) -> list[int]:
        """The forced tokens to compute next: up to ``forced_chunk``, never the text's last token (only a target)."""
        assert self.forced is not None
        start = len(self.token_ids)
        return self.forced[start : min(start + self.forced_chunk, len(self.forced) - 1)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (and the engine per finished request)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    kv: dict[str, Any]
    signals: dict[str, dict[str, float | None]]
    timing: dict[str, float]
    trace: Trace
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    session_id: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the session (OpenAI's usage.prompt_tokens_details)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self, with_trace: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "kv": self.kv,
            "signals": self.signals,
            "timing": self.timing,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.session_id is not None:
            out["session_id"] = self.session_id
            out["cached_tokens"] = self.cached_tokens
        if self.logprobs is not None:
            out["logprobs"] = [asdict(t) for t in self.logprobs]
        if with_trace:
            out["trace"] = asdict(self.trace)
        return out

    @classmethod
    def from_sequence(cls, seq: Sequence, bytes_per_block: int) -> RequestOutput:
        generated = len(seq.output_token_ids)
        kv = seq.kv.stats.summary(seq.num_prompt_tokens + generated, bytes_per_block, seq.kv.table.block_size)
        kv["preemptions"] = seq.preemptions
        t0 = seq.first_scheduled_time or seq.arrival_time
        t1 = seq.first_token_time or t0
        t2 = seq.finish_time or t1
        decode_s = t2 - t1
        timing = {
            "queue_s": t0 - seq.arrival_time,
            "prefill_s": t1 - t0,
            "decode_s": decode_s,
            "tokens_per_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
        }
        if seq.restore_s is not None:
            timing["restore_s"] = seq.restore_s
        signals = {
            "entropy": _summary(seq.trace.entropy),
            "gap": _summary(seq.trace.gap),
            "top1_prob": _summary(seq.trace.top1_prob),
        }
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            kv=kv,
            signals=signals,
            timing=timing,
            trace=seq.trace,
            error=seq.error,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            session_id=seq.session_id,
            cached_tokens=seq.cached_tokens,
        )


@dataclass
class StepOutput:
    """What one step did for one request: its new token (if any) and, once finished, the full output.

    ``entropy``, ``gap``, ``top1_prob`` and ``resident`` describe the step that chose the token (for metrics);
    ``logprob`` is the token's log-probability and ``top_logprobs`` the most likely alternatives when the request
    asked for them. ``error`` is set when the request failed (alone: the others continue).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None
    error: str | None = None
    entropy: float | None = None
    gap: float | None = None
    top1_prob: float | None = None
    resident: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
