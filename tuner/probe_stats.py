"""How well each observed feature predicts the gain of a larger budget, with intervals over items.

For one workload's ``envs.probe.ItemProbe``s, pooled over items: ROC AUC of the feature for "the gain is in the
top quarter" (``sklearn.metrics.roc_auc_score``; above 0.5 a larger feature means a larger gain, below 0.5 a
smaller one: the distance from 0.5 is what a controller can use) and Spearman's rho between feature and gain
(``scipy.stats.spearmanr``). The intervals are 95% percentile bootstrap intervals over *items*: the segments of
one text are not independent draws, so each resample draws whole items with replacement and recomputes the
quarter's threshold, the AUC and rho on the pooled segments of the drawn items.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from envs.probe import SEGMENT_FEATURES, TOKEN_FEATURES, ItemProbe

LEVELS = {"segment": SEGMENT_FEATURES, "token": TOKEN_FEATURES}
#: A resample's statistic is undefined when its gains have no top quarter (all equal) or a feature is constant;
#: an interval needs at least this share of the resamples to be defined, else it is reported as missing.
MIN_DEFINED = 0.5


@dataclass
class FeatureRow:
    workload: str
    level: str
    feature: str
    auc: float | None
    auc_lo: float | None
    auc_hi: float | None
    rho: float | None
    rho_lo: float | None
    rho_hi: float | None
    items: int
    n: int  # segments (or tokens) pooled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GainRow:
    """The gain itself per workload and level: its mean with an interval, and the share of it the top quarter holds."""

    workload: str
    level: str
    items: int
    n: int
    gain_mean: float | None
    gain_lo: float | None
    gain_hi: float | None
    top_quarter_share: float | None  # share of the total positive gain carried by the top quarter

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pool(probes: list[ItemProbe], level: str, idx: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    if level == "segment":
        gain = np.concatenate([probes[i].segment_gain for i in idx])
        feats = {f: np.concatenate([probes[i].segment_features[f] for i in idx]) for f in SEGMENT_FEATURES}
    else:
        gain = np.concatenate([probes[i].token_gain for i in idx])
        feats = {f: np.concatenate([probes[i].token_features[f] for i in idx]) for f in TOKEN_FEATURES}
    return gain, feats


def _stats(gain: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """(AUC for the top quarter of ``gain``, Spearman's rho); NaN where undefined."""
    if gain.size < 4:
        return math.nan, math.nan
    top = gain > np.quantile(gain, 0.75)
    auc = float(roc_auc_score(top, x)) if 0 < top.sum() < top.size else math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a constant feature: rho is NaN, which is what we report
        rho = float(spearmanr(x, gain).statistic) if np.ptp(x) > 0 and np.ptp(gain) > 0 else math.nan
    return auc, rho


def _interval(values: list[float]) -> tuple[float | None, float | None]:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size < MIN_DEFINED * max(1, len(values)):
        return None, None
    lo, hi = np.percentile(v, [2.5, 97.5])
    return float(lo), float(hi)


def _opt(v: float) -> float | None:
    return None if not math.isfinite(v) else v


def feature_table(
    probes: list[ItemProbe], resamples: int = 1000, seed: int = 0
) -> tuple[list[FeatureRow], list[GainRow]]:
    """Every feature's AUC and rho with bootstrap intervals, per level, for one workload's items."""
    if not probes:
        raise ValueError("the probe has no items")
    workload = probes[0].workload
    rng = np.random.default_rng(seed)
    n_items = len(probes)
    draws = [rng.integers(0, n_items, n_items) for _ in range(resamples)]
    rows: list[FeatureRow] = []
    gains: list[GainRow] = []
    for level, names in LEVELS.items():
        gain, feats = _pool(probes, level, np.arange(n_items))
        point = {f: _stats(gain, feats[f]) for f in names}
        boot: dict[str, list[tuple[float, float]]] = {f: [] for f in names}
        boot_gain: list[float] = []
        for idx in draws:
            g, fs = _pool(probes, level, idx)
            boot_gain.append(float(g.mean()) if g.size else math.nan)
            for f in names:
                boot[f].append(_stats(g, fs[f]))
        for f in names:
            auc_lo, auc_hi = _interval([a for a, _ in boot[f]])
            rho_lo, rho_hi = _interval([r for _, r in boot[f]])
            rows.append(FeatureRow(workload, level, f, _opt(point[f][0]), auc_lo, auc_hi, _opt(point[f][1]),
                                   rho_lo, rho_hi, n_items, int(gain.size)))  # fmt: skip
        g_lo, g_hi = _interval(boot_gain)
        positive = np.clip(gain, 0, None)
        share = None
        if gain.size >= 4 and positive.sum() > 0:
            share = float(positive[gain > np.quantile(gain, 0.75)].sum() / positive.sum())
        mean = float(gain.mean()) if gain.size else None
        gains.append(GainRow(workload, level, n_items, int(gain.size), mean, g_lo, g_hi, share))
    return rows, gains


def _ci(v: float | None, lo: float | None, hi: float | None, fmt: str = ".2f") -> str:
    if v is None:
        return "n/a"
    if lo is None or hi is None:
        return f"{v:{fmt}}"
    return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def markdown(rows: list[FeatureRow], gains: list[GainRow], title: str) -> str:
    """The table: one block per workload and level, the gain first, then each feature's AUC and rho."""
    lines = [f"# {title}", ""]
    for g in gains:
        share = "n/a" if g.top_quarter_share is None else f"{100 * g.top_quarter_share:.0f}%"
        lines += [
            f"## {g.workload}, per {g.level} ({g.items} items, {g.n} {g.level}s)",
            "",
            f"Gain of the larger budget (KL at base_size - KL at max_size): mean "
            f"{_ci(g.gain_mean, g.gain_lo, g.gain_hi, '.4f')}; the top quarter carries {share} of the positive gain.",
            "",
            "| feature | AUC (gain in top quarter) [95% CI] | Spearman rho [95% CI] |",
            "|:---|---:|---:|",
        ]
        for r in rows:
            if r.workload == g.workload and r.level == g.level:
                lines.append(f"| {r.feature} | {_ci(r.auc, r.auc_lo, r.auc_hi)} | {_ci(r.rho, r.rho_lo, r.rho_hi)} |")
        lines.append("")
    return "\n".join(lines)
