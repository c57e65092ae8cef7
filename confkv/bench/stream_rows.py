"""Which rows a throughput or long-generation stream run measures, parsed from the command line's entries.

``--policies`` entries ``POLICY[@SIZE][:KV_DTYPE[:demote=DTYPE]]`` (``dynamic`` at the stream's sizes, a fixed
baseline at its ``max_size`` or at the size after ``@``) and ``--policy-file`` entries ``PATH[:KV_DTYPE[:...]]``
become ``StreamRow``s, ``full`` at the run's dtype first as the reference. Apart from ``throughput.py``, which runs
them, because the benchmarks that replay a stream (``curves.py``, ``benchmarks/step_cost.py``, the fidelity script)
choose their rows the same way without running the suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from confkv.bench.specs import FIXED_BASELINES, baseline_policy, parse_dtype_suffix, parse_file_row, scaled_dynamic
from confkv.bench.streams import ThroughputSpec
from confkv.bench.suite import row_name
from confkv.config import BUILTIN_POLICIES, MAX_TOKENS, CachePolicy
from confkv.errors import ConfkvError
from confkv.policy_source import load_policy


def sized_baseline(name: str, dynamic: CachePolicy) -> CachePolicy | None:
    """``BASELINE@TOKENS`` (``h2o@192``): a fixed baseline at that many tokens, half of them recent, so a row can be
    matched to a variable policy's measured memory rather than to ``dynamic``'s ceiling; None for a plain name."""
    if "@" not in name:
        return None
    base, _, size = name.partition("@")
    if base not in FIXED_BASELINES:
        raise ConfkvError(f"{name!r}: a size goes with a fixed baseline ({', '.join(FIXED_BASELINES)}), as h2o@192")
    if not size.isdigit() or not dynamic.block_size <= int(size) <= MAX_TOKENS:
        raise ConfkvError(f"{name!r}: the size after @ is a whole number of tokens, at least {dynamic.block_size}")
    return baseline_policy(dynamic, base, int(size))


@dataclass(frozen=True)
class StreamRow:
    """One policy of a stream run: its row name, the policy, and the ``kv_cache_dtype`` of its pool (the run's
    unless the entry named one: ``snapkv@128:int8``, ``rule.yaml:int8``)."""

    name: str
    policy: CachePolicy
    kv_cache_dtype: str = "auto"


def _named_policy(name: str, dynamic: CachePolicy) -> CachePolicy:
    """A built-in policy at the stream's sizes, or a fixed one at the size after ``@``."""
    sized = sized_baseline(name, dynamic)
    if sized is not None:
        return sized
    if name not in BUILTIN_POLICIES:
        raise ConfkvError(
            f"unknown policy {name!r}; choose from {', '.join(BUILTIN_POLICIES)} (a fixed one sized: h2o@192)"
        )
    if name == "full":
        return CachePolicy(controller="full")
    if name == "dynamic":
        return dynamic
    return baseline_policy(dynamic, name, dynamic.max_size)  # fixed baselines at dynamic's ceiling


def stream_rows(
    names: list[str], policy_files: list[str], spec: ThroughputSpec, kv_cache_dtype: str = "auto"
) -> list[StreamRow]:
    """The suite's rows: entries ``POLICY[:KV_DTYPE[:demote=DTYPE]]`` (``dynamic`` at the suite's sizes, fixed
    ones at its ``max_size`` or at the size after ``@``: ``snapkv@128:int8``) and files ``PATH[:KV_DTYPE[:...]]``
    (``parse_file_row``), ``full`` first. ``full`` at the run's ``kv_cache_dtype`` is the reference of quality and
    speed: it is added when no entry is ``full`` at that dtype (``full:int8`` alone is a row, not the reference).
    """
    dynamic = scaled_dynamic(spec.scale)
    out: list[StreamRow] = []
    names = list(dict.fromkeys(n.strip() for n in names))  # a name given twice is one row
    for text in names:
        name, _, suffix = text.partition(":")
        policy = _named_policy(name, dynamic)
        kv, demote = parse_dtype_suffix(suffix.split(":") if suffix else [], text)
        if demote:
            if policy.controller == "full":
                raise ConfkvError(f"{text!r}: demote_dtype applies to an evicting policy, not 'full'")
            policy = policy.replace(demote_dtype=demote)
        out.append(StreamRow(text, policy, kv or kv_cache_dtype))
    taken = set(names) | {"full"}  # the quality reference is added as "full" when no row keeps everything
    for text in policy_files:
        entry = parse_file_row(text)
        policy = load_policy(entry.policy)
        if entry.demote_dtype:
            policy = policy.replace(demote_dtype=entry.demote_dtype)
        suffix = text.strip()[len(entry.policy) :]  # the entry's own ":int8..." names its row beside the plain file's
        out.append(StreamRow(row_name(Path(entry.policy).stem + suffix, taken), policy,
                             entry.kv_cache_dtype or kv_cache_dtype))  # fmt: skip
    if not any(is_reference(r, kv_cache_dtype) for r in out):
        out.insert(0, StreamRow("full", CachePolicy(controller="full"), kv_cache_dtype))  # the quality reference
    out.sort(key=lambda r: r.policy.controller != "full")
    return out


def is_reference(row: StreamRow, kv_cache_dtype: str) -> bool:
    """Whether ``row`` is ``full`` at the run's dtype: what every other row is compared with."""
    return row.policy.controller == "full" and row.kv_cache_dtype == kv_cache_dtype


def stream_policies(names: list[str], policy_files: list[str], spec: ThroughputSpec) -> list[tuple[str, CachePolicy]]:
    """``stream_rows`` as (name, policy) pairs for the benchmarks that run every row at one dtype; an entry naming
    its own dtype is refused in one line there rather than run at another dtype than it says."""
    rows = stream_rows(names, policy_files, spec)
    spelled = [r.name for r in rows if r.kv_cache_dtype != "auto"]
    if spelled:
        raise ConfkvError(f"{spelled[0]!r}: this benchmark runs every policy at one kv_cache_dtype; drop the :DTYPE")
    return [(r.name, r.policy) for r in rows]
