"""The reward, explained: what each term contributed and whether a policy lost retrieval the full cache has.

``envs.evaluate`` splits every evaluation's mean episode reward into its terms (``reward_terms``: memory, KL, pass
keys, multi-keys, each with its weight) and reads from the references how many retrieval episodes the full cache
answers. The reward earns memory on every segment of every episode and a retrieval answer once per retrieval
episode, so it can rank first a policy that answers no pass key; ``eval`` and ``compare`` print these lines so that
a ranking is read with its reasons, and flag such a policy.
"""

from __future__ import annotations

from typing import Any

#: Terms in the order they are printed, with the words a table uses.
TERMS: tuple[tuple[str, str], ...] = (("memory", "memory"), ("kl", "KL"), ("passkey", "pass keys"),
                                      ("multikey", "multi-keys"))  # fmt: skip
_RETRIEVAL: tuple[tuple[str, str], ...] = (("passkey", "pass keys"), ("multikey", "multi-keys"))


def lost_retrieval(metrics: dict[str, Any]) -> list[str]:
    """What the policy answered less often than the full cache does on the same episodes, as short phrases
    (``pass keys 0% (full 100%)``); empty when it kept up, or when there is no retrieval episode."""
    out = []
    for key, words in _RETRIEVAL:
        acc, full = metrics.get(f"{key}_acc"), metrics.get(f"full_{key}_acc")
        if acc is not None and full is not None and acc < full - 1e-9:
            out.append(f"{words} {100 * acc:.0f}% (full {100 * full:.0f}%)")
    return out


def reward_lines(metrics: dict[str, Any]) -> list[str]:
    """The mean episode reward as the sum of its terms, one line each, and a warning when retrieval was lost."""
    terms = metrics.get("reward_terms") or {}
    if not terms:
        return [f"reward {metrics['reward']:.3f}"]
    segments = metrics.get("segments_mean")
    per_segment = f", summed over {segments:.1f} segments per episode" if segments else ""
    lines = [f"reward {metrics['reward']:.3f} per episode (mean over {metrics.get('episodes', '?')} episodes) ="]
    for key, words in TERMS:
        t = terms.get(key)
        if t is None:
            continue
        if key == "memory":
            how = f"weight {t['weight']:g} x (1 - resident KV share) per segment{per_segment}"
        elif key == "kl":
            how = f"weight {t['weight']:g} x mean KL to full per segment, subtracted{per_segment}"
        else:
            acc, full = metrics.get(f"{key}_acc"), metrics.get(f"full_{key}_acc")
            full_text = f"; the full cache answers {100 * full:.0f}%" if full is not None else ""
            how = (f"weight {t['weight']:g} per answer, once per episode, {t['episodes']} of the {t['of']} episodes; "
                   f"answered {100 * (acc or 0):.0f}%{full_text}")  # fmt: skip
        lines.append(f"  {'+' if t['contribution'] >= 0 else '-'} {abs(t['contribution']):.3f}  {words}: {how}")
    lost = lost_retrieval(metrics)
    if lost:
        lines.append(f"  RETRIEVAL LOST: {', '.join(lost)}. Memory is earned on every segment and an answer once per "
                     "retrieval episode, so the reward can still rank this policy high; weigh it with these rates "
                     "(a larger --task-weight makes the reward do so).")  # fmt: skip
    return lines


def reward_table(rows: list[dict[str, Any]]) -> list[str]:
    """A Markdown table of each compared policy's reward split into its terms, with the retrieval verdict."""
    lines = [
        "| policy | reward | = memory | + KL | + pass keys | + multi-keys | retrieval against full |",
        "|:---|---:|---:|---:|---:|---:|:---|",
    ]
    for r in rows:
        terms = r.get("reward_terms") or {}
        cells = [f"{terms[k]['contribution']:+.3f}" if k in terms else "n/a" for k, _ in TERMS]
        lost = lost_retrieval(r)
        verdict = ("**lost**: " + ", ".join(lost)) if lost else "kept"
        lines.append(f"| {r['policy']} | {r['reward']:.3f} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def weights_note(rows: list[dict[str, Any]]) -> str:
    """One sentence on how the terms are weighted, from the first row's terms (every row has the same weights)."""
    terms = (rows[0].get("reward_terms") if rows else None) or {}
    if not terms:
        return ""
    segments = rows[0].get("segments_mean")
    parts = [f"{words} x{terms[k]['weight']:g}" for k, words in TERMS if k in terms]
    seg = f" (about {segments:.0f} segments per episode)" if segments else ""
    return (
        f"Weights: {', '.join(parts)}. Memory and KL are summed over every segment of an episode{seg}; a "
        "retrieval answer counts once per retrieval episode, averaged over all episodes, so it moves the mean "
        "reward far less than memory does: read the retrieval column beside the reward."
    )


def term_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The terms as flat numbers for MLflow (``reward_memory``, ``reward_kl``, ``reward_passkey`` ...)."""
    return {f"reward_{k}": t["contribution"] for k, t in (metrics.get("reward_terms") or {}).items()}
