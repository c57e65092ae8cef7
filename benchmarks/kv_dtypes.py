"""What each ``kv_cache_dtype`` costs: perplexity of ``full`` on the bench's prose workload and the decode step time.

    python benchmarks/kv_dtypes.py --suite quick --dtypes auto,int8,fp8,int4 --context 512 --batch 8 --steps 10

Perplexity: the prose items of ``--suite`` (held-out split, as ``confkv bench`` draws them), scored teacher-forced
under ``full`` exactly as the bench scores its prose (``Evaluator.score_workload``: each item read from its first
token, every token scored); the exp of the mean NLL over all items' tokens, and its change relative to ``auto``.
Step time: ``--batch`` sequences of ``--context`` tokens (windows of README.md) decode under ``full``; after 20
steps to settle, ``--steps`` steps are timed (as ``benchmarks/decode_step.py`` does); ``--repeats`` alternating
rounds over the dtypes, the median kept, so that a neighbour's load on a shared CPU falls on every dtype alike.
Also reported: of each step, the milliseconds spent in the pool's writes (``DTYPE_store_ms``: quantising the new
rows, and re-encoding the open blocks of int4 and fp8 keys); bytes of K and V per token and the tokens a 64 MiB pool
holds at each dtype. An entry of
``--dtypes`` may name a float window, ``DTYPE@R`` (``int4@32``: ``kv_cache_dtype: int4``, ``kv_float_window: 32``);
its perplexity run also reports the mean bytes a token held, the window's copies included
(``R_mean_bytes_per_token``: mean resident bytes plus the window's mean bytes, over the mean resident tokens,
summed over items). With ``--demote``, the
suite's scaled ``dynamic`` (as ``confkv bench`` runs it) on the same prose at ``demote_dtype`` none and each of
``--demote``: perplexity, and the KV bytes it held (mean resident, plus the demoted copies' peak) over ``full``'s.

``--jitter N`` scores every entry N more times, each with the K and V the pool is given multiplied by ``1 + e``, ``e``
drawn per element from a normal of standard deviation ``--jitter-scale`` (1e-6, seeded 1..N): far below any
format's rounding step, and of the size by which two CPUs' float32 arithmetic differs. A quantised format rounds
a few elements that lie near a step's edge the other way, the next layers see slightly different keys, and on
2,046 tokens the perplexity delta moves by tenths of a point (int4 on the quick suite read +1.61% on one CPU and
+1.19% on another, same code): a single run is one draw of the rounding, and the mark is a property of the
format, not of that draw. Reported per entry: ``DTYPE_jitter_ppl_delta_pct`` (each draw against unperturbed
``auto``), their mean and its 95% t-interval (``_mean``, ``_ci95``), min and max; ``auto``'s draws are the control
(a float pool rounds nothing, so they should stay within float noise of zero).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from common import load, parser, readme_windows, report, setup, start_decoding

from confkv import LLM, SamplingParams
from confkv.bench.evaluator import build_workloads
from confkv.bench.intervals import t_interval
from confkv.bench.specs import scaled_dynamic, suite_spec
from confkv.errors import ConfkvError

SETTLE_STEPS = 20
POOL = 64 << 20


def split_entry(entry: str) -> tuple[str, int]:
    """``DTYPE[@R]`` -> the ``kv_cache_dtype`` and the ``kv_float_window`` (0 without ``@``)."""
    dtype, _, window = entry.partition("@")
    return dtype, int(window or 0)


def jittered(store: Callable, seed: int, scale: float) -> Callable:
    """``store`` (a pool's, bound or not: its last two arguments K and V) given K and V each multiplied by ``1 + e``,
    ``e ~ N(0, scale)`` per element from a generator seeded ``seed``: one more draw of what the pool's rounding
    does with nearly the same input."""
    gens: dict[torch.device, torch.Generator] = {}

    def noisy(x: torch.Tensor) -> torch.Tensor:
        gen = gens.setdefault(x.device, torch.Generator(x.device).manual_seed(seed))
        e = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32)
        return (x.float() * e.mul_(scale).add_(1.0)).to(x.dtype)

    def store_(*args) -> None:
        *head, k, v = args
        store(*head, noisy(k), noisy(v))

    return store_


def scored(args, loaded, dtype: str, items: list, policy="full", window: int = 0, jitter_seed: int = 0) -> list:
    """Every item scored teacher-forced, as the bench scores its prose (``ScoreResult`` each). The pool is
    ``--kv-cache-memory`` where the caller's parser has it (``int4_ablation.py``'s keeps 64 MiB); with
    ``jitter_seed`` its writes are perturbed (``jittered``, ``--jitter-scale``)."""
    memory = getattr(args, "kv_cache_memory", POOL)
    llm = LLM(args.model, policy, loaded=loaded, kv_cache_dtype=dtype, kv_cache_memory=memory,
              kv_float_window=window)  # fmt: skip
    if jitter_seed:
        pool = llm.engine.pool
        pool.store = jittered(pool.store, jitter_seed, args.jitter_scale)  # the instance's: what attention calls
    return llm.score([list(it.prompt_ids) for it in items], [max(1, it.score_from or 1) for it in items])


def perplexity(args, loaded, dtype: str, items: list, policy="full", results: list | None = None):
    """Perplexity over every scored token, their count, the mean resident KV bytes (summed over items) and the
    demoted copies' peak bytes (summed over items); of ``results`` when given, else of a run of ``scored``."""
    results = results if results is not None else scored(args, loaded, dtype, items, policy)
    nll = [float(-lp) for r in results for lp in r.token_logprobs]
    resident = sum(r.kv["mean_resident_bytes"] for r in results)
    return math.exp(sum(nll) / len(nll)), len(nll), resident, sum(r.kv["demoted_peak_bytes"] for r in results)


def mean_bytes_per_token(kvs: list[dict]) -> float:
    """Mean bytes a resident token held, the float window's copies included (summed over items)."""
    held = sum(kv["mean_resident_bytes"] + kv["float_window_mean_bytes"] for kv in kvs)
    return held / sum(kv["mean_resident_tokens"] for kv in kvs)


def decoding_engine(args, loaded, dtype: str, prompts: list[list[int]], window: int = 0):
    """A ``full`` engine at ``dtype`` with ``--batch`` sequences read and ``SETTLE_STEPS`` decode steps taken, with
    room left for ``--steps`` more: the step both this script and ``kv_dtype_profile.py`` measure."""
    reading = -(-args.batch * args.context // 512) + args.batch
    params = SamplingParams(max_tokens=reading + SETTLE_STEPS + args.steps + 8, ignore_eos=True)
    llm = LLM(args.model, "full", loaded=loaded, max_batch_size=args.batch, kv_cache_memory="1GiB",
              kv_cache_dtype=dtype, kv_float_window=window)  # fmt: skip
    start_decoding(llm.engine, prompts, params, SETTLE_STEPS)
    return llm.engine


def step_ms(args, loaded, entry: str, prompts: list[list[int]]) -> tuple[float, float]:
    """Milliseconds a decode step, and of those the pool's writes (``BlockPool.store``, every layer: quantising the
    new rows, and re-encoding open blocks where keys are coded a block at a time)."""
    dtype, window = split_entry(entry)
    engine = decoding_engine(args, loaded, dtype, prompts, window)
    pool, spent = engine.pool, [0.0]
    store = pool.store

    def timed_store(*a, **kw) -> None:
        t = time.perf_counter()
        store(*a, **kw)
        spent[0] += time.perf_counter() - t

    pool.store = timed_store  # the instance's own attribute: what attention calls
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    del pool.store
    if len(engine.scheduler.running) != args.batch:
        raise SystemExit("a sequence finished during the timed steps: the step is not the one asked for")
    for i in range(args.batch):
        engine.abort_request(str(i))
    return elapsed / args.steps * 1000, spent[0] / args.steps * 1000


def jitter_args(p) -> None:
    """``--jitter`` and ``--jitter-scale`` (this script's, and the fake quantisation scripts' ``run_ablation``)."""
    p.add_argument("--jitter", type=int, default=0, help="N more draws of each entry, the pool's writes perturbed")
    p.add_argument("--jitter-scale", type=float, default=1e-6, help="relative size of the perturbation")


def jitter_draws(args, loaded, dtypes: list[str], items: list, result: dict) -> None:
    """``--jitter`` draws of every entry's perplexity delta against unperturbed ``auto`` (``result["auto_ppl"]``),
    with their mean, its 95% t-interval, min and max."""
    for entry in dtypes:
        kv_dtype, window = split_entry(entry)
        deltas = []
        for seed in range(1, args.jitter + 1):
            runs = scored(args, loaded, kv_dtype, items, window=window, jitter_seed=seed)
            deltas.append(100 * (perplexity(args, loaded, kv_dtype, items, results=runs)[0] / result["auto_ppl"] - 1))
        result.update(draw_summary(entry, deltas))


def draw_summary(name: str, deltas: list[float]) -> dict:
    """``NAME_jitter_ppl_delta_pct`` (the draws) with their mean, its 95% t-interval, min and max: what every
    script with ``--jitter`` reports."""
    key = f"{name}_jitter_ppl_delta_pct"
    return {key: deltas, f"{key}_mean": statistics.fmean(deltas), f"{key}_ci95": t_interval(deltas),
            f"{key}_min": min(deltas), f"{key}_max": max(deltas)}  # fmt: skip


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--suite", default="quick", choices=("quick", "standard"))
    p.add_argument("--dtypes", default="auto,int8,fp8,int4")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-ppl", action="store_true")
    p.add_argument("--no-step", action="store_true")
    p.add_argument(
        "--kv-cache-memory", default="64MiB", help="each scoring engine's pool (the standard suite's texts: 1GiB)"
    )
    p.add_argument("--demote", default="", help="also dynamic at these demote_dtypes (int4,int2) and none")
    jitter_args(p)
    args = p.parse_args()
    dtypes = args.dtypes.split(",")
    if args.jitter and not args.no_ppl and "auto" not in dtypes:
        p.error("--jitter measures deltas against auto: list auto in --dtypes")
    device, env = setup(args)
    loaded = load(args, device)
    result: dict = {**env, "suite": args.suite, "context": args.context, "batch": args.batch, "steps": args.steps}
    t_start = time.perf_counter()
    for entry in dtypes:
        llm = LLM(args.model, "full", loaded=loaded, kv_cache_dtype=split_entry(entry)[0], kv_cache_memory=POOL)
        result[f"{entry}_bytes_per_token"] = llm.engine.pool.bytes_per_token
        result[f"{entry}_tokens_in_64MiB"] = llm.engine.pool.num_tokens
    if not args.no_ppl:
        items = build_workloads(loaded.tokenizer, suite_spec(args.model, args.suite), "heldout", 0).prose
        # KV bytes against full at auto: mean resident bytes over full's, and demoted peak bytes over full's peak
        base_resident = base_peak = None
        for dtype in dtypes:
            kv_dtype, window = split_entry(dtype)
            try:
                runs = scored(args, loaded, kv_dtype, items, window=window)
            except ConfkvError as e:  # the suite's texts need more than the pool: say so, not a traceback
                p.error(f"--kv-cache-memory {args.kv_cache_memory}: {e}")
            ppl, n, resident, _ = perplexity(args, loaded, kv_dtype, items, results=runs)
            result[f"{dtype}_ppl"] = ppl
            result[f"{dtype}_mean_bytes_per_token"] = mean_bytes_per_token([r.kv for r in runs])
            result["ppl_tokens"] = n
            if dtype == "auto":
                base_resident = resident
                base_peak = sum(len(it.prompt_ids) for it in items) * result["auto_bytes_per_token"]
            if base_resident:
                result[f"{dtype}_mean_kv_bytes_vs_full_auto"] = resident / base_resident
        if args.jitter:
            jitter_draws(args, loaded, dtypes, items, result)
        dynamic = scaled_dynamic(suite_spec(args.model, args.suite).scale)
        for demote in ["none", *filter(None, args.demote.split(","))]:
            ppl, _, resident, demoted = perplexity(args, loaded, "auto", items, dynamic.replace(demote_dtype=demote))
            result[f"dynamic_demote_{demote}_ppl"] = ppl
            if base_resident:
                result[f"dynamic_demote_{demote}_ppl_delta_pct"] = 100 * (ppl / result["auto_ppl"] - 1)
                result[f"dynamic_demote_{demote}_mean_resident_bytes_vs_full_auto"] = resident / base_resident
                result[f"dynamic_demote_{demote}_demoted_peak_bytes_vs_full_auto_peak"] = demoted / base_peak
        base = result.get("auto_ppl")
        for dtype in dtypes:
            if base:
                result[f"{dtype}_ppl_delta_pct"] = 100 * (result[f"{dtype}_ppl"] / base - 1)
    if not args.no_step:
        prompts = readme_windows(loaded, args.context, args.batch)
        times: dict[str, list[float]] = {d: [] for d in dtypes}
        stores: dict[str, list[float]] = {d: [] for d in dtypes}
        for _ in range(args.repeats):
            for dtype in dtypes:
                step, store = step_ms(args, loaded, dtype, prompts)
                times[dtype].append(step)
                stores[dtype].append(store)
        for dtype in dtypes:
            result[f"{dtype}_step_ms"] = statistics.median(times[dtype])
            result[f"{dtype}_store_ms"] = statistics.median(stores[dtype])
            if "auto" in times:
                result[f"{dtype}_step_vs_auto"] = result[f"{dtype}_step_ms"] / statistics.median(times["auto"])
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    report(args, result)


if __name__ == "__main__":
    main()
