"""``dynamic`` with ``demote_dtype`` against the fixed baselines at the same KV bytes: perplexity and pass keys.

    python benchmarks/demote_bytes.py --pool-dtype int8 --demote int4 --baseline-dtypes int8,auto

Bytes are counted against ``full`` at ``auto`` (the model's dtype), two ways, each summed over a workload's items:
``peak``: the peak resident bytes (at the pool's ``kv_cache_dtype``) plus the peak of the demoted copies, over
``full``'s bytes at ``auto`` (every token, float); ``mean``: the mean resident bytes plus the demoted copies' peak,
over ``full@auto``'s mean resident bytes (a teacher-forced text grows, so full's mean is about half its peak).

Workloads: the prose items of ``--suite`` (held-out split, scored teacher-forced as ``confkv bench`` scores its
prose; perplexity over every token) and pass-key prompts (``confkv.bench.passkey``, ``--length`` tokens, the key at
each of ``--depths`` for each of ``--seeds`` in each haystack of ``--filler``: ``repeat`` (the default), where the
key stands out, and ``prose``, documentation text of the ``--key-split`` topics, where it reads like its
surroundings; 8 tokens generated greedily; an answer is right when it contains the key, and "as full" counts the
items where it is right exactly where ``full``'s is).

``confkv bench --policies full,dynamic:int8:demote=int4,window,...`` measures the same rows in the suite, with the
baselines matched on mean bytes per measure (``confkv.bench.suite``); this script keeps the peak-bytes matching and
baselines at a dtype other than the pool's.

Rows: ``full`` at ``auto`` and at the pool dtype; the suite's scaled ``dynamic`` (sizes times ``--scale``) at the pool
dtype, evicting and with ``--demote``; then each of ``--baselines`` at each of ``--baseline-dtypes``, with a token
budget that buys, at that dtype, the peak bytes the demoting ``dynamic`` held on that workload: the memory one must
provision for it. ``--match budget`` makes that the baseline's budget (rounded up to a block), although a fixed
policy holds more than its budget while it reads a step: the prompt chunk on the pass keys, a forced chunk of
``compact_interval`` tokens on the prose. ``--match peak`` subtracts that step from the budget (rounded down to a
block), so the baseline's own peak does not exceed the demoting run's.

``--max-num-batched-tokens`` is the engine's tokens per step (``LLM(max_num_batched_tokens=...)``, default 512), the
same for every row: a pass-key prompt is read in chunks of at most that many tokens, and an evicting policy holds its
``max_size`` plus one chunk before it trims, which is part of every row's peak. Prose is scored from its first token
(forced chunks of ``compact_interval``), so its peak does not depend on it.

``--baseline-token-shares 0.25,0.42,...`` measures the baselines against the share of the text they keep instead:
each baseline's budget is that share of the workload's mean tokens (rounded to a block), no ``dynamic`` row runs, and
the rows are named ``NAME@DTYPE/SHARE``. It answers where a fixed baseline at a dtype starts to lose to dropping
text, which is where demotion at the same bytes can be ahead of it. ``--workloads prose`` skips the pass keys.

``--prose-n N`` draws N held-out prose items at the suite's prose length instead of the suite's count, through the
suite's own code, skipping draws that share more text with a kept item than the suite's own items share with each
other (``confkv.bench.prose_draw``); ``--prose-items`` still takes the first ones of those.

Paired comparison (``paired`` in the JSON, a table after the report): each row keeps its per-item prose sums and
per-key answers, and is paired with the demoting row on the same items (``confkv.bench.paired``): its perplexity
minus demotion's in points of ``full@auto``'s, with a 95% bootstrap interval over the prose items, and the keys it
answers that demotion does not and the reverse with the exact McNemar p-value of that split, and a verdict on each
measure and over both (ahead when ahead on one and behind on none).

``--int2-value-group`` sets the channels per value group of ``int2`` copies
(``confkv.kv.demoted.INT2_VALUE_GROUP``), to choose it by measurement.
"""

from __future__ import annotations

import math
import time

from common import load, parser, report, setup

from confkv import LLM, SamplingParams
from confkv.bench.memory import token_bytes
from confkv.bench.paired import item_sums, pair_rows, paired_table
from confkv.bench.passkey import passkey_item
from confkv.bench.prose_draw import draw_prose, max_overlap
from confkv.bench.specs import baseline_policy, scaled_dynamic, suite_spec
from confkv.bench.workloads import PASSKEY_FILLERS
from confkv.kv import demoted


def held(outs, auto_bpt: int) -> dict[str, float]:
    """Peak bytes held (resident plus demoted copies) over full's at auto (every token), and the mean resident
    bytes plus the demoted peak, summed over the items (divided by full@auto's mean by the caller)."""
    full = sum(o.kv["full_tokens"] for o in outs) * auto_bpt
    return {
        "peak": sum(o.kv["peak_resident_bytes"] + o.kv["demoted_peak_bytes"] for o in outs) / full,
        "mean": sum(o.kv["mean_resident_bytes"] + o.kv["demoted_peak_bytes"] for o in outs),
    }


def key_id(filler: str, depth: str, seed: str) -> str:
    """A key's name in the JSON: depth/seed for the repeated haystack (as before fillers were chosen), with the
    filler in front for any other."""
    return f"{depth}/{seed}" if filler == "repeat" else f"{filler}/{depth}/{seed}"


def share_budget(share: float, tokens: float, block_size: int) -> int:
    """A budget of ``share`` of a workload's ``tokens``, to the nearest block (at least two blocks, as the matched
    budgets are)."""
    if not 0 < share <= 1:
        raise ValueError(f"a share of the text is in (0, 1], not {share}")
    return max(2 * block_size, round(share * tokens / block_size) * block_size)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--suite", default="quick", choices=("quick", "standard"))
    p.add_argument("--pool-dtype", default="int8")
    p.add_argument("--demote", default="int4")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the scaled dynamic's sizes")
    p.add_argument("--baselines", default="window,streaming,h2o,snapkv")
    p.add_argument("--baseline-dtypes", default="int8,auto")
    p.add_argument("--length", type=int, default=1500)
    p.add_argument("--depths", default="0.1,0.5")
    p.add_argument("--seeds", default="11,12")
    p.add_argument(
        "--filler",
        default="repeat",
        help="comma-separated pass-key haystacks: repeat (the key stands out), prose (it reads like its text)",
    )
    p.add_argument(
        "--key-split",
        default="heldout",
        choices=("heldout", "train"),
        help="the documentation topics of prose haystacks",
    )
    p.add_argument("--prose-items", type=int, default=None, help="at most this many of the suite's prose items")
    p.add_argument(
        "--prose-n", type=int, default=None, help="draw this many held-out prose items (default: the suite's count)"
    )
    p.add_argument("--kv-cache-memory", default="256MiB", help="each engine's pool (long texts: room for all at once)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the engine's tokens per step, every row")
    p.add_argument(
        "--match",
        choices=("budget", "peak"),
        default="budget",
        help="baseline budget: the demoting run's peak bytes, or that less the step read over the budget",
    )
    p.add_argument(
        "--baseline-token-shares",
        default="",
        help="comma-separated shares of the text: each baseline at each share of the mean tokens (no dynamic rows)",
    )
    p.add_argument("--workloads", default="prose,passkey", help="comma-separated: prose, passkey")
    p.add_argument(
        "--int2-value-group",
        type=int,
        default=demoted.INT2_VALUE_GROUP,
        help="channels per value group of int2 demoted copies (a measurement aid: the engine's is INT2_VALUE_GROUP)",
    )
    args = p.parse_args()
    demoted.INT2_VALUE_GROUP = args.int2_value_group  # read as each engine makes its int2 format
    workloads = tuple(w for w in args.workloads.split(",") if w)
    if not workloads or set(workloads) - {"prose", "passkey"}:
        p.error(f"--workloads: prose and/or passkey, not {args.workloads!r}")
    shares = [float(x) for x in args.baseline_token_shares.split(",") if x]
    fillers = [f for f in args.filler.split(",") if f]
    if not fillers or set(fillers) - set(PASSKEY_FILLERS):
        p.error(f"--filler: one or more of {', '.join(PASSKEY_FILLERS)}, not {args.filler!r}")
    device, env = setup(args)
    loaded = load(args, device)
    t_start = time.perf_counter()
    spec = suite_spec(args.model, args.suite)
    try:
        drawn, overlap_limit = draw_prose(loaded.tokenizer, spec, args.prose_n or spec.prose["n"])
    except ValueError as e:  # the split has too little distinct text for --prose-n at this length
        p.error(f"--prose-n: {e}")
    prose = drawn[: args.prose_items]
    key_ids = [(f, d, s) for f in fillers for d in args.depths.split(",") for s in args.seeds.split(",")
               if "passkey" in workloads]  # fmt: skip
    keys = [passkey_item(loaded.tokenizer, args.length, float(d), int(s), filler=f,
                         split=args.key_split if f == "prose" else None) for f, d, s in key_ids]  # fmt: skip
    dynamic = scaled_dynamic(spec.scale * args.scale)
    bs = dynamic.block_size
    auto_bpt = token_bytes(loaded, "auto", bs)
    result: dict = {**env, "suite": args.suite, "prose_items": len(prose), "passkey_items": len(keys),
                    "prose_item_ids": [it.item_id for it in prose], "prose_overlap_max": max_overlap(prose),
                    "prose_overlap_limit": overlap_limit, "passkey_item_ids": [key_id(*k) for k in key_ids],
                    "passkey_key_split": args.key_split,
                    "passkey_length": args.length, "max_num_batched_tokens": args.max_num_batched_tokens,
                    "match": args.match, "int2_value_group": demoted.INT2_VALUE_GROUP,
                    "dynamic": {k: getattr(dynamic, k) for k in ("base_size", "max_size", "min_recent")}}  # fmt: skip
    full_right: dict[str, list[bool]] = {}  # full@auto's answers, the first run's
    full_mean: dict[str, float] = {}  # full@auto's mean resident bytes per workload

    def run(name: str, policy, kv_cache_dtype: str, workloads: tuple[str, ...] = workloads) -> dict:
        llm = LLM(args.model, policy, loaded=loaded, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
        row: dict = result.setdefault(name, {"kv_cache_dtype": kv_cache_dtype})
        row["max_num_batched_tokens"] = llm.engine.scheduler.max_num_batched_tokens  # what the engine was given
        if "prose" in workloads:
            scored = llm.score([list(it.prompt_ids) for it in prose], [max(1, it.score_from or 1) for it in prose])
            row["prose_nll"], row["prose_tokens"] = item_sums([r.token_logprobs for r in scored])
            row["ppl"] = math.exp(sum(row["prose_nll"]) / sum(row["prose_tokens"]))
            if name != "full@auto":
                row["ppl_delta_pct"] = 100 * (row["ppl"] / result["full@auto"]["ppl"] - 1)
            h = held(scored, auto_bpt)
            full_mean.setdefault("prose", h["mean"])
            row["prose_peak_bytes_vs_full_auto"] = h["peak"]
            row["prose_mean_bytes_vs_full_auto"] = h["mean"] / full_mean["prose"]
            row["mean_prose_tokens"] = sum(r.kv["full_tokens"] for r in scored) / len(scored)
        if "passkey" in workloads:
            answers = llm.generate([it.prompt for it in keys], SamplingParams(max_tokens=8))
            right = [it.correct(o.text) for it, o in zip(keys, answers, strict=True)]
            full_right.setdefault("right", right)
            row["passkey_items"] = right
            row["passkey_right"] = sum(right)
            row["passkey_as_full"] = sum(a == b for a, b in zip(right, full_right["right"], strict=True))
            h = held(answers, auto_bpt)
            full_mean.setdefault("passkey", h["mean"])
            row["passkey_peak_bytes_vs_full_auto"] = h["peak"]
            row["passkey_mean_bytes_vs_full_auto"] = h["mean"] / full_mean["passkey"]
            row["mean_passkey_tokens"] = sum(o.kv["full_tokens"] for o in answers) / len(answers)
        return row

    run("full@auto", "full", "auto")
    if args.pool_dtype != "auto":
        run(f"full@{args.pool_dtype}", "full", args.pool_dtype)
    if shares:  # the baselines against the share of the text they keep
        for dtype in filter(None, args.baseline_dtypes.split(",")):
            for share in shares:
                for name in filter(None, args.baselines.split(",")):
                    for workload in workloads:
                        tokens = result["full@auto"][f"mean_{workload}_tokens"]
                        budget = share_budget(share, tokens, bs)
                        row = run(f"{name}@{dtype}/{share:g}", baseline_policy(dynamic, name, budget), dtype,
                                  (workload,))  # fmt: skip
                        row[f"{workload}_budget_tokens"] = budget
                        row[f"{workload}_budget_share"] = budget / tokens
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        report(args, result)
        return
    run(f"dynamic@{args.pool_dtype}", dynamic, args.pool_dtype)
    demoting_name = f"dynamic+{args.demote}@{args.pool_dtype}"
    demoting = run(demoting_name, dynamic.replace(demote_dtype=args.demote), args.pool_dtype)
    for dtype in filter(None, args.baseline_dtypes.split(",")):
        bpt = token_bytes(loaded, dtype, bs)
        budgets = {}
        step = {"prose": dynamic.compact_interval, "passkey": args.max_num_batched_tokens}  # read over the budget
        for workload in workloads:
            held_peak = demoting[f"{workload}_peak_bytes_vs_full_auto"] * demoting[f"mean_{workload}_tokens"] * auto_bpt
            tokens = held_peak / bpt
            if args.match == "peak":
                budgets[workload] = max(2 * bs, math.floor((tokens - step[workload]) / bs) * bs)
            else:
                budgets[workload] = max(2 * bs, math.ceil(tokens / bs) * bs)
        for name in filter(None, args.baselines.split(",")):
            for workload, budget in budgets.items():  # each workload its own budget, so its own engine
                row = run(f"{name}@{dtype}", baseline_policy(dynamic, name, budget), dtype, (workload,))
                row[f"{workload}_budget_tokens"] = budget
    rows = {k: v for k, v in result.items() if isinstance(v, dict) and "kv_cache_dtype" in v}
    result["paired"] = {"against": demoting_name, "rows": pair_rows(rows, demoting_name)}
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    report(args, result)
    if not args.json:
        print(paired_table(result["paired"]["rows"], demoting_name))


if __name__ == "__main__":
    main()
