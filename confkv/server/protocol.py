"""Request and response bodies in OpenAI's shapes (the subset confkv serves), as pydantic models.

Numbers and booleans are strict (``"5"`` is not a max_tokens, ``"yes"`` not a bool) so a wrong type is a 400 that
names the field rather than a silent coercion; the values of ``cache_policy`` too (:func:`policy_type_error`: the
HTTP layer is stricter than ``CachePolicy``, which YAML files and ``key=value`` overrides rely on to read ``"2048"``).
Text the tokenizer cannot take (a lone surrogate, as JSON's ``"\\ud800"`` escape makes) is refused here as well.
Unknown fields are ignored as OpenAI-compatible servers do (clients send ``user``, ``metadata`` ...), but fields
whose meaning confkv cannot honour (``n`` > 1, tools, penalties, logit bias, JSON mode) are refused by
:func:`unsupported` instead of being dropped without a word.

Two extra body fields carry confkv's own features: ``cache_policy`` (per-request overrides of cache-policy keys,
their types checked here, their values by the engine) and ``session_id`` (continue that session: the prompt reuses
the KV the session kept, and the reused tokens are reported in ``usage.prompt_tokens_details.cached_tokens``, where
OpenAI reports its prompt cache). ``top_k``, ``ignore_eos`` and ``stop_token_ids`` are vLLM's extra sampling
fields, accepted the same way.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator

from confkv.config import MAX_TOKENS, CachePolicy, format_validation_error
from confkv.sessions.store import SESSION_ID_RE

SInt = Annotated[int, Field(strict=True)]
SFloat = Annotated[float, Field(strict=True)]
SBool = Annotated[bool, Field(strict=True)]
SStr = Annotated[str, Field(strict=True)]

#: OpenAI allows 4 stop strings; vLLM more. A bound keeps the per-token hold-back check cheap.
MAX_STOP_STRINGS = 16
#: vLLM has no bound on ``stop_token_ids``; one keeps the per-token stop check cheap, far above any real use.
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
#: A count of tokens (``max_tokens``, ``top_k``) or a token id: at most ``MAX_TOKENS``; the server's limits and the
#: model's vocabulary bound them further once the request is admitted.
Tokens = Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


#: ``CachePolicy``'s keys with their types only (ranges and cross-field rules stay ``CachePolicy``'s), validated
#: strictly: ``"2048"`` is not a size, ``"yes"`` or ``1`` not a bool, ``true`` not a number. Unknown keys pass through
#: to ``CachePolicy`` and the engine, which name them. ``host_cache_memory`` keeps its unit strings (``"2GiB"``).
_StrictPolicyValues = create_model(
    "_StrictPolicyValues",
    __config__=ConfigDict(strict=True, extra="allow"),
    **{name: (field.annotation, None) for name, field in CachePolicy.model_fields.items()},
)


def policy_type_error(values: dict[str, Any]) -> tuple[str, str | None] | None:
    """``(message, first key)`` when a cache-policy value of a request has the wrong JSON type, else None."""
    try:
        _StrictPolicyValues.model_validate(values)
    except ValidationError as err:
        loc = err.errors()[0].get("loc", ())
        return format_validation_error(err, "cache policy"), (str(loc[0]) if loc else None)
    return None


def check_text(value: str, what: str) -> str:
    """``value``, or ValueError when it is not valid Unicode text (a lone surrogate from a JSON ``\\ud800`` escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = value[err.start : err.end]
        raise ValueError(
            f"{what} is not valid Unicode text: it contains a lone surrogate ({ascii(bad)[1:-1]} at character "
            f"{err.start}); send the text as UTF-8 or escape whole surrogate pairs"
        ) from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: SBool = False


def _null_is_default(cls: type[BaseModel], v: Any, info: ValidationInfo) -> Any:
    """``null`` for a field with a default means the default, as OpenAI and vLLM read it: the ``openai`` client
    sends ``null`` for any argument given as ``None``, which its types allow (``n=None``, ``logprobs=None``)."""
    return cls.model_fields[info.field_name].default if v is None else v


class _SamplingFields(BaseModel):
    """What completions and chat share: sampling, streaming and confkv's extras."""

    model_config = ConfigDict(extra="ignore")

    model: SStr
    max_tokens: Tokens | None = None
    temperature: Annotated[float | None, Field(strict=True, ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(strict=True, gt=0, le=1)] = None
    top_k: Annotated[int | None, Field(strict=True, ge=-1, le=MAX_TOKENS)] = None
    seed: SInt | None = None
    stop: SStr | list[SStr] | None = None
    stop_token_ids: Annotated[
        list[Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)]] | None, Field(max_length=MAX_STOP_TOKEN_IDS)
    ] = None
    ignore_eos: SBool = False
    n: Annotated[int, Field(strict=True, ge=1)] = 1
    stream: SBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: SFloat | None = None
    frequency_penalty: SFloat | None = None
    logit_bias: dict[str, Any] | None = None
    user: SStr | None = None
    cache_policy: dict[str, Any] | None = Field(None, description="per-request cache-policy overrides")
    session_id: SStr | None = Field(None, description="continue this session (1-128 of [A-Za-z0-9._-])")

    # one rule for the fields of both requests (``echo`` is the completions', ``logprobs`` both's, with their own
    # defaults)
    _defaults = field_validator("ignore_eos", "n", "stream", "echo", "logprobs", mode="before", check_fields=False)(
        classmethod(_null_is_default)
    )

    @field_validator("stop")
    @classmethod
    def _bound_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        for s in stops:
            check_text(s, "a stop string")
        return v

    @field_validator("cache_policy")
    @classmethod
    def _strict_policy_values(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and (refused := policy_type_error(v)) is not None:
            raise ValueError(refused[0])
        return v

    @field_validator("session_id")
    @classmethod
    def _valid_session_id(cls, v: str | None) -> str | None:
        """A session id names objects in the store, so it is checked here: a bad one is a 400 before admission."""
        if v is not None and not SESSION_ID_RE.fullmatch(v):
            raise ValueError("use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def common_unsupported(self) -> tuple[str, str] | None:
        if self.n != 1:
            return "n", "only n=1 is supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def sampling_kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams`` (validated again there; ``max_tokens`` None = fill in later)."""
        out: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(0, self.top_k or 0),
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            out["seed"] = self.seed
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: SStr | list[SStr] | list[SInt] | list[list[SInt]]
    logprobs: Annotated[int | None, Field(strict=True, ge=0, le=MAX_LOGPROBS)] = None
    echo: SBool = False
    suffix: SStr | None = None
    best_of: SInt | None = None

    @field_validator("prompt")
    @classmethod
    def _unicode_prompt(cls, v: Any) -> Any:
        texts = [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)]
        for text in texts:
            check_text(text, "the prompt")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        return self.common_unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request; a batch of prompts is refused (n=1 servers batch across requests)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) != 1:
            raise ValueError("only one prompt per request is supported; send one request per prompt")
        return p[0] if isinstance(p[0], str) else list(p[0])  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: SStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: SStr | list[TextPart] | None = None
    name: SStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: the whole message list goes through the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Tokens | None = None
    logprobs: SBool = False
    top_logprobs: Annotated[int | None, Field(strict=True, ge=0, le=MAX_LOGPROBS)] = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _unicode_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(v):
            check_text(m.text(), f"the content of message {i}")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool calling is not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only response_format type 'text' is supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        return self.common_unsupported()

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Plain ``{"role", "content"}`` dicts for ``apply_chat_template``; OpenAI's ``developer`` is ``system``."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ----------------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    """OpenAI's breakdown of the prompt: ``cached_tokens`` are those whose KV came from the request's session."""

    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class _Envelope(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    session_id: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    #: confkv's own per-request KV statistics (resident tokens, evictions, recalls), beside OpenAI's fields.
    kv: dict[str, Any] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage | None = None
    kv: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "confkv"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
