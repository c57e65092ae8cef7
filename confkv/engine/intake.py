"""Admission: every request is checked here, once, before any state is made for it.

One function takes a request as a caller has it (text, token ids or a chat's messages; sampling parameters as an
object or as keywords; per-request policy overrides; a session id; the limits a server sets) and either returns the
``Sequence`` the scheduler will run or raises a ``ConfkvError`` whose ``param`` names the field at fault (OpenAI's
``param``: ``prompt``, ``messages``, ``max_tokens``, ``cache_policy``, ``session_id`` or a sampling field), with
``SessionBusy`` for a session that already has a turn running. The request's controller is built here, once, and
its defaults are set here, once: a request that names no ``max_tokens`` through a server gets the rest of the
context, capped by the server's limit. The Python API, the CLI and the server all come through it, so they refuse
the same things with the same messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from confkv.cache.manager import CacheManager
from confkv.engine.params import SamplingParams
from confkv.engine.policy_swap import PolicySwitch
from confkv.engine.scheduler import Scheduler
from confkv.engine.sequence import Sequence
from confkv.errors import ConfkvError
from confkv.sessions.tiers import SessionTiers

Prompt = str | list[int] | list[dict[str, Any]]


@dataclass(frozen=True)
class RequestLimits:
    """What a server allows beyond the model's own context (None: the context is the only limit)."""

    max_prompt_tokens: int | None = None
    #: the most ``max_tokens`` a request may ask for; a request that asks none gets the rest of the context, capped
    #: by this
    max_tokens: int | None = None


class Intake:
    """Turns requests into sequences (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        seed: int,
        manager: CacheManager,
        scheduler: Scheduler,
        sessions: SessionTiers,
        policies: PolicySwitch,
        new_seq_id: Callable[[], int],
        live: Mapping[str, Sequence],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        self.seed = seed
        self.manager = manager
        self.scheduler = scheduler
        self.sessions = sessions
        self.policies = policies
        self.new_seq_id = new_seq_id
        self.live = live

    # ---------------------------------------------------------------------------------------------- prompts
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenize_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def tokenize_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """The model's chat template over a whole conversation, ending with the assistant's turn to speak."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _prompt_ids(self, prompt: Prompt, chat: bool, param: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfkvError("prompt is empty", param=param)
            return prompt, self.tokenize(prompt, chat=chat)
        if prompt and isinstance(prompt[0], dict):
            try:
                return None, self.tokenize_messages(prompt)  # type: ignore[arg-type]
            except Exception as err:  # a template's own refusal (a role it does not take) is the request's fault
                raise ConfkvError(f"cannot prepare the prompt: {err}", param=param) from None
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ConfkvError(f"prompt token ids must lie in [0, {self.vocab_size})", param=param)
        return None, ids

    # ----------------------------------------------------------------------------------------------- checks
    def _sampling(self, params: SamplingParams | Mapping[str, Any] | None, prompt_len: int,
                  limits: RequestLimits) -> SamplingParams:  # fmt: skip
        if isinstance(params, SamplingParams):
            if limits.max_tokens is not None and params.max_tokens > limits.max_tokens:
                raise self._too_many_tokens(params.max_tokens, limits.max_tokens)
            self._check_vocabulary(params)
            return params
        kwargs = dict(params or {})
        if kwargs.get("max_tokens") is None:
            if limits.max_tokens is not None:  # a server: the rest of the context, within its limit
                kwargs["max_tokens"] = max(1, min(limits.max_tokens, self.max_model_len - prompt_len))
            else:
                kwargs.pop("max_tokens", None)
        elif limits.max_tokens is not None and kwargs["max_tokens"] > limits.max_tokens:
            raise self._too_many_tokens(kwargs["max_tokens"], limits.max_tokens)
        params = SamplingParams(**kwargs)
        self._check_vocabulary(params)
        return params

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """``top_k`` at most the vocabulary, and every stop token id one of the model's."""
        if params.top_k > self.vocab_size:
            raise ConfkvError(f"top_k is {params.top_k}; this model has {self.vocab_size} tokens", param="top_k")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfkvError(f"stop_token_ids: {bad[0]} is not a token id of this model (they lie in [0, "
                              f"{self.vocab_size}))", param="stop_token_ids")  # fmt: skip

    @staticmethod
    def _too_many_tokens(asked: int, limit: int) -> ConfkvError:
        return ConfkvError(f"max_tokens is {asked}; this server allows at most {limit}", param="max_tokens")

    def _check_length(self, n: int, limits: RequestLimits, param: str) -> None:
        if limits.max_prompt_tokens is not None and n > limits.max_prompt_tokens:
            raise ConfkvError(f"prompt has {n} tokens; this server accepts at most {limits.max_prompt_tokens} "
                              f"(context {self.max_model_len})", param=param)  # fmt: skip
        if n >= self.max_model_len:
            raise ConfkvError(f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens",
                              param=param)  # fmt: skip

    def _fits(self, seq: Sequence, message: str) -> None:
        need = self.scheduler.committed(seq)
        pool = self.manager.pool
        if need > pool.num_blocks:
            self.manager.close(seq.kv)
            raise ConfkvError(message.format(need=need, blocks=pool.num_blocks, mib=pool.total_bytes / 2**20))

    def _check_id(self, request_id: str) -> None:
        if request_id in self.live:
            raise ConfkvError(f"request id {request_id!r} is already in use")

    # ------------------------------------------------------------------------------------------------ admit
    def admit(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        chat: bool = False,
        policy_overrides: dict[str, Any] | None = None,
        session_id: str | None = None,
        limits: RequestLimits | None = None,
    ) -> Sequence:
        """A generation request, checked (see the module docstring); the caller queues the returned sequence."""
        limits = limits or RequestLimits()
        self._check_id(request_id)
        param = "messages" if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict) else "prompt"
        text, token_ids = self._prompt_ids(prompt, chat, param)
        if not token_ids:
            raise ConfkvError("prompt is empty", param=param)
        self._check_length(len(token_ids), limits, param)
        sampling = self._sampling(params, len(token_ids), limits)
        try:
            controller = self.policies.controller_for(policy_overrides)
        except ConfkvError as err:
            raise ConfkvError(f"cache_policy: {err}", param="cache_policy") from None
        if session_id is not None:
            self.sessions.check(session_id)  # before any state is made for the request
        seq_id = self.new_seq_id()
        state = controller.init_state()
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed if sampling.seed is not None else self.seed + seq_id)
        seq = Sequence(
            seq_id=seq_id,
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=sampling,
            kv=self.manager.open(seq_id, controller, state.budget),
            ctrl=state,
            generator=generator,
            overrides=dict(policy_overrides or {}),
            logprobs=[] if sampling.logprobs is not None else None,
        )
        self._fits(seq, "request needs {need} KV blocks under policy " + repr(controller.name) + " but the pool "
                   "holds {blocks} ({mib:.1f} MiB); raise kv_cache_memory or shorten the request")  # fmt: skip
        if session_id is not None:
            self.sessions.attach(seq, session_id)
        return seq

    def admit_scored(
        self,
        request_id: str,
        token_ids: list[int],
        score_from: int,
        recorder: Any,
        *,
        controller: Any = None,
        chunk: int | None = None,
        paused: bool = False,
    ) -> Sequence:
        """A text for teacher-forced scoring: its first ``score_from`` tokens are read as a prompt, then the rest is
        fed ``chunk`` tokens at a time (default ``compact_interval``), each step's rows handed to
        ``recorder.record(first_position, signals, resident, budgets)``."""
        if len(token_ids) < 2 or not 1 <= score_from < len(token_ids):
            raise ConfkvError(f"a scored text needs score_from in [1, {len(token_ids) - 1}] (got {score_from})")
        if len(token_ids) > self.max_model_len:
            raise ConfkvError(f"a scored text has {len(token_ids)} tokens; the context is {self.max_model_len}")
        self._check_id(request_id)
        controller = controller or self.policies.controller
        seq_id = self.new_seq_id()
        state = controller.init_state()
        seq = Sequence(
            seq_id=seq_id,
            request_id=request_id,
            prompt=None,
            prompt_token_ids=list(token_ids[:score_from]),
            params=SamplingParams(max_tokens=len(token_ids) - score_from),
            kv=self.manager.open(seq_id, controller, state.budget),
            ctrl=state,
            forced=list(token_ids),
            forced_chunk=chunk or controller.policy.compact_interval,
            recorder=recorder,
            paused=paused,
        )
        self._fits(seq, "a scored text does not fit in the KV pool; raise kv_cache_memory")
        return seq
