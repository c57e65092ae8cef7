"""Why ``dynamic`` loses to a fixed budget at equal memory on some workloads: the shape of KL against the budget,
and whether the confidence signal places the budget better than chance.

    python benchmarks/budget_shape.py --workloads prose,longgen,chat --budgets 64,128,256,384,512,768 --items 2

Two measurements on the standard suite's held-out items (teacher-forced; mean KL per token to the full cache):

1. **Sweep.** A fixed budget ranked by the dynamic policy's own scorer (the ``snapkv`` preset) at each of
   ``--budgets``: mean KL against mean resident memory. Where KL is convex in the budget, a budget that swings
   between ``base_size`` and ``max_size`` loses to a fixed one at the same mean memory even if nothing is wrong
   with where it swings (Jensen's inequality); the second differences of the curve say how much.
2. **Placebo.** ``dynamic`` twice: on the model's signals, then on a confidence-blind signal with the same
   statistics: a two-state Markov chain fitted to the first run's decisions (the same share of uncertain steps and
   the same mean run lengths), fed to the same rule in place of the model's signals. The budget swings alike, but
   not where the model is unsure. Real ahead of placebo: the signal puts memory where it pays. Real no better: on
   this workload the signal carries nothing the rule can use. Each run is matched with a fixed ``snapkv`` budget
   (``--match``: other fixed policies too) at its own measured mean memory (``confkv.bench.memory.matched_budget``).
3. **Oracle** (``--oracle``). The same rule fed a signal that knows the future: before each token it is told
   whether the next ``compact_interval`` tokens (the chunk its decision governs) are among the hardest for a fixed
   ``snapkv`` budget of ``base_size``, measured per token in a first run (mean KL to full over the chunk above a
   threshold that flags the same share of steps as the model's own signal did). No causal signal can place memory
   better than this one; if the oracle does not beat a fixed budget at its own memory, no confidence signal can on
   this workload. Items are scored one at a time so that each run's controller knows its item.

The placebo replaces ``DynamicController.update`` for the duration of one run (the only place a signal enters the
rule); nothing else changes. ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from common import shrunk_spec, split_arg
from dynamic_ablation import TEACHER_FORCED, measure

from confkv.bench.evaluator import Evaluator
from confkv.bench.memory import Usage, matched_budget
from confkv.bench.specs import baseline_policy, scaled_dynamic, suite_spec
from confkv.config import CachePolicy
from confkv.controllers import BudgetState, DynamicController, StepSignals
from confkv.policy_source import load_policy
from confkv.progress import bars
from confkv.scoring import ScoreItem, Scorer

_UNSURE = {"entropy": math.inf, "gap": 0.0, "top1_prob": 0.0}
_SURE = {"entropy": 0.0, "gap": 1.0, "top1_prob": 1.0}


@dataclasses.dataclass
class Chain:
    """A two-state Markov chain over uncertain (True) / confident (False) steps."""

    p_unsure_after_unsure: float
    p_unsure_after_sure: float

    @property
    def stationary(self) -> float:
        """Long-run share of uncertain steps."""
        denom = 1.0 - self.p_unsure_after_unsure + self.p_unsure_after_sure
        return self.p_unsure_after_sure / denom if denom > 0 else 1.0

    @staticmethod
    def fit(transitions: Counter[tuple[bool, bool]]) -> Chain:
        def rate(prev: bool) -> float:
            total = transitions[(prev, True)] + transitions[(prev, False)]
            return transitions[(prev, True)] / total if total else 0.0

        return Chain(rate(True), rate(False))


@contextlib.contextmanager
def rule_hook(
    chain: Chain | None = None, seed: int = 0, oracle: list[bool] | None = None
) -> Iterator[Counter[tuple[bool, bool]]]:
    """While the block runs, count the rule's (previous, current) decisions; with ``chain``, feed the rule decisions
    drawn from it instead of the model's signals (the placebo); with ``oracle``, the decision of the ``steps``-th
    update is ``oracle[steps]`` (one sequence at a time)."""
    original = DynamicController.update
    rng = random.Random(seed)
    counts: Counter[tuple[bool, bool]] = Counter()

    def update(self: DynamicController, state: BudgetState, s: StepSignals) -> BudgetState:
        if oracle is not None:
            s = dataclasses.replace(s, **(_UNSURE if oracle[min(state.steps, len(oracle) - 1)] else _SURE))
        elif chain is not None:
            if state.steps:
                p = chain.p_unsure_after_unsure if state.uncertain else chain.p_unsure_after_sure
            else:
                p = chain.stationary
            s = dataclasses.replace(s, **(_UNSURE if rng.random() < p else _SURE))
        new = original(self, state, s)
        if state.steps:
            counts[(state.uncertain, new.uncertain)] += 1
        return new

    DynamicController.update = update  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        DynamicController.update = original  # type: ignore[method-assign]


def hard_ahead(kl: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per scored token ``j``: the mean KL over tokens ``j+1 .. j+chunk`` (what the decision after ``j`` governs)."""
    padded = torch.cat([kl.double(), kl.new_zeros(chunk, dtype=torch.float64)])
    csum = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    j = torch.arange(len(kl))
    return (csum[j + 1 + chunk] - csum[j + 1]) / chunk


def score_oracle(
    ev: Evaluator, base: CachePolicy, workload: str, share: float
) -> tuple[dict[str, Any], Usage, Counter[tuple[bool, bool]]]:
    """``dynamic`` under the oracle signal (module docstring, item 3), flagging ``share`` of the steps."""
    refs = ev.references[workload]
    items = [ScoreItem(r.scored_ids, r.score_from, r.topk) for r in refs]
    low = Scorer(ev.llm(baseline_policy(base, "snapkv", base.base_size)).engine).score(items)
    ahead = [hard_ahead(r.kl, base.compact_interval) for r in low]
    threshold = float(torch.quantile(torch.cat(ahead), 1.0 - share)) if share > 0 else math.inf
    usage, counts = Usage("chunked"), Counter()
    kl_sum = tokens = 0.0
    for ref, item, a in zip(refs, items, ahead, strict=True):
        with rule_hook(oracle=(a > threshold).tolist()) as c:
            (res,) = Scorer(ev.llm(base).engine).score([item])
        counts.update(c)
        usage.add_scored(res, len(ref.scored_ids))
        kl_sum += float(res.kl.sum())
        tokens += res.num_tokens
    return {"kl": kl_sum / tokens}, usage, counts


def share_unsure(counts: Counter[tuple[bool, bool]]) -> float:
    total = sum(counts.values())
    return sum(v for (_, cur), v in counts.items() if cur) / total if total else 0.0


def ppl_text(m: dict[str, Any]) -> str:
    """Prose's perplexity over full's, where the workload has one: KL ranks the rows, perplexity can disagree."""
    return f"  ppl {100 * m['ppl_delta']:+.2f}%" if "ppl_delta" in m else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--items", type=int, default=2, help="items per workload (the standard suite's first ones)")
    p.add_argument("--workloads", default="prose,longgen,chat")
    p.add_argument("--budgets", default="64,128,256,384,512,768", help="fixed budgets (tokens) of the sweep")
    p.add_argument("--seed", type=int, default=0, help="the placebo chain's seed")
    p.add_argument("--oracle", action="store_true", help="add the oracle run (teacher-forced workloads only)")
    p.add_argument("--no-placebo", action="store_true", help="leave the placebo run out")
    p.add_argument("--match", default="snapkv", help="fixed policies matched to each run's memory (comma-separated)")
    p.add_argument("--policy-file", default=None, help="a dynamic policy (YAML) in place of the suite's scaled default")
    split_arg(p)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if unknown := [w for w in args.workloads.split(",") if w and w not in TEACHER_FORCED]:
        p.error(f"--workloads takes the teacher-forced workloads ({', '.join(TEACHER_FORCED)}), not {unknown}")
    spec = shrunk_spec(suite_spec(args.model, "standard"), args.items, TEACHER_FORCED)
    t0 = time.perf_counter()
    ev = Evaluator.prepare(args.model, spec, split=args.split, progress=bars())
    print(f"references ready ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    base = load_policy(args.policy_file) if args.policy_file else scaled_dynamic(spec.scale)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    result: dict[str, Any] = {"model": args.model, "items": args.items, "split": args.split,
                              "base": base.model_dump(mode="json"), "workloads": {}}  # fmt: skip
    for workload in (w for w in args.workloads.split(",") if w):
        t1 = time.perf_counter()
        sweep = []
        for budget in budgets:
            m, u = measure(ev, baseline_policy(base, "snapkv", budget), workload)
            sweep.append({"budget": budget, "kv": u.fraction_mean, "kl": m["kl"]})
            print(f"{workload:>8} snapkv@{budget:<5} kv {100 * u.fraction_mean:5.1f}%  kl {m['kl']:.4f}", flush=True)
        runs = {}
        with rule_hook() as counts:
            m, u = measure(ev, base, workload)
        chain = Chain.fit(counts)
        runs["dynamic"] = (m, u, counts)
        if not args.no_placebo:
            with rule_hook(chain, args.seed) as pcounts:
                m, u = measure(ev, base, workload)
            runs["placebo"] = (m, u, pcounts)
        if args.oracle:
            runs["oracle"] = score_oracle(ev, base, workload, share_unsure(counts))
        entry: dict[str, Any] = {"sweep": sweep, "chain": dataclasses.asdict(chain)}
        for name, (m, u, c) in runs.items():
            budget = matched_budget([u], u.resident, base)
            entry[name] = {"kv": u.fraction_mean, "kl": m["kl"], "share_unsure": share_unsure(c), "matched": {}}
            entry[name].update({"ppl_delta": m["ppl_delta"]} if "ppl_delta" in m else {})
            line = f"{workload:>8} {name:<8} kv {100 * u.fraction_mean:5.1f}%  kl {m['kl']:.4f}{ppl_text(m)}  unsure "
            line += f"{100 * share_unsure(c):4.1f}%"
            for fixed in args.match.split(","):
                bm, bu = measure(ev, baseline_policy(base, fixed, budget), workload)
                entry[name]["matched"][fixed] = {"budget": budget, "kv": bu.fraction_mean, "kl": bm["kl"]}
                entry[name]["matched"][fixed].update({"ppl_delta": bm["ppl_delta"]} if "ppl_delta" in bm else {})
                line += f" | {fixed}@{budget} kv {100 * bu.fraction_mean:5.1f}%  kl {bm['kl']:.4f}{ppl_text(bm)}"
            print(line, flush=True)
        entry["seconds"] = time.perf_counter() - t1
        result["workloads"][workload] = entry
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
