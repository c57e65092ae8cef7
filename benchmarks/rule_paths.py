"""One budget rule, two paths: what each decision does to the pass key's block in the environment and in the engine.

    python benchmarks/rule_paths.py --model smollm2-135m --items-scale 6 --items 0,1
    python benchmarks/rule_paths.py --model tiny-random --items 0,1

The hand rule "expand when the latest segment's ``--feature`` exceeds ``--threshold``, else contract" runs on the
same held-out ``passkey-varied`` items twice: as an agent in the training environment (``envs.env``: each decision
moves the budget with ``LLMEngine.resize`` before the next segment) and as the exported one-layer budget network
(``benchmarks/rule_network.py``) through the engine's ``LearnedController`` (the decision is taken inside the
chunk's rows and the cache manager expands or contracts between chunks), the path ``confkv-tune compare`` measures.
For every segment it prints, per path, the budget the controller holds, the applied budget, the resident tokens,
whether the block(s) holding the pass key are resident when the segment is computed, and the blocks recalled so far
(counted the same way on both paths; the engine also counts its first decision, at the prompt's end, as an expansion,
so expansion counts are left out);
then whether each path answered. The first segment where the two paths differ is where they part.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from benchmarks.rule_network import rule_network
from benchmarks.trend_rule import trend_rule
from confkv.controllers.observation import obs_names
from confkv.scoring import Scorer
from envs.env import RewardWeights, _Slots
from envs.episodes import Episode, TuneData, build_episodes, scaled_sizes


@dataclass
class Row:
    """A sequence's cache as the next segment is computed over it."""

    position: int
    controller_budget: float
    applied_budget: float
    resident: int
    key_resident: bool
    recalled: int

    def cells(self) -> str:
        return (f"{self.controller_budget:6.1f} {self.applied_budget:6.1f} {self.resident:4d} "
                f"{'key' if self.key_resident else '---'} {self.recalled:3d}")  # fmt: skip


def key_blocks(ep: Episode, block_size: int) -> list[int]:
    """Logical blocks holding the pass key in the haystack: the answer's tokens where they first occur before it."""
    assert ep.task is not None
    ids = ep.item.token_ids
    a, b = ep.task
    start = ep.item.score_from
    answer = ids[start + a : start + b]
    for i in range(start + a - len(answer) + 1):
        if ids[i : i + len(answer)] == answer:
            return sorted({j // block_size for j in range(i, i + len(answer))})
    raise ValueError(f"the answer of {ep.item_id} does not occur before it")


def snapshot(seq: Any, blocks: list[int]) -> Row:
    kv = seq.kv
    entries = kv.table.entries
    return Row(
        position=seq.num_computed,
        controller_budget=float(seq.ctrl.budget),
        applied_budget=float(kv.budget),
        resident=int(kv.table.resident_tokens()),
        key_resident=all(i < len(entries) and entries[i] >= 0 for i in blocks),
        recalled=int(kv.stats.recalled_blocks),
    )


def environment_path(data: TuneData, episodes: list[Episode], feature: int, threshold: float
                     ) -> tuple[list[list[Row]], list[bool]]:  # fmt: skip
    """The rule as an agent in the environment; each row is taken after the decision's ``resize``."""
    slots = _Slots(data, len(episodes), "budget", RewardWeights())
    act = trend_rule(feature, threshold)
    bs = data.base_policy.block_size
    blocks = [key_blocks(ep, bs) for ep in episodes]
    obs = [slots.start(i, ep) for i, ep in enumerate(episodes)]
    rows: list[list[Row]] = [[] for _ in episodes]
    correct = [False] * len(episodes)
    live = set(range(len(episodes)))
    step = slots.session.step

    def snapshot_then_step(only: set[int] | None = None) -> Any:
        # after every slot's decision has been applied (``resize``), before the segment is computed
        for i in live:
            st = slots.session.state(slots.index[i])  # type: ignore[arg-type]
            if st is not None:
                rows[i].append(snapshot(st.seq, blocks[i]))
        return step(only)

    slots.session.step = snapshot_then_step  # type: ignore[method-assign]
    while live:
        order = sorted(live)
        results = slots.advance_some(order, [act(obs[i]) for i in order])
        for i, (o, _r, done, info) in zip(order, results, strict=True):
            obs[i] = o
            if done:
                live.discard(i)
                correct[i] = bool(info.get("task_correct", 0.0))
    slots.close()
    return rows, correct


def engine_path(data: TuneData, episodes: list[Episode], feature: str, threshold: float
                ) -> tuple[list[list[Row]], list[bool]]:  # fmt: skip
    """The rule exported as a budget network, run by the engine's ``LearnedController`` (as ``compare`` runs it);
    each row is taken after the step whose rows set off the decision, so it is the cache the next chunk sees."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        rule_network(feature, threshold).save(folder, data.base_policy)
        policy = data.base_policy.replace(controller="learned", learned_path=folder)
        llm = data.llm(policy, max_batch_size=len(episodes))
        bs = data.base_policy.block_size
        blocks = [key_blocks(ep, bs) for ep in episodes]
        rows: list[list[Row]] = [[] for _ in episodes]
        with Scorer(llm.engine).session() as session:
            index = [session.add(ep.item) for ep in episodes]
            live = dict(enumerate(index))
            while live:
                session.step()
                for i, idx in list(live.items()):
                    st = session.state(idx)
                    if st is None:
                        del live[i]
                    else:
                        rows[i].append(snapshot(st.seq, blocks[i]))
            results = [session.result(i) for i in index]
    correct = []
    for ep, r in zip(episodes, results, strict=True):
        a, b = ep.task  # type: ignore[misc]
        correct.append(bool(r.greedy_match[a:b].all()))  # type: ignore[index]
    return rows, correct


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", default="passkey-varied")
    p.add_argument("--split", default="heldout")
    p.add_argument("--items-scale", type=int, default=6)
    p.add_argument("--items", default="0,1", help="indices of the split's episodes")
    p.add_argument("--feature", default="entropy_max")
    p.add_argument("--threshold", type=float, default=0.2)
    args = p.parse_args()
    sizes = scaled_sizes(args.model, args.items_scale)
    data = build_episodes(args.model, workload=args.workload, split=args.split, sizes=sizes)
    data.obs_version = 2
    chosen = [data.episodes[int(i)] for i in args.items.split(",")]
    feature = obs_names(2).index(args.feature)
    env_rows, env_ok = environment_path(data, chosen, feature, args.threshold)
    eng_rows, eng_ok = engine_path(data, chosen, args.feature, args.threshold)
    bs = data.base_policy.block_size
    for ep, er, gr, eok, gok in zip(chosen, env_rows, eng_rows, env_ok, eng_ok, strict=True):
        a, _ = ep.task  # type: ignore[misc]
        print(
            f"\n## {ep.item_id}: {len(ep.item.token_ids)} tokens, scored from {ep.item.score_from}, answer at "
            f"{ep.item.score_from + a}, key blocks {key_blocks(ep, bs)}; answered: environment {eok}, engine {gok}"
        )
        print("segment | environment: ctrl applied resident key recalled | engine: the same | differ")
        for k in range(max(len(er), len(gr))):
            e = er[k].cells() if k < len(er) else ""
            g = gr[k].cells() if k < len(gr) else ""
            pos = (er[k] if k < len(er) else gr[k]).position
            print(f"{k:3d} @{pos:5d} | {e} | {g} | {'*' if e != g else ''}")


if __name__ == "__main__":
    main()
