"""Multi-key retrieval, prompt by prompt: is the record the question asks for on the device when the answer starts?

    python benchmarks/record_resident.py --items 12 --split heldout \
        --policy-file docs/bench/policies/dynamic-256-384-decayed-r75-d98-reselect25-stale.yaml

For each of the standard suite's first ``--items`` multi-key prompts of ``--split``, each policy (``--policy-file``
files, and fixed ``--baselines`` at a given number of tokens) answers it alone (one sequence in the engine, so no
other prompt shares its steps). Once the prompt is read and its first token chosen (after any reselection by the
question and the recomputation it brings), the record's two parts are looked up in the sequence's block table:
the block holding "key <name> is" and the block holding the value's digits (a 16-token block cuts most records
between the two). A line per prompt says which are resident and whether the answer is right; the summary splits
accuracy by that. It tells apart a policy whose question does not find the record from a model that does not
answer with it.
"""

from __future__ import annotations

from pathlib import Path

from common import load, parser, report, setup, split_arg

from confkv import LLM, SamplingParams
from confkv.bench.specs import baseline_policy, suite_spec
from confkv.bench.workloads import WorkloadItem, make_workload
from confkv.config import CachePolicy
from confkv.policy_source import load_policy


def _find(ids: list[int], part: list[int]) -> int | None:
    """Where ``part`` first occurs in ``ids`` (the record comes before the question that repeats its key)."""
    return next((p for p in range(len(ids) - len(part) + 1) if ids[p : p + len(part)] == part), None)


def record_blocks(tokenizer, item: WorkloadItem, block_size: int) -> tuple[set[int], set[int]]:
    """Logical blocks of the asked record's key phrase and of its value's digits."""
    ids = list(item.prompt_ids)
    key = tokenizer.encode(f" key {item.meta['key']} is", add_special_tokens=False)
    value = tokenizer.encode(f" {item.answer}", add_special_tokens=False)
    k, v = _find(ids, key), _find(ids, value)
    if k is None or v is None:
        raise RuntimeError(f"{item.item_id}: the record's tokens were not found in the prompt")
    return {p // block_size for p in range(k, k + len(key))}, {p // block_size for p in range(v, v + len(value))}


def answer_alone(llm: LLM, item: WorkloadItem) -> tuple[set[int], str]:
    """Resident logical blocks once the first token is chosen, and the whole answer."""
    engine = llm.engine
    engine.add_request(item.item_id, list(item.prompt_ids), SamplingParams(max_tokens=item.max_tokens))
    resident: set[int] | None = None
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.output is not None:
                text = out.output.text
        running = engine.scheduler.running
        if resident is None and running and running[0].output_token_ids:
            entries = running[0].kv.table.entries
            resident = {i for i, b in enumerate(entries) if b >= 0}
    return resident or set(), text


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--items", type=int, default=12)
    split_arg(p)
    p.add_argument(
        "--baselines",
        default="snapkv:288",
        help="comma-separated NAME:TOKENS fixed policies, built on --baselines-from's keys",
    )
    p.add_argument("--policy-file", action="append", default=[])
    p.add_argument(
        "--baselines-from", default=None,
        help="a policy file whose other keys (recent share, recent window, sinks) the baselines take, as confkv bench "
        "matches them to a variant; default: the built-in defaults",
    )  # fmt: skip
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    sizes = dict(suite_spec(args.model, "standard").multikey)
    sizes.pop("n")
    items = make_workload("multikey", loaded.tokenizer, split=args.split, n=args.items, **sizes)
    policies: list[tuple[str, CachePolicy]] = [(Path(f).stem, load_policy(f)) for f in args.policy_file]
    base = load_policy(args.baselines_from) if args.baselines_from else CachePolicy()
    for spec in filter(None, args.baselines.split(",")):
        name, _, tokens = spec.partition(":")
        policies.append((spec, baseline_policy(base, name, int(tokens))))
    result: dict = {**env, "split": args.split, "items": len(items)}
    for name, policy in policies:
        llm = LLM(args.model, policy, loaded=loaded, max_batch_size=1, kv_cache_memory="1GiB")
        rows = []
        for item in items:
            key_blocks, value_blocks = record_blocks(loaded.tokenizer, item, policy.block_size)
            resident, text = answer_alone(llm, item)
            row = {
                "item": item.item_id,
                "depth": item.meta["depth"],
                "key_resident": key_blocks <= resident,
                "value_resident": value_blocks <= resident,
                "resident_blocks": len(resident),
                "correct": bool(item.correct(text)),
            }
            rows.append(row)
            print(f"{name} {item.item_id} depth {row['depth']}: key {'in' if row['key_resident'] else 'out'}, "
                  f"value {'in' if row['value_resident'] else 'out'}, {len(resident)} blocks resident, "
                  f"{'right' if row['correct'] else 'wrong'} ({text.strip()[:24]!r})", flush=True)  # fmt: skip
        for label, keep in (
            ("both", lambda r: r["key_resident"] and r["value_resident"]),
            ("value_only", lambda r: r["value_resident"] and not r["key_resident"]),
            ("value_out", lambda r: not r["value_resident"]),
        ):
            group = [r for r in rows if keep(r)]
            result[f"{name}_{label}"] = f"{sum(r['correct'] for r in group)} right of {len(group)}"
        result[f"{name}_accuracy"] = sum(r["correct"] for r in rows) / len(rows)
    report(args, result)


if __name__ == "__main__":
    main()
