"""Rows of a benchmark paired against one row on the same items: perplexity with a bootstrap interval, pass keys
item by item (issue 35: is demotion ahead of a fixed baseline at the same bytes, or within the noise of two texts?).

Each row keeps its per-item prose sums (``prose_nll``: the item's summed negative log-likelihood; ``prose_tokens``:
its scored tokens) and its per-key answers (``passkey_items``: right or wrong). A row's perplexity on a set of items
is pooled, ``exp(sum of NLL / sum of tokens)``, as the benchmark reports it. Its difference from the row it is paired
with is in percentage points of ``full``'s perplexity on the same items, ``100 * (row - against) / full``: the
difference of the two rows' ``ppl_delta_pct``. The interval resamples the prose items (``intervals.paired_items``),
recomputing all three perplexities on each resample, so the interval is about these rows on text like these items,
not about the model's rounding on one text.

The keys are paired item by item: the keys one row answers and the other does not, and the exact two-sided McNemar
test on those discordant keys (a binomial test at one half: the keys both answer or both miss say nothing about which
row is better). A row is ahead of another on a measure when the 95% interval (prose) or the test at 5% (keys) says
so; ahead overall when it is ahead on one measure and behind on none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

from confkv.bench.intervals import paired_items


def item_sums(token_logprobs: Sequence[Sequence[float]]) -> tuple[list[float], list[int]]:
    """Each item's summed negative log-likelihood and its scored tokens."""
    return [float(-sum(lps)) for lps in token_logprobs], [len(lps) for lps in token_logprobs]


def pooled_ppl(row: dict, idx: np.ndarray) -> float:
    """A row's perplexity over the items ``idx`` (with repeats, as a resample draws them), every token weighed
    alike."""
    nll, tokens = np.asarray(row["prose_nll"], dtype=float), np.asarray(row["prose_tokens"], dtype=float)
    return math.exp(float(nll[idx].sum() / tokens[idx].sum()))


def ppl_difference(row: dict, against: dict, full: dict, idx: np.ndarray) -> float:
    """``row``'s perplexity minus ``against``'s on the items ``idx``, in percentage points of ``full``'s there."""
    return 100 * (pooled_ppl(row, idx) - pooled_ppl(against, idx)) / pooled_ppl(full, idx)


def pair_prose(row: dict, against: dict, full: dict, seed: int = 0) -> dict:
    """The difference on every item and its 95% paired interval over items."""
    if row["prose_tokens"] != against["prose_tokens"] or row["prose_tokens"] != full["prose_tokens"]:
        raise ValueError("paired rows must be scored on the same items (their token counts differ)")
    point, low, high = paired_items(lambda idx: ppl_difference(row, against, full, idx), len(row["prose_nll"]), seed)
    return {"ppl_diff_pp": point, "ppl_diff_ci95": None if low is None else [low, high]}


def pair_keys(row: dict, against: dict) -> dict:
    """Keys the row answers that ``against`` does not, the reverse (item by item, not only the totals), and the
    exact McNemar p-value of that split (1 when no key is discordant)."""
    pairs = list(zip(row["passkey_items"], against["passkey_items"], strict=True))
    row_only = sum(a and not b for a, b in pairs)
    against_only = sum(b and not a for a, b in pairs)
    return {
        "keys_row_only": row_only,
        "keys_against_only": against_only,
        "keys_p": mcnemar_exact(row_only, against_only),
    }


def mcnemar_exact(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value of ``b`` keys one way and ``c`` the other (their binomial test at one
    half)."""
    return 1.0 if b + c == 0 else float(stats.binomtest(b, b + c, 0.5).pvalue)


def pair_rows(rows: dict[str, dict], against: str, full: str = "full@auto", seed: int = 0) -> dict[str, dict]:
    """Every row (``against`` included: its difference is 0) paired with row ``against``, on what both measured."""
    out: dict[str, dict] = {}
    for name, row in rows.items():
        pair: dict = {}
        if "prose_nll" in row and "prose_nll" in rows[against]:
            pair.update(pair_prose(row, rows[against], rows[full], seed))
        if "passkey_items" in row and "passkey_items" in rows[against]:
            pair.update(pair_keys(row, rows[against]))
        if pair:
            out[name] = {**pair, "verdicts": measure_verdicts(pair)}
    return out


def verdict(pair: dict) -> str:
    """Where ``against`` stands by the interval: ahead when the row is worse on the whole interval, behind when the
    row is better on it, tied when it spans zero (or there is none)."""
    ci = pair.get("ppl_diff_ci95")
    if ci is None or ci[0] <= 0 <= ci[1]:
        return "tied"
    return "ahead" if ci[0] > 0 else "behind"


def keys_verdict(pair: dict, alpha: float = 0.05) -> str:
    """Where ``against`` stands on the keys: ahead when it answers more of the discordant keys and the exact test
    rejects an even split at ``alpha``, behind in the mirror case, tied otherwise."""
    if pair["keys_p"] >= alpha:  # an even split has p = 1
        return "tied"
    return "ahead" if pair["keys_against_only"] > pair["keys_row_only"] else "behind"


def overall(verdicts: Sequence[str]) -> str:
    """One verdict from several measures' (prose, keys): ahead when ahead on one and behind on none, behind in the
    mirror case, mixed when ahead on one and behind on another, tied when every one is tied."""
    ahead, behind = "ahead" in verdicts, "behind" in verdicts
    if ahead and behind:
        return "mixed"
    return "ahead" if ahead else "behind" if behind else "tied"


def measure_verdicts(pair: dict) -> dict[str, str]:
    """The verdict on each measure the pair holds, and over them."""
    out = {}
    if "ppl_diff_pp" in pair:
        out["prose"] = verdict(pair)
    if "keys_p" in pair:
        out["keys"] = keys_verdict(pair)
    out["overall"] = overall(list(out.values()))
    return out


def paired_table(pairs: dict[str, dict], against: str) -> str:
    """The pairs (``pair_rows``'s, verdicts included) as a text table for the printed report."""
    lines = [
        f"each row minus {against}: points of full's perplexity, 95% paired interval over the prose items; whether "
        f"{against} is ahead, tied or behind by it; keys the row answers that {against} does not / the reverse, the "
        f"exact McNemar p-value and the verdict by it; the verdict over both",
        f"{'row':<28} {'ppl diff':>9} {'95% interval':>22} {'verdict':>8}  {'keys':>7} {'p':>6} {'verdict':>8}"
        f" {'overall':>8}",
    ]
    for name, p in pairs.items():
        ci = p.get("ppl_diff_ci95")
        v = p["verdicts"]
        diff = f"{p['ppl_diff_pp']:+.3f}" if "ppl_diff_pp" in p else "-"
        interval = f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "-"
        keys, kp = (
            (f"{p['keys_row_only']} / {p['keys_against_only']}", f"{p['keys_p']:.3f}") if "keys_p" in p else ("-", "-")
        )
        lines.append(
            f"{name:<28} {diff:>9} {interval:>22} {v.get('prose', '-'):>8}  {keys:>7} {kp:>6} {v.get('keys', '-'):>8}"
            f" {v['overall']:>8}"
        )
    return "\n".join(lines)
