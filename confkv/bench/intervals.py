"""95% intervals for the throughput suite's rows (issue 34: a headline whose every column carries its interval).

Two sources of uncertainty, two methods:

* **requests/s** is one number per run of the whole stream (the requests share the engine's steps, so they are no
  independent samples of it): its interval comes from repeated runs, Student's t over their requests/s;
* **a ratio of requests/s** (a row against ``full`` on demand) is bounded by the two means' 97.5% t-intervals
  (Bonferroni: both hold together with at least 95%, so the ratio lies within [low_a / high_b, high_a / low_b]);
* **the resident KV share** is a per-request figure: a bootstrap over the run's requests (1,000 resamples).

``paired_items`` is the same percentile bootstrap for a statistic of several rows measured on the same items (issue
35: a row's perplexity against another's on the same prose): each resample draws item indices, and every row's
figure is recomputed on those same items, so what the items share cancels out of the interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import stats

RESAMPLES = 1000


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The mean's two-sided ``level`` interval by Student's t; None from fewer than two values."""
    if len(values) < 2:
        return None
    mean = float(np.mean(values))
    half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * float(np.std(values, ddof=1)) / math.sqrt(len(values))
    return mean - half, mean + half


def ratio_interval(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """A 95% interval for mean(a) / mean(b) from the two means' 97.5% t-intervals (Bonferroni); None when either
    has fewer than two runs or ``b``'s interval reaches zero."""
    ia, ib = t_interval(a, 0.975), t_interval(b, 0.975)
    if ia is None or ib is None or ib[0] <= 0:
        return None
    return max(ia[0], 0.0) / ib[1], ia[1] / ib[0]


def bootstrap_mean(values: list[float], seed: int = 0) -> tuple[float, float] | None:
    """The mean's 95% percentile-bootstrap interval over ``values`` (1,000 resamples); None from fewer than two."""
    if len(values) < 2:
        return None
    rng = np.random.default_rng(seed)
    arr = np.asarray(values, dtype=float)
    means = arr[rng.integers(0, len(arr), size=(RESAMPLES, len(arr)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired_items(
    stat: Callable[[np.ndarray], float], n: int, seed: int = 0
) -> tuple[float, float | None, float | None]:
    """``stat`` over all ``n`` items (it takes an array of item indices) and its 95% percentile-bootstrap interval:
    ``scipy.stats.bootstrap`` resamples the indices (1,000 times), so a ``stat`` that compares rows reads the same
    drawn items for each of them (a paired bootstrap). The interval is None from fewer than two items."""
    idx = np.arange(n)
    point = float(stat(idx))
    if n < 2:
        return point, None, None
    ci = stats.bootstrap(
        (idx,), stat, vectorized=False, n_resamples=RESAMPLES, method="percentile", rng=np.random.default_rng(seed)
    ).confidence_interval
    return point, float(ci.low), float(ci.high)
