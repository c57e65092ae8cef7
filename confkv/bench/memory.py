"""Resident KV of a measure, and the fixed budget that holds as much: what "at equal memory" rests on.

``Usage`` accumulates, over the steps whose output is measured, the keys a policy held and the keys a full cache
would have held; ``matched_budget`` solves for the fixed budget whose policy is predicted to hold the same total
over the same steps (``fixed_offset`` says how far above its budget a fixed policy sits between evictions).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from confkv.config import CachePolicy
from confkv.engine.sequence import RequestOutput
from confkv.kv.pool import BlockPool
from confkv.model_loader import LoadedModel
from confkv.scoring import ScoreResult


def token_bytes(loaded: LoadedModel, kv_cache_dtype: str, block_size: int) -> int:
    """Bytes one token's K and V take in a pool at ``kv_cache_dtype`` (``auto``: the model's dtype), scales included:
    the unit that rows at different dtypes are compared and matched in."""
    geometry = BlockPool.geometry(loaded.model.config)
    dtype = next(loaded.model.parameters()).dtype
    return BlockPool.bytes_per_block_for(*geometry, block_size, dtype, kv_cache_dtype) // block_size


@dataclass
class Usage:
    """Resident KV of one measure: the mean over the steps whose output is measured, the peak over whole items.

    ``mode`` says how those steps are computed, which is what a fixed budget's resident count depends on:
    ``chunked`` (teacher-forced, ``compact_interval`` tokens per pass) or ``decode`` (one token per step).
    ``positions`` holds, per measured step, the keys a full cache would hold: the matching solves over them.
    """

    mode: Literal["chunked", "decode"]
    resident: float = 0.0
    full: float = 0.0
    steps: int = 0
    items: int = 0
    peak_tokens: int = 0
    peak_fraction: float = 0.0
    peak_bytes: int = 0
    positions: list[torch.Tensor] = field(default_factory=list)
    #: Bytes a token takes at the model's dtype (``full`` at ``auto``), the denominator of the byte fractions.
    auto_bytes_per_token: float = 0.0
    #: Bytes a resident token takes at the measured pool's ``kv_cache_dtype``.
    bytes_per_token: float = 0.0
    #: Over the measured steps: resident tokens at the pool's dtype plus each item's demoted copies (their peak,
    #: at every step of the item: what must be provisioned for them, as ``benchmarks/demote_bytes.py`` counts).
    resident_bytes: float = 0.0

    def _item(self, kv: Mapping[str, Any], length: int, resident: float, steps: int) -> None:
        peak = int(kv.get("peak_resident_tokens") or 0)
        self.bytes_per_token = float(kv.get("bytes_per_token") or 0.0)
        self.resident_bytes += resident * self.bytes_per_token + steps * float(kv.get("demoted_peak_bytes") or 0)
        self.items += 1
        self.peak_tokens = max(self.peak_tokens, peak)
        self.peak_fraction = max(self.peak_fraction, peak / max(1, length))
        self.peak_bytes = max(self.peak_bytes, int(kv.get("peak_device_bytes") or 0))

    def add_scored(self, result: ScoreResult, length: int) -> None:
        """A teacher-forced item of ``length`` tokens: every scored token is a step."""
        self.resident += float(result.resident.sum())
        self.full += float(result.full.sum())
        self.steps += result.num_tokens
        self.positions.append(result.full.to(torch.float64))
        self._item(result.kv, length, float(result.resident.sum()), result.num_tokens)

    def add_generated(self, out: RequestOutput) -> None:
        """A generated item: every token after the first is a step.

        The first token comes out of the prompt's last prefill chunk, so what it attends over is the prefill size
        (``max_size`` plus that chunk for every evicting policy), not the budget: it counts in the peak only.
        """
        resident = out.trace.resident[1:]
        positions = torch.arange(1, len(resident) + 1, dtype=torch.float64) + out.prompt_tokens
        self.resident += float(sum(resident))
        self.full += float(positions.sum())
        self.steps += len(resident)
        self.positions.append(positions)
        self._item(out.kv, out.prompt_tokens + out.generated_tokens, float(sum(resident)), len(resident))

    @property
    def fraction_mean(self) -> float | None:
        return self.resident / self.full if self.full else None

    @property
    def bytes_fraction_mean(self) -> float | None:
        """Mean bytes held (demoted copies included) over ``full``'s at the model's dtype."""
        denom = self.full * self.auto_bytes_per_token
        return self.resident_bytes / denom if denom else None

    def tokens_at(self, bytes_per_token: float) -> float:
        """The resident total (over the measured steps) as tokens of ``bytes_per_token``: what a fixed baseline at
        that dtype must hold to match these bytes. Without byte counts (an older reader), the token total."""
        return self.resident_bytes / bytes_per_token if self.resident_bytes and bytes_per_token else self.resident

    def summary(self) -> dict[str, Any]:
        """The JSON fields of a measure's memory."""
        return {
            "kv_fraction_mean": self.fraction_mean,
            "kv_fraction_peak": self.peak_fraction if self.items else None,
            "kv_mean_tokens": self.resident / self.steps if self.steps else None,
            "kv_peak_tokens": self.peak_tokens if self.items else None,
            "kv_peak_device_bytes": self.peak_bytes if self.items else None,
            "kv_bytes_fraction_mean": self.bytes_fraction_mean,
            "kv_mean_bytes": self.resident_bytes / self.steps if self.steps else None,
            "kv_bytes_per_token": self.bytes_per_token or None,
            "steps": self.steps,
            "items": self.items,
        }

    @staticmethod
    def combine(usages: Iterable[Usage]) -> dict[str, Any]:
        """The suite-wide memory: means over every measured step, peaks over every item."""
        usages = list(usages)
        total = Usage("chunked", auto_bytes_per_token=max((u.auto_bytes_per_token for u in usages), default=0.0))
        for u in usages:
            total.resident_bytes += u.resident_bytes
            total.bytes_per_token = u.bytes_per_token or total.bytes_per_token
            total.resident += u.resident
            total.full += u.full
            total.steps += u.steps
            total.items += u.items
            total.peak_tokens = max(total.peak_tokens, u.peak_tokens)
            total.peak_fraction = max(total.peak_fraction, u.peak_fraction)
            total.peak_bytes = max(total.peak_bytes, u.peak_bytes)
        return total.summary()


def fixed_offset(mode: str, policy: CachePolicy) -> float:
    """Mean tokens a fixed budget's policy holds above its budget at a measured step, once the sequence is longer.

    Eviction moves whole blocks when the budget is exceeded, so right after it a sequence holds between
    ``budget - block_size + 1`` and ``budget`` tokens (``(block_size - 1) / 2`` below on average). Decoding adds one
    token per step and evicts again as soon as the budget is passed (a cycle from ``budget - block_size + 2`` to
    ``budget + 1``); teacher forcing adds a chunk of ``compact_interval`` tokens, whose i-th token attends over
    ``i`` more, before the next eviction.
    """
    bs = policy.block_size
    if mode == "decode":
        return 1.5 - bs / 2
    return (policy.compact_interval + 1) / 2 - (bs - 1) / 2


def matched_budget(usages: Sequence[Usage], target: float, policy: CachePolicy) -> int:
    """The fixed budget (tokens) whose policy is predicted to hold ``target`` keys in all over ``usages``' steps.

    A fixed policy at budget ``B`` holds ``min(p, B + offset)`` keys at a step where a full cache holds ``p``
    (``fixed_offset``); the sum over the measured steps rises with ``B``, so bisection finds the ``B`` that gives the
    variant's measured total. The measured result of each baseline is reported beside the variant's, so a
    prediction that misses shows, and the report flags a gap beyond ``confkv.bench.tables.MEMORY_TOLERANCE``.
    """
    pairs = [(torch.cat(u.positions), fixed_offset(u.mode, policy)) for u in usages if u.positions and u.steps]
    floor = 2 * policy.block_size
    if not pairs:
        return max(floor, 2 * policy.base_size)
    top = int(max(float(p.max()) for p, _ in pairs)) + policy.block_size

    def held(budget: int) -> float:
        return sum(float(p.clamp(max=budget + off).sum()) for p, off in pairs)

    if held(top) <= target:
        return top
    lo, hi = 1, top  # held(hi) > target; find the smallest budget that holds at least the target
    while lo < hi:
        mid = (lo + hi) // 2
        if held(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    best = lo if lo <= 1 or abs(held(lo) - target) <= abs(held(lo - 1) - target) else lo - 1
    return max(floor, best)
