"""Where a teacher-forced policy's KL comes from: the tokens scored at a peek, and those after it by distance.

    python benchmarks/peek_split.py --workload longgen --items 2 \
        --policy-file docs/bench/policies/dynamic-256-1024-decayed-r75-d98-per-token.yaml \
        --policy-file docs/bench/policies/dynamic-256-1024-decayed-r75-d98-per-token-stale.yaml

A per-token ``dynamic`` rule (``compact_interval: 1``) raises its budget at an uncertain token and recomputes that
token over what came back; the tokens after it are scored over the trimmed cache again. ``recompute: stale`` changes
both: the peek's token is scored over recomputed keys, and the keys the following tokens read were computed over the
peek's wider context. This scores the standard suite's first ``--items`` items of a teacher-forced workload under
each policy file and splits the mean KL to full into the tokens scored at a peek (more than ``--peek-resident`` keys
resident), and the others by how many tokens have passed since the last peek.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import shrunk_spec

from confkv.bench.evaluator import Evaluator
from confkv.bench.specs import suite_spec
from confkv.policy_source import load_policy
from confkv.scoring import ScoreItem, Scorer

SPANS = ((1, 1), (2, 5), (6, 20), (21, None))


def since_last_peek(resident: list[int], threshold: int) -> list[int]:
    """Per token, tokens since the last one scored over more than ``threshold`` keys (0 at a peek)."""
    out, d = [], 10**9
    for r in resident:
        d = 0 if r > threshold else d + 1
        out.append(d)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", choices=("prose", "longgen", "chat"), default="longgen")
    p.add_argument("--items", type=int, default=2, help="the standard suite's first items of the workload")
    p.add_argument("--policy-file", action="append", required=True)
    p.add_argument("--peek-resident", type=int, default=400, help="resident keys above which a token was a peek")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    spec = shrunk_spec(suite_spec(args.model, "standard"), args.items, (args.workload,))
    ev = Evaluator.prepare(args.model, spec, progress=False)
    items = [ScoreItem(r.scored_ids, r.score_from, r.topk) for r in ev.references[args.workload]]
    report = {}
    for f in args.policy_file:
        results = Scorer(ev.llm(load_policy(f)).engine).score(items)
        kl = torch.cat([r.kl for r in results]).double()
        dist = torch.tensor([d for r in results for d in since_last_peek(r.resident.tolist(), args.peek_resident)])
        rows = {"all": (kl.numel(), kl.mean().item()), "peek": _part(kl, dist == 0)}
        for lo, hi in SPANS:
            rows[f"{lo}-{hi or 'end'} after"] = _part(kl, (dist >= lo) & (dist <= (hi or 10**9)))
        report[Path(f).stem] = {k: {"tokens": n, "kl": m} for k, (n, m) in rows.items()}
        print(Path(f).stem)
        for k, (n, m) in rows.items():
            print(f"  {k:>12}: {n:5d} tokens  KL {m:.4f}" if n else f"  {k:>12}:     0 tokens")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _part(kl: torch.Tensor, mask: torch.Tensor) -> tuple[int, float]:
    n = int(mask.sum())
    return n, (kl[mask].mean().item() if n else float("nan"))


if __name__ == "__main__":
    main()
