"""What a benchmark suite measures and at what sizes, and how long it takes on the CPU it was sized on.

A suite is a set of *measures* (teacher-forced prose, long generations and chats; pass-key and multi-key
retrieval; free long generation) at the sizes of a ``SuiteSpec``: ``quick`` (items of about 1,000 tokens),
``standard`` (2,000-4,000), and toy versions of both for ``tiny-random``. The requirement's dynamic sizes are
multiplied by the suite's ``scale`` to fit its context lengths (``scaled_dynamic``); a fixed baseline beside a
dynamic policy gets one budget (``baseline_policy``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from confkv.config import CachePolicy, KVCacheDtype
from confkv.errors import ConfkvError

#: The measures of a suite, in report order; each has its own resident KV and, for baselines, its own budget.
TEACHER_FORCED: tuple[str, ...] = ("prose", "longgen", "chat")
RETRIEVAL: tuple[str, ...] = ("passkey", "multikey")
FREE_GENERATION = "longgen_free"
MEASURES: tuple[str, ...] = (*TEACHER_FORCED, *RETRIEVAL, FREE_GENERATION)
#: Built-in policies with one fixed budget: the baselines a variant is compared with.
FIXED_BASELINES: tuple[str, ...] = ("window", "streaming", "h2o", "snapkv")
#: Controllers whose budget moves with the sequence: a policy file with one of them gets its own baselines.
VARIANT_CONTROLLERS: tuple[str, ...] = ("dynamic", "learned")


@dataclass(frozen=True)
class SuiteSpec:
    """Workload sizes of a suite; ``scale`` multiplies the requirement's dynamic sizes.

    ``batch`` empty: requests/s is not measured (``confkv bench --suite throughput`` measures serving properly).
    """

    scale: float
    passkey: dict[str, Any]
    multikey: dict[str, Any]
    prose: dict[str, Any]
    longgen: dict[str, Any]
    chat: dict[str, Any]
    free_tokens: int
    batch: dict[str, Any] = field(default_factory=dict)


SUITES: dict[str, SuiteSpec] = {
    "quick": SuiteSpec(
        scale=0.125,
        passkey={"n": 1, "lengths": (1024,), "depths": (0.1, 0.5, 0.9)},
        multikey={"n": 2, "length": 768, "num_pairs": 4},
        prose={"n": 2, "length": 1024},
        longgen={"n": 2, "max_tokens": 384},
        chat={"n": 2, "turns": 3, "max_tokens": 96},
        free_tokens=320,
        batch={"requests": 6, "max_batch_size": 6, "prompt_tokens": 448, "max_tokens": 32},
    ),
    # Items of 2,000-4,000 tokens and the requirement's sizes divided by 4 (base 256, max 1024, 128 recent): every
    # item is longer than max_size, so even dynamic at its ceiling evicts, and a context 2-4x max_size is the ratio
    # the defaults (max 4096) have on contexts of 8-16k tokens. Divided by 2 (max 2048) a 2,000-token prompt would be
    # read whole and the long generations (about 1,100 tokens) would hardly evict.
    "standard": SuiteSpec(
        scale=0.25,
        passkey={"n": 1, "lengths": (2000, 4000), "depths": (0.1, 0.5, 0.9), "filler": ("repeat", "prose")},
        multikey={"n": 4, "length": 2500, "num_pairs": 6},
        prose={"n": 4, "length": 3000},
        longgen={"n": 4, "max_tokens": 1024},
        chat={"n": 4, "turns": 6, "max_tokens": 256, "length": 3000},
        free_tokens=1024,
    ),
}

#: For ``tiny-random`` (tests, CI): each suite's shape at toy sizes (max_size 128 at scale 1/32, items longer).
TINY = SuiteSpec(
    scale=1 / 32,
    passkey={"n": 1, "lengths": (400,), "depths": (0.2, 0.8)},
    multikey={"n": 1, "length": 400, "num_pairs": 4},
    prose={"n": 1, "length": 320},
    longgen={"n": 1, "max_tokens": 64},
    chat={"n": 1, "turns": 2, "max_tokens": 32},
    free_tokens=24,
    batch={"requests": 4, "max_batch_size": 3, "prompt_tokens": 256, "max_tokens": 16},
)
TINY_STANDARD = SuiteSpec(
    scale=1 / 32,
    passkey={"n": 1, "lengths": (300, 500), "depths": (0.2, 0.8), "filler": ("repeat", "prose")},
    multikey={"n": 1, "length": 400, "num_pairs": 4},
    prose={"n": 2, "length": 320},
    longgen={"n": 2, "max_tokens": 160},
    chat={"n": 1, "turns": 3, "max_tokens": 32, "length": 800},
    free_tokens=160,
)
TINY_SUITES: dict[str, SuiteSpec] = {"quick": TINY, "standard": TINY_STANDARD}


@dataclass(frozen=True)
class RowSpec:
    """One ``--policies`` entry: ``POLICY[:KV_DTYPE[:demote=DTYPE]]`` (``full:int8``, ``dynamic:int8:demote=int4``).

    The dtype rides on the policy, vLLM's ``--kv-cache-dtype`` values after a colon, because a comparison wants
    chosen pairs (``full`` at ``auto`` beside ``dynamic`` demoting on an ``int8`` pool), not every policy at every
    dtype; ``--kv-cache-dtype`` stays the dtype of an entry that names none. ``label`` is the row's name.
    """

    label: str
    policy: str
    kv_cache_dtype: str | None = None
    demote_dtype: str | None = None


def parse_dtype_suffix(rest: list[str], text: str, what: str = "POLICY") -> tuple[str | None, str | None]:
    """``[KV_DTYPE[:demote=DTYPE]]`` after an entry's policy (its colon-separated parts), as (kv_cache_dtype,
    demote_dtype), or a one-line ``ConfkvError`` naming what is wrong with it in ``text``, the entry as written."""
    rest = list(rest)
    dtypes = get_args(KVCacheDtype)
    demotes = get_args(CachePolicy.model_fields["demote_dtype"].annotation)
    kv = demote = None
    if rest:
        kv = rest.pop(0)
        if kv not in dtypes:
            raise ConfkvError(f"unknown kv_cache_dtype {kv!r} in {text!r}; choose from {', '.join(dtypes)}")
    if rest:
        part = rest.pop(0)
        key, _, demote = part.partition("=")
        if key != "demote" or demote not in demotes:
            raise ConfkvError(f"bad {part!r} in {text!r}; write demote=" + "|".join(demotes))
    if rest:
        raise ConfkvError(f"bad entry {text!r}; write {what}[:KV_DTYPE[:demote=DTYPE]]")
    return kv, demote


def parse_row(text: str, builtin: tuple[str, ...]) -> RowSpec:
    """A ``--policies`` entry, or a one-line ``ConfkvError`` naming what is wrong with it."""
    parts = text.strip().split(":")
    name, rest = parts[0], parts[1:]
    if name not in builtin:
        raise ConfkvError(f"unknown policy {name!r} in {text!r}; choose from {', '.join(builtin)}")
    kv, demote = parse_dtype_suffix(rest, text)
    if demote and name not in VARIANT_CONTROLLERS + FIXED_BASELINES:
        raise ConfkvError(f"{text!r}: demote_dtype applies to an evicting policy, not {name!r}")
    return RowSpec(text.strip(), name, kv, demote)


def parse_file_row(text: str) -> RowSpec:
    """A ``--policy-file`` entry of the throughput suite, ``PATH[:KV_DTYPE[:demote=DTYPE]]``
    (``rule.yaml:int8``): ``policy`` is the path. A path that exists as given is the whole entry (a colon in a file
    name stays the file's); otherwise the part from the first colon that starts a dtype is parsed as ``parse_row``
    parses it, one line if it is not one. Whether the file loads is ``load_policy``'s to say."""
    text = text.strip()
    if Path(text).exists() or ":" not in text:
        return RowSpec(text, text, None, None)
    path, _, suffix = text.partition(":")
    while ":" in suffix and not Path(path).exists():  # a colon inside the path: move it over to the path
        head, _, rest = suffix.partition(":")
        if head in get_args(KVCacheDtype):
            break
        path, suffix = f"{path}:{head}", rest
    kv, demote = parse_dtype_suffix(suffix.split(":"), text, "PATH")
    return RowSpec(text, path, kv, demote)


def suite_spec(model: str, suite: str) -> SuiteSpec:
    """The sizes ``confkv bench --suite`` runs: toy ones on ``tiny-random``, so CI exercises every code path."""
    table = TINY_SUITES if model == "tiny-random" else SUITES
    if suite not in table:
        raise ConfkvError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    return table[suite]


def scaled_dynamic(scale: float) -> CachePolicy:
    """The requirement's dynamic policy with its sizes multiplied by ``scale`` (thresholds unchanged)."""
    d = CachePolicy()
    bs = d.block_size
    size = lambda v: max(bs, round(v * scale / bs) * bs)  # noqa: E731
    return d.replace(base_size=size(d.base_size), max_size=size(d.max_size), min_recent=size(d.min_recent))


def baseline_policy(dynamic: CachePolicy, name: str, budget: int | None = None) -> CachePolicy:
    """A fixed baseline beside ``dynamic``: ``budget`` tokens (default twice its base), half of them recent. It
    evicts what its budget leaves out (``demote_dtype: none``) even beside a demoting variant: that is the comparison.
    """
    budget = budget or 2 * dynamic.base_size
    half = max(dynamic.block_size, budget // 2)
    return dynamic.replace(
        controller=name, scorer=None, base_size=budget, max_size=budget, min_recent=half, demote_dtype="none"
    )


#: The estimator's assumed speeds of smollm2-135m in fp32 on 2 CPU cores: prompt tokens read per second, and tokens
#: decoded per second by batch size (the whole batch's tokens). The CPU differs between machines: an estimate.
CPU_PREFILL_TOKENS_PER_S = 400.0
CPU_DECODE_TOKENS_PER_S: tuple[tuple[int, float], ...] = ((1, 15.0), (4, 40.0), (16, 100.0))
#: The quick suite's run time with cached references (BENCHMARKS.md, "The quick suite": 500 s at fc4669a, six
#: policies): it calibrates the overheads the rates leave out (engine set-up, per-chunk Python work, recall).
QUICK_MEASURED_SECONDS = 500.0
_LONGGEN_PROMPT_TOKENS = 70  # the chat template plus one request
_SHORT_CHAT_TOKENS_PER_TURN = 45  # a small-talk pair with its template tokens


def _decode_rate(batch: int) -> float:
    """Decode tokens/s at ``batch``, interpolated on log2(batch) between the measured points (flat beyond)."""
    pts = CPU_DECODE_TOKENS_PER_S
    if batch <= pts[0][0]:
        return pts[0][1]
    for (b0, r0), (b1, r1) in itertools.pairwise(pts):
        if batch <= b1:
            w = (math.log2(batch) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return r0 + w * (r1 - r0)
    return pts[-1][1]


def _raw_seconds(spec: SuiteSpec) -> tuple[float, float]:
    """(seconds per policy, seconds for the references) from the rates alone."""
    pk, mk, pr, lg, ch = spec.passkey, spec.multikey, spec.prose, spec.longgen, spec.chat
    fillers = pk.get("filler", "repeat")
    n_fillers = 1 if isinstance(fillers, str) else len(fillers)
    pk_items = pk["n"] * n_fillers * len(pk["lengths"]) * len(pk["depths"])
    pk_tokens = pk["n"] * n_fillers * len(pk["depths"]) * sum(pk["lengths"])
    chat_prompt = ch.get("length") or ch["turns"] * _SHORT_CHAT_TOKENS_PER_TURN
    prefill = (
        pk_tokens  # pass-key prompts
        + mk["n"] * mk["length"]  # multi-key prompts
        + pr["n"] * pr["length"]  # prose, teacher-forced
        + lg["n"] * (_LONGGEN_PROMPT_TOKENS + lg["max_tokens"])  # full's answers, teacher-forced
        + ch["n"] * (chat_prompt + ch["max_tokens"])  # chats read, then full's answers teacher-forced
    )
    decode = 8 * pk_items / _decode_rate(min(32, pk_items)) + 8 * mk["n"] / _decode_rate(mk["n"])
    decode += spec.free_tokens * lg["n"] / _decode_rate(lg["n"])
    b = spec.batch
    if b:
        prefill += b["requests"] * b["prompt_tokens"]
        decode += b["requests"] * b["max_tokens"] / _decode_rate(b["max_batch_size"])
    per_policy = prefill / CPU_PREFILL_TOKENS_PER_S + decode
    refs = lg["n"] * lg["max_tokens"] / _decode_rate(lg["n"]) + ch["n"] * ch["max_tokens"] / _decode_rate(ch["n"])
    refs += (ch["n"] * chat_prompt + pr["n"] * pr["length"]) / CPU_PREFILL_TOKENS_PER_S
    refs += (lg["n"] * (_LONGGEN_PROMPT_TOKENS + lg["max_tokens"]) + ch["n"] * (chat_prompt + ch["max_tokens"])) / (
        CPU_PREFILL_TOKENS_PER_S
    )
    return per_policy, refs


def estimate_seconds(spec: SuiteSpec, num_policies: int, *, references: bool = True) -> dict[str, float]:
    """How long a suite takes with smollm2-135m on 2 CPU cores like the ones measured: a range, not a promise.

    ``low`` is the measured token rates applied to the suite's sizes; ``high`` scales that by how far the quick
    suite's measured run time exceeded the same estimate (overheads the rates leave out). ``references``: include
    building the full-cache references, which a second run reads from disk.
    """
    per_policy, refs = _raw_seconds(spec)
    quick_per_policy, _ = _raw_seconds(SUITES["quick"])
    factor = max(1.0, QUICK_MEASURED_SECONDS / (6 * quick_per_policy))
    low = num_policies * per_policy + (refs if references else 0.0)
    return {
        "per_policy": per_policy,
        "references": refs,
        "calibration": factor,
        "low": low,
        "high": low * factor,
    }
