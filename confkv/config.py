"""Configuration: the cache policy (the requirement's keys and defaults) and the engine settings.

Both are pydantic models so that a YAML file, a ``--set KEY=VALUE`` override and a Python call are validated by
the same rules, and every error names the field and its allowed range.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

from confkv.errors import ConfkvError

#: Controllers the engine knows; ``confkv.controllers`` holds one class per name. ``window``, ``streaming``,
#: ``h2o`` and ``snapkv`` are presets of ``fixed`` (a fixed budget) with a scorer each.
CONTROLLER_NAMES: tuple[str, ...] = ("full", "window", "streaming", "h2o", "snapkv", "dynamic", "fixed", "learned")
#: The built-in policies, the ones benchmarks compare (``learned`` needs an exported policy folder).
BUILTIN_POLICIES: tuple[str, ...] = ("full", "window", "streaming", "h2o", "snapkv", "dynamic")
#: The scorer each preset uses; ``dynamic``, ``learned`` and ``fixed`` take the policy's ``scorer`` key.
PRESET_SCORERS: dict[str, str] = {"window": "recency", "streaming": "recency", "h2o": "h2o", "snapkv": "snapkv"}
#: ``dynamic`` ranks with snapkv: at equal mean memory it loses less than h2o's accumulated attention on every
#: workload measured (BENCHMARKS.md, "What makes dynamic lose"), and it records no decode attention, so decode steps
#: keep the fused attention kernel.
DEFAULT_SCORER = {"dynamic": "snapkv", "learned": "snapkv", "fixed": "recency"}
#: The most tokens any size or count may name (what an int32 index holds): a bound against typos and attacks, far past
#: any context a model has.
MAX_TOKENS = 2**31 - 1
#: The most bytes of host memory a policy may name (16 TiB): past any machine's memory, so a unit typo is refused.
MAX_MEMORY_BYTES = 2**44
#: The old ``importance`` key, still read from policy files: what each value meant, as a scorer.
_IMPORTANCE_SCORERS = {"attention": "h2o", "recency": "recency"}


class CachePolicy(BaseModel):
    """How much KV history each sequence keeps on the device, and how it is chosen.

    ``base_size``/``max_size`` bound the confidence-driven budget of the ``dynamic`` controller and are the fixed
    budget (``max_size``) of the baselines. Sizes are in tokens; ``host_cache_memory`` is in bytes (``"2GiB"``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    controller: str = Field("dynamic", description="one of " + ", ".join(CONTROLLER_NAMES))
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
        "(default: memory_high_watermark - 0.1)",
    )
    snapkv_window: int = Field(
        32, ge=1, le=MAX_TOKENS, description="prompt queries that vote for the tokens snapkv keeps"
    )
    attention_decay: float = Field(
        0.95, ge=0, le=1, description="what each decode step multiplies the decayed scorer's recorded attention by"
    )
    scorer: str | None = Field(
        None,
        description="how evictable blocks are ranked (h2o, snapkv, tova, knorm, recency, decayed); default: the "
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
                raise ValueError(f"importance must be attention or recency (got {old!r}); it is now the scorer key")
            values.setdefault("scorer", _IMPORTANCE_SCORERS[old])
        return values

    @property
    def effective_scorer(self) -> str | None:
        """The scorer this policy ranks blocks with (``None`` for ``full``, which never evicts)."""
        if self.controller == "full":
            return None
        return PRESET_SCORERS.get(self.controller) or self.scorer or DEFAULT_SCORER[self.controller]

    @model_validator(mode="after")
    def _check_ranges(self) -> CachePolicy:
        if self.controller not in CONTROLLER_NAMES:
            raise ValueError(f"controller must be one of {', '.join(CONTROLLER_NAMES)} (got {self.controller!r})")
        if self.scorer is not None:
            from confkv.scorers import SCORER_NAMES

            if self.scorer not in SCORER_NAMES:
                raise ValueError(f"scorer must be one of {', '.join(SCORER_NAMES)} (got {self.scorer!r})")
            preset = PRESET_SCORERS.get(self.controller)
            if preset is not None and self.scorer != preset:
                raise ValueError(
                    f"controller {self.controller!r} is the preset fixed + {preset}; for another scorer use "
                    f"controller: fixed with scorer: {self.scorer}"
                )
        if self.memory_low_watermark is not None and self.memory_low_watermark > self.memory_high_watermark:
            raise ValueError(
                f"memory_low_watermark ({self.memory_low_watermark}) must be <= memory_high_watermark "
                f"({self.memory_high_watermark})"
            )
        if self.controller == "learned" and not self.learned_path:
            raise ValueError("controller 'learned' needs learned_path: the folder of an exported policy")
        if self.controller not in ("dynamic", "learned"):  # the fixed baselines only use max_size
            return self
        if self.max_size < self.base_size:
            raise ValueError(f"max_size ({self.max_size}) must be >= base_size ({self.base_size})")
        if self.min_recent + self.sink_tokens > self.max_size:
            raise ValueError(
                f"min_recent + sink_tokens ({self.min_recent} + {self.sink_tokens}) must be <= max_size "
                f"({self.max_size}) for the dynamic controller"
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
        if changes.get("controller") in PRESET_SCORERS and "scorer" not in changes:
            changes["scorer"] = None
        return make_policy({**self.model_dump(), **changes})


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


def make_policy(values: dict[str, Any]) -> CachePolicy:
    """Build a policy from plain values, turning validation errors into one readable ``ConfkvError``."""
    try:
        return CachePolicy(**values)
    except ValidationError as err:
        raise ConfkvError(format_validation_error(err, "cache policy")) from None


def load_policy_file(path: str | Path) -> CachePolicy:
    """Read a YAML file whose top-level ``cache_policy:`` mapping holds the policy's keys.

    A folder (an exported learned policy) is read through its ``policy.yaml``; a relative ``learned_path`` is
    taken relative to the YAML file, so exported folders can be moved. A ``registry://NAME@ALIAS`` (or
    ``@VERSION``) reference is resolved through the policy registry (``store.refs``).
    """
    if isinstance(path, str) and path.startswith("registry://"):
        from store.refs import resolve_ref

        return resolve_ref(path).policy
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


def resolve_policy(
    policy: str | CachePolicy | None = None,
    policy_file: str | Path | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    model: str | None = None,
    cache_dir: str | Path | None = None,
) -> CachePolicy:
    """Combine the three ways of naming a policy; later ones win: file, then controller name, then overrides.

    With ``model`` given, the default policy (``dynamic`` named by name or not at all, no file) takes the model's
    calibrated ``entropy_threshold``/``gap_threshold`` when ``confkv calibrate`` has written them
    (``confkv.calibration``); overrides still win.
    """
    if isinstance(policy, CachePolicy):
        base = policy.model_dump()
    else:
        base = load_policy_file(policy_file).model_dump() if policy_file else {}
        if policy is not None:
            if policy not in CONTROLLER_NAMES:
                raise ConfkvError(f"unknown policy {policy!r}; choose one of: {', '.join(CONTROLLER_NAMES)}")
            base["controller"] = policy
            if policy in PRESET_SCORERS:  # a preset ranks its own way: a file's scorer belongs to the file's rule
                base["scorer"] = None
        if model is not None and not policy_file and base.get("controller", "dynamic") == "dynamic":
            from confkv.calibration import calibrated_thresholds

            base.update(calibrated_thresholds(model, cache_dir) or {})
    if overrides:
        base.update(parse_overrides(overrides) if isinstance(overrides, list) else overrides)
    return make_policy(base)


#: What ``torch.Generator.manual_seed`` takes (the engine's seed and every request's).
SEED_RANGE = (-(2**63), 2**64 - 1)


class EngineConfig(BaseModel):
    """Engine-wide settings: the model, where it runs, and how big the KV pool and batches are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("smollm2-135m", description="'smollm2-135m', 'tiny-random', or a local Hugging Face folder")
    device: str | None = Field(None, description="torch device; default cuda when available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_cache_memory: ByteSize | None = Field(None, gt=0, description="bytes for the device KV pool ('1GiB')")
    kv_cache_fraction: float = Field(0.25, gt=0, le=0.95, description="share of free memory for the pool if unset")
    max_batch_size: int = Field(32, ge=1, description="most sequences decoded together")
    max_num_batched_tokens: int = Field(512, ge=16, description="tokens per step (prefill chunks + decodes)")
    max_model_len: int | None = Field(None, ge=2, description="context limit; default the model's")
    seed: int = Field(0, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="within torch's seed range")
    cache_dir: str | None = Field(None, description="where converted models are kept (default $CONFKV_CACHE)")
    pack_weights: bool = Field(True, description="on CPU, run linear layers on oneDNN with weights packed once")


def make_engine_config(values: dict[str, Any]) -> EngineConfig:
    try:
        return EngineConfig(**values)
    except ValidationError as err:
        raise ConfkvError(format_validation_error(err, "engine setting")) from None
