"""Configuration: the cache policy (the requirement's keys and defaults) and the engine settings.

Both are pydantic models so that a YAML file, a ``--set KEY=VALUE`` override and a Python call are validated by
the same rules, and every error names the field and its allowed range. This module holds data only: controller and
scorer names are checked against the tables the policy layer registers in (``confkv.plugins``), and turning a name,
a file or a registry reference into a policy is ``confkv.policy_source``'s job.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

from confkv.errors import ConfkvError
from confkv.plugins import CONTROLLERS, SCORERS

#: The built-in policies, the ones benchmarks compare (``learned`` needs an exported policy folder).
BUILTIN_POLICIES: tuple[str, ...] = ("full", "window", "streaming", "h2o", "snapkv", "dynamic")
#: The most tokens any size or count may name (what an int32 index holds): a bound against typos and attacks, far past
#: any context a model has.
MAX_TOKENS = 2**31 - 1
#: The most bytes of host memory a policy may name (16 TiB): past any machine's memory, so a unit typo is refused.
MAX_MEMORY_BYTES = 2**44
#: The fewest tokens one engine step may take (a prompt's chunk with the decodes beside it).
MIN_BATCHED_TOKENS = 16
#: The old ``importance`` key, still read from policy files: what each value meant, as a scorer.
_IMPORTANCE_SCORERS = {"attention": "h2o", "recency": "recency"}


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where confkv keeps what it makes once (converted models, references, calibrations, sessions, built kernels):
    ``cache_dir``, else ``$CONFKV_CACHE``, else ``~/.cache/confkv``."""
    return Path(cache_dir or os.environ.get("CONFKV_CACHE") or Path.home() / ".cache" / "confkv")


class KeyValueError(ValueError):
    """A check across keys that names the key it is about: the error's ``param`` is that key, not a guess."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class CachePolicy(BaseModel):
    """How much KV history each sequence keeps on the device, and how it is chosen.

    ``base_size``/``max_size`` bound the confidence-driven budget of the ``dynamic`` controller and are the fixed
    budget (``max_size``) of the baselines. Sizes are in tokens; ``host_cache_memory`` is in bytes (``"2GiB"``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    controller: str = Field(
        "dynamic", description="the budget rule: full, window, streaming, h2o, snapkv, dynamic, fixed or learned"
    )
    base_size: int = Field(
        1024, ge=1, le=MAX_TOKENS, description="budget (tokens) the dynamic controller returns to when confident"
    )
    max_size: int = Field(4096, ge=1, le=MAX_TOKENS, description="the most tokens a sequence may keep on the device")
    entropy_threshold: float = Field(3.5, ge=0, description="entropy (nats) above which a step counts as uncertain")
    gap_threshold: float = Field(0.15, ge=0, le=1, description="top-1 minus top-2 probability below which: uncertain")
    scaling_factor: float = Field(0.8, gt=0, le=1, description="1.0 keeps the budget still; lower moves it faster")
    min_recent: int = Field(512, ge=0, le=MAX_TOKENS, description="most recent tokens never evicted")
    recent_share: float = Field(
        0.0, ge=0, le=1, description="share of the applied budget kept as the most recent tokens (at least min_recent)"
    )
    demote_dtype: Literal["none", "int4", "int2"] = Field(
        "none",
        description="blocks the budget leaves out stay on the device at this precision and are still attended to "
        "(a copy at the pool's precision goes to the host tier, for recall); none evicts them",
    )
    expand_by: Literal["budget", "recall"] = Field(
        "budget",
        description="what an expansion grows: the applied budget (recalled blocks, then new tokens fill it), or only "
        "the blocks recall brings back that draw at least a resident block's average attention",
    )
    reselect_after_prompt: bool = Field(
        False,
        description="once the prompt is read, its last query picks (reselect_share of) the blocks kept from the device "
        "and the host tier (the largest share any attention head gives a block), and its token is recomputed if host "
        "blocks came back; in teacher-forced scoring it takes effect from the next chunk (dynamic, learned)",
    )
    reselect_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="with reselect_after_prompt: share of the blocks chosen by the prompt's last query (the rest keep "
        "the scorer's ranking of the resident blocks)",
    )
    sink_tokens: int = Field(4, ge=0, le=MAX_TOKENS, description="first tokens never evicted (attention sinks)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    compact_interval: int = Field(50, ge=1, le=MAX_TOKENS, description="tokens between budget contractions")
    host_cache_memory: ByteSize = Field(
        ByteSize(2 * 1024**3), le=MAX_MEMORY_BYTES, description="bytes of host memory for evicted blocks"
    )
    memory_high_watermark: float = Field(0.9, gt=0, le=1, description="pool use that trips the circuit breaker")
    memory_low_watermark: float | None = Field(
        None,
        gt=0,
        le=1,
        description="pool use the breaker shrinks back under and where admission of evicting policies stops "
        "(default: memory_high_watermark - 0.1, or half the high mark when that is higher)",
    )
    snapkv_window: int = Field(
        32, ge=1, le=MAX_TOKENS, description="prompt queries that vote for the tokens snapkv keeps"
    )
    attention_decay: float = Field(
        0.95, ge=0, le=1, description="what each decode step multiplies the decayed scorer's recorded attention by"
    )
    scorer: str | None = Field(
        None,
        description="how evictable blocks are ranked: a scorer registered in confkv.scorers; default: the "
        "controller's own (dynamic: snapkv)",
    )
    recompute_tokens: int = Field(
        1, ge=1, le=MAX_TOKENS, description="trailing tokens recomputed after a recall (dynamic)"
    )
    recompute: Literal["last", "stale"] = Field(
        "last",
        description="what a recall recomputes: the last recompute_tokens tokens, or every generated token computed "
        "over a trimmed context since the last recomputation (up to min_recent)",
    )
    learned_path: str | None = Field(None, description="exported policy folder (controller 'learned')")

    @model_validator(mode="before")
    @classmethod
    def _read_importance(cls, values: Any) -> Any:
        """Policy files written before scorers existed say ``importance: attention|recency``."""
        if isinstance(values, dict) and "importance" in values:
            values = dict(values)
            old = values.pop("importance")
            if old not in _IMPORTANCE_SCORERS:
                raise KeyValueError(
                    "importance", f"importance must be attention or recency (got {old!r}); it is now the scorer key"
                )
            values.setdefault("scorer", _IMPORTANCE_SCORERS[old])
        return values

    @property
    def effective_scorer(self) -> str | None:
        """The scorer this policy ranks blocks with (``None`` for ``full``, which never evicts)."""
        rule = CONTROLLERS[self.controller]
        if rule.default_scorer is None or rule.preset:
            return rule.default_scorer
        return self.scorer or rule.default_scorer

    @model_validator(mode="after")
    def _check_ranges(self) -> CachePolicy:
        if self.controller not in CONTROLLERS:
            raise KeyValueError(
                "controller", f"controller must be one of {', '.join(CONTROLLERS)} (got {self.controller!r})"
            )
        if self.scorer is not None:
            if self.scorer not in SCORERS:
                raise KeyValueError("scorer", f"scorer must be one of {', '.join(SCORERS)} (got {self.scorer!r})")
            preset = preset_scorer(self.controller)
            if preset is not None and self.scorer != preset:
                raise KeyValueError(
                    "scorer",
                    f"controller {self.controller!r} is the preset fixed + {preset}; for another scorer use "
                    f"controller: fixed with scorer: {self.scorer}",
                )
        if self.memory_low_watermark is not None and self.memory_low_watermark > self.memory_high_watermark:
            raise KeyValueError(
                "memory_low_watermark",
                f"memory_low_watermark ({self.memory_low_watermark}) must be <= memory_high_watermark "
                f"({self.memory_high_watermark})",
            )
        if self.controller == "learned" and not self.learned_path:
            raise KeyValueError(
                "learned_path", "controller 'learned' needs learned_path: the folder of an exported policy"
            )
        if self.controller not in ("dynamic", "learned"):  # the fixed baselines only use max_size
            return self
        if self.max_size < self.base_size:
            raise KeyValueError("max_size", f"max_size ({self.max_size}) must be >= base_size ({self.base_size})")
        if self.min_recent + self.sink_tokens > self.max_size:
            raise KeyValueError(
                "min_recent",
                f"min_recent + sink_tokens ({self.min_recent} + {self.sink_tokens}) must be <= max_size "
                f"({self.max_size}) for the dynamic controller",
            )
        return self

    @property
    def low_watermark(self) -> float:
        """``memory_low_watermark``, or a tenth of the pool below the high mark (half the high mark, when that is
        higher: a high mark under 0.2 keeps a band of half itself)."""
        if self.memory_low_watermark is not None:
            return self.memory_low_watermark
        return max(self.memory_high_watermark * 0.5, self.memory_high_watermark - 0.1)

    def replace(self, **changes: Any) -> CachePolicy:
        """A validated copy with some fields changed (``model_copy`` would skip validation). Switching to a preset
        controller without naming a scorer takes the preset's own."""
        if preset_scorer(changes.get("controller")) is not None and "scorer" not in changes:
            changes["scorer"] = None
        return make_policy({**self.model_dump(), **changes})


def preset_scorer(controller: object) -> str | None:
    """The scorer a preset controller always ranks with; ``None`` for a rule that takes the policy's ``scorer``."""
    rule = CONTROLLERS.get(controller) if isinstance(controller, str) else None
    return rule.default_scorer if rule is not None and rule.preset else None


def format_validation_error(err: ValidationError, what: str) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or what
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        if e["type"] == "value_error" or isinstance(got, dict):
            parts.append(msg if not e["loc"] else f"{field}: {msg}")
        else:
            parts.append(f"{field}: {msg} (got {got!r})")
    return f"invalid {what}: " + "; ".join(parts)


def error_field(err: ValidationError) -> str | None:
    """The key the first error is about: where pydantic located it, or the key a cross-key check named."""
    errors = err.errors()
    if not errors:
        return None
    loc = [str(x) for x in errors[0].get("loc", ()) if x != "body"]
    if loc:
        return ".".join(loc)
    cause = (errors[0].get("ctx") or {}).get("error")
    return cause.key if isinstance(cause, KeyValueError) else None


def make_policy(values: dict[str, Any]) -> CachePolicy:
    """Build a policy from plain values, turning validation errors into one readable ``ConfkvError``."""
    try:
        return CachePolicy(**values)
    except ValidationError as err:
        raise ConfkvError(format_validation_error(err, "cache policy"), param=error_field(err)) from None


def load_policy_file(path: str | Path) -> CachePolicy:
    """Read a YAML file whose top-level ``cache_policy:`` mapping holds the policy's keys.

    A folder (an exported learned policy) is read through its ``policy.yaml``; a relative ``learned_path`` is
    taken relative to the YAML file, so exported folders can be moved. (A ``registry://`` reference is read by
    ``confkv.policy_source.load_policy``, which hands plain files here.)
    """
    p = Path(path)
    if p.is_dir():
        p = p / "policy.yaml"
    if not p.is_file():
        raise ConfkvError(f"policy file not found: {p}")
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfkvError(f"policy file {p} is not valid YAML: {err}") from None
    except UnicodeDecodeError:
        raise ConfkvError(f"policy file {p} is not UTF-8 text") from None
    except OSError as err:
        raise ConfkvError(f"cannot read policy file {p}: {err.strerror or err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cache_policy"), dict):
        raise ConfkvError(f"policy file {p} must hold a mapping under a top-level 'cache_policy:' key")
    values = dict(doc["cache_policy"])
    learned = values.get("learned_path")
    if isinstance(learned, str) and not Path(learned).is_absolute():
        values["learned_path"] = str((p.parent / learned).resolve())
    return make_policy(values)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn ``["max_size=2048", "scaling_factor=0.9"]`` into typed values (YAML scalars)."""
    known = set(CachePolicy.model_fields)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfkvError(f"--set expects KEY=VALUE (got {item!r})")
        if key not in known:
            raise ConfkvError(f"unknown policy key {key!r}; known keys: {', '.join(sorted(known))}")
        out[key] = _override_value(raw.strip())
    return out


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _override_value(raw: str) -> Any:
    """A ``--set`` value: a plain decimal number, ``true``/``false``/``null``, a YAML list or mapping, else the text
    as it is. YAML 1.1 scalars are not used for the rest: they read ``0512`` as octal (330), ``1:30`` as base 60
    (90) and ``~`` as null."""
    if _NUMBER.fullmatch(raw):
        return int(raw) if raw.lstrip("+-").isdigit() else float(raw)
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if raw.lower() in ("null", "none"):
        return None
    if raw.startswith(("[", "{")):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw
    return raw


#: What ``torch.Generator.manual_seed`` takes (the engine's seed and every request's).
SEED_RANGE = (-(2**63), 2**64 - 1)


#: How the KV pool stores K and V (vLLM's ``--kv-cache-dtype`` spelling): ``auto`` in the model's dtype; ``int8``,
#: ``fp8`` (e4m3) and ``int4`` quantised per token and KV head as they are written (``confkv/kv/quant.py``).
KVCacheDtype = Literal["auto", "int8", "fp8", "int4"]


class EngineConfig(BaseModel):
    """Engine-wide settings: the model, where it runs, and how big the KV pool and batches are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "smollm2-135m", description="'smollm2-135m', 'tiny-random', a local Hugging Face folder or a .gguf file"
    )
    device: str | None = Field(None, description="torch device; default cuda when available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_cache_memory: ByteSize | None = Field(None, gt=0, description="bytes for the device KV pool ('1GiB')")
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description="how the KV pool stores K and V: the model's dtype, or int8, fp8 (e4m3), int4"
    )
    host_kv_dtype: KVCacheDtype | None = Field(
        None,
        description="how the host tier and session records store K and V, when more compact than the pool (e.g. a "
        "pool at auto, the lower tiers at int8); default the pool's kv_cache_dtype",
    )
    kv_float_window: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        strict=True,
        description="under a quantised kv_cache_dtype, each sequence's last this-many tokens also kept in the model's "
        "dtype and read exactly by attention (Hugging Face QuantizedCache's residual_length); 0: none; no effect at "
        "auto, where every row is exact",
    )
    kv_cache_fraction: float = Field(0.25, gt=0, le=0.95, description="share of free memory for the pool if unset")
    max_batch_size: int = Field(32, ge=1, description="most sequences decoded together")
    max_num_batched_tokens: int = Field(
        512, ge=MIN_BATCHED_TOKENS, description="tokens per step (prefill chunks + decodes)"
    )
    max_model_len: int | None = Field(None, ge=2, description="context limit; default the model's")
    seed: int = Field(0, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="within torch's seed range")
    cache_dir: str | None = Field(None, description="where converted models are kept (default $CONFKV_CACHE)")
    pack_weights: bool = Field(True, description="on CPU, run linear layers on oneDNN with weights packed once")
    admission: Literal["reserve", "on_demand"] = Field(
        "on_demand",
        description="on_demand: allocate as tokens are computed and preempt (swap or recompute) when the pool runs "
        "out, as vLLM does (served more requests/s on the long-generation stream, BENCHMARKS.md); reserve: admit "
        "while each sequence's projected blocks fit (no preemption under full)",
    )


def make_engine_config(values: dict[str, Any]) -> EngineConfig:
    try:
        return EngineConfig(**values)
    except ValidationError as err:
        raise ConfkvError(format_validation_error(err, "engine setting")) from None
