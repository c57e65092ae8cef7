"""What a learned controller observes after each segment: built only from what a controller sees step by step
(``StepSignals`` with their context), so the training environments (``envs/``) and the engine's
``LearnedController`` compute the same observation, and an exported policy behaves in ``confkv generate`` as it did
in training.

Observation, all in [0, 1]:

 0-2  entropy of the segment's tokens: mean, min, max (divided by ``ENTROPY_SCALE`` nats, clipped)
 3-5  top-1 minus top-2 probability: mean, min, max
 6-8  top-1 probability: mean, min, max
 9    share of the segment's tokens that were uncertain under the base thresholds
 10   budget: (B - lo) / (hi - lo), ``lo``/``hi`` the smallest ``base_size`` and largest ``max_size`` the agent can
      set (for an agent that cannot set sizes, and for budget actions: the base policy's ``base_size``/``max_size``)
 11   resident fraction: resident keys / keys a full cache would hold
 12   position: tokens so far / ``POSITION_SCALE``, clipped
 13   device pool use

Layout 2 (``obs_version`` 2; ``confkv-tune train --observation history``) appends the recent history that
``confkv-tune probe`` found informative where any signal predicts the gain of a larger budget (pass keys: the gap
and top-1 trend; long generation: the entropy trend):

 14-16  entropy, gap and top-1: mean of the last four segments' means (this one included)
 17-19  their trend: 0.5 + this segment's mean - that recent mean (clipped)

Layout 1 stays the default and every export records its layout, so policies exported before layout 2 load and
run as they were trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from confkv.config import CachePolicy
from confkv.controllers.base import StepSignals
from confkv.errors import ConfkvError

#: Observation layouts: 1 = the 14 entries of the latest segment and context (the table above); 2 = those plus
#: the recent history of the segment means (``HISTORY_NAMES``). An exported policy records its layout.
OBS_VERSION = 1
OBS_VERSIONS = (1, 2)
OBS_DIM = 14
#: The observation's entries by name, in order (the docstring's table): what an MLflow model's signature calls them.
OBS_NAMES = (
    "entropy_mean", "entropy_min", "entropy_max", "gap_mean", "gap_min", "gap_max", "top1_mean", "top1_min",
    "top1_max", "uncertain_share", "budget", "resident_fraction", "position", "pool_use",
)  # fmt: skip
#: Layout 2's extra entries: what ``confkv-tune probe`` found informative (TUNING.md). ``*_recent`` is the mean of
#: the last ``RECENT_SEGMENTS`` segments' means (the latest included); ``*_trend`` is 0.5 + (the latest segment's
#: mean - that recent mean), clipped to [0, 1] (entropy in units of ``ENTROPY_SCALE`` as in entries 0-2): the
#: probe's ``*_recent`` and ``*_trend`` features, computed the same way.
HISTORY_NAMES = ("entropy_recent", "gap_recent", "top1_recent", "entropy_trend", "gap_trend", "top1_trend")
RECENT_SEGMENTS = 4
ENTROPY_SCALE = 12.0
POSITION_SCALE = 8192.0


def obs_names(version: int = OBS_VERSION) -> tuple[str, ...]:
    """The entries of observation layout ``version``, in order."""
    if version not in OBS_VERSIONS:
        raise ConfkvError(f"unknown observation layout {version!r} (this confkv knows {OBS_VERSIONS})")
    return OBS_NAMES + (HISTORY_NAMES if version == 2 else ())


def obs_dim(version: int = OBS_VERSION) -> int:
    return len(obs_names(version))


SegmentMeans = tuple[float, float, float]


def segment_means(signals: Sequence[StepSignals]) -> SegmentMeans:
    """A segment's mean entropy (in units of ``ENTROPY_SCALE``), gap and top-1 probability: one history entry."""
    if not signals:
        return (0.0, 0.0, 0.0)
    n = len(signals)
    return (sum(s.entropy for s in signals) / n / ENTROPY_SCALE, sum(s.gap for s in signals) / n,
            sum(s.top1_prob for s in signals) / n)  # fmt: skip


def push_history(history: Sequence[SegmentMeans], signals: Sequence[StepSignals]) -> tuple[SegmentMeans, ...]:
    """``history`` with the segment of ``signals`` appended, keeping the last ``RECENT_SEGMENTS``: what a decision
    after that segment observes (layout 2)."""
    return (*tuple(history)[-(RECENT_SEGMENTS - 1) :], segment_means(signals))


def history_features(history: Sequence[SegmentMeans]) -> list[float]:
    """Layout 2's extra entries from the recent segments' means (the latest last); zeros before any segment."""
    if not history:
        return [0.0] * len(HISTORY_NAMES)
    recent = np.asarray(history[-RECENT_SEGMENTS:], dtype=np.float64)
    mean = recent.mean(axis=0)
    trend = 0.5 + (recent[-1] - mean)
    return [*mean.tolist(), *trend.tolist()]


def segment_observation(
    signals: list[StepSignals],
    budget: float,
    policy: CachePolicy,
    uncertain: int | None = None,
    budget_range: tuple[float, float] | None = None,
    history: Sequence[SegmentMeans] | None = None,
) -> np.ndarray:
    """The observation after a segment; ``signals`` carry the context of the segment's last token.

    ``budget_range`` is what the budget is normalised over (default: ``policy``'s ``base_size``/``max_size``).
    ``history`` (layout 2): the recent segments' means, this one last (``push_history``); None gives layout 1.
    """
    if not signals:
        return np.zeros(OBS_DIM if history is None else obs_dim(2), dtype=np.float32)
    ent = np.array([s.entropy for s in signals]) / ENTROPY_SCALE
    gap = np.array([s.gap for s in signals])
    top1 = np.array([s.top1_prob for s in signals])
    if uncertain is None:
        uncertain = sum(s.entropy > policy.entropy_threshold or s.gap < policy.gap_threshold for s in signals)
    last = signals[-1]
    lo, hi = budget_range or (float(policy.base_size), float(policy.max_size))
    span = max(1.0, hi - lo)
    obs = [
        ent.mean(), ent.min(), ent.max(),
        gap.mean(), gap.min(), gap.max(),
        top1.mean(), top1.min(), top1.max(),
        uncertain / len(signals),
        (budget - lo) / span,
        last.resident / max(1, last.position),
        last.position / POSITION_SCALE,
        last.pool_usage,
    ]  # fmt: skip
    if history is not None:
        obs += history_features(history)
    return np.clip(np.nan_to_num(np.asarray(obs, dtype=np.float32)), 0.0, 1.0)
