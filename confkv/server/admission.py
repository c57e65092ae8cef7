"""The engine thread's admission of one request: tokenize it and check it against the server's limits, before the
engine sees it. Runs on the engine thread (it owns the tokenizer); a refusal is a :class:`RequestRejected` carrying
the body field at fault, answered as a 4xx before any stream starts, and leaves nothing behind in the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confkv.engine.params import SamplingParams
from confkv.errors import ConfkvError
from confkv.server.channel import GenerateRequest, RequestRejected, SessionBusy
from confkv.sessions.store import check_session_id

if TYPE_CHECKING:
    from confkv.engine.engine import LLMEngine


@dataclass(frozen=True)
class Limits:
    """What this server allows a request: prompt tokens, ``max_tokens``, the model's context, and its vocabulary
    (None where the engine does not say) that ``top_k`` and ``stop_token_ids`` must keep within."""

    max_prompt_tokens: int
    max_tokens_limit: int
    max_model_len: int
    vocab_size: int | None = None


@dataclass
class Admitted:
    """A request ready for ``engine.add_request``."""

    ids: list[int]
    params: SamplingParams
    extra: dict[str, Any]


def tokenize(engine: LLMEngine, req: GenerateRequest) -> list[int]:
    if req.messages is not None:
        return list(engine.tokenize_messages(req.messages))
    if isinstance(req.prompt, str):
        if not req.prompt.strip():
            raise ConfkvError("prompt is empty")
        return list(engine.tokenize(req.prompt))
    return [int(t) for t in req.prompt or []]


def check_vocabulary(sampling: dict[str, Any], vocab_size: int | None) -> None:
    """``top_k`` at most the vocabulary, and every stop token id one of the model's."""
    if vocab_size is None:
        return
    if sampling.get("top_k", 0) > vocab_size:
        raise RequestRejected(f"top_k is {sampling['top_k']}; this model has {vocab_size} tokens", "top_k")
    bad = [t for t in sampling.get("stop_token_ids", ()) if t >= vocab_size]
    if bad:
        raise RequestRejected(
            f"stop_token_ids: {bad[0]} is not a token id of this model (they lie in [0, {vocab_size}))",
            "stop_token_ids",
        )


def vocab_size_of(engine: LLMEngine) -> int | None:
    """The model's vocabulary size, or None for an engine without a model config (a test's stand-in)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    size = getattr(config, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def admit(engine: LLMEngine, req: GenerateRequest, limits: Limits) -> Admitted:
    """The request's token ids, sampling parameters and engine keywords, or the :class:`RequestRejected` that
    refuses it (with its ``param``); the default ``max_tokens`` (the rest of the context, within the limit) is set
    here when the request has none."""
    prompt_param = "messages" if req.messages is not None else "prompt"
    try:
        ids = tokenize(engine, req)
    except ConfkvError as err:
        raise RequestRejected(str(err), prompt_param) from None
    if not ids:
        raise RequestRejected("prompt is empty", prompt_param)
    if len(ids) > limits.max_prompt_tokens:
        raise RequestRejected(
            f"prompt has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens} "
            f"(context {limits.max_model_len})",
            prompt_param,
        )
    kwargs = dict(req.sampling)
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = max(1, min(limits.max_tokens_limit, limits.max_model_len - len(ids)))
    elif kwargs["max_tokens"] > limits.max_tokens_limit:
        raise RequestRejected(
            f"max_tokens is {kwargs['max_tokens']}; this server allows at most {limits.max_tokens_limit}",
            "max_tokens",
        )
    if req.logprobs is not None:
        kwargs["logprobs"] = req.logprobs
    check_vocabulary(kwargs, limits.vocab_size)
    try:
        params = SamplingParams(**kwargs)
    except ConfkvError as err:
        field = err.param or next((k for k in kwargs if f": {k}:" in f": {err}" or f" {k}:" in str(err)), None)
        raise RequestRejected(str(err), field) from None
    if req.policy_overrides:
        try:
            engine.controller_for(req.policy_overrides)
        except ConfkvError as err:
            raise RequestRejected(f"cache_policy: {err}", "cache_policy") from None
    extra: dict[str, Any] = {}
    if req.session_id is not None:
        # checked before the engine sees it: a refused turn must leave nothing behind in the engine
        try:
            check_session_id(req.session_id)
        except ConfkvError as err:
            raise RequestRejected(str(err), "session_id") from None
        if req.session_id in engine.sessions.active:
            raise SessionBusy(
                f"session {req.session_id!r} already has a request running; send one turn at a time", "session_id"
            )
        extra["session_id"] = req.session_id
    return Admitted(ids, params, extra)
