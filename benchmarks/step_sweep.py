"""How a decode step's cost grows with the sequences in it and their context: the measurement behind the
long-generation headline (issue 34), where a policy that holds less KV can only serve more requests/s if a step over
more sequences costs less per sequence.

    python benchmarks/step_sweep.py --contexts 192,384,768 --batches 1,2,4,8,16 --steps 8

For each context length C and batch size B (``readme_windows``: B distinct windows of README.md, C tokens each),
the B prompts are read, ``--settle`` decode steps taken, then ``--steps`` decode steps timed (``common.start_decoding``,
as ``decode_step.py`` does for one point). Reported per point: milliseconds per step, per sequence, and decode
tokens/s. Then one least-squares fit over the grid, step = fixed + B x (per_seq + per_key x C): ``fixed`` is what a
step costs whatever runs in it (the weights read once), the other two grow with the batch. From the fit, at each
context: how many times batch 4's tokens/s an unbounded batch could give, ``(fixed / 4 + per_seq + per_key x C) /
(per_seq + per_key x C)``: the most that admitting more sequences (what saved memory buys) can add on this device.
"""

from __future__ import annotations

import time

import numpy as np
from common import load, parser, readme_windows, report, setup, start_decoding

from confkv import LLM, SamplingParams


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--contexts", default="192,384,768", help="prompt tokens per sequence (comma-separated)")
    p.add_argument("--batches", default="1,2,4,8,16", help="sequences decoding at once (comma-separated)")
    p.add_argument("--policy", default="full")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per point")
    p.add_argument("--settle", type=int, default=4, help="decode steps taken before the timed ones")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if min(contexts + batches) < 1 or args.steps < 1 or args.settle < 0:
        raise SystemExit("--contexts, --batches and --steps take positive numbers, --settle one of at least 0")
    device, env = setup(args)
    loaded = load(args, device)
    result: dict = {**env, "policy": args.policy, "steps": args.steps, "points": []}
    warm = readme_windows(loaded, min(contexts), 2)  # first calls (allocator, kernels) are not the first point's
    LLM(args.model, args.policy, loaded=loaded, max_batch_size=2).generate(warm, SamplingParams(max_tokens=8))
    t_start = time.perf_counter()
    for context in contexts:
        prompts = readme_windows(loaded, context, max(batches))
        for batch in batches:
            reading = -(-batch * context // 512) + batch  # steps that read prompts (chunks of 512)
            params = SamplingParams(max_tokens=reading + args.settle + args.steps + 8, ignore_eos=True)
            llm = LLM(args.model, args.policy, loaded=loaded, max_batch_size=batch, kv_cache_memory="2GiB")
            engine = llm.engine
            start_decoding(engine, prompts[:batch], params, args.settle)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            step_s = (time.perf_counter() - t0) / args.steps
            if len(engine.scheduler.running) != batch:
                raise SystemExit(f"{len(engine.scheduler.running)} of {batch} sequences decoding at C={context}")
            ms = 1000 * step_s
            result["points"].append(
                {"context": context, "batch": batch, "step_ms": ms, "ms_per_sequence": ms / batch,
                 "tokens_per_s": batch / step_s}
            )  # fmt: skip
            for rid in map(str, range(batch)):
                engine.abort_request(rid)
    pts = result["points"]
    design = np.array([[1.0, pt["batch"], pt["batch"] * pt["context"]] for pt in pts])
    step = np.array([pt["step_ms"] for pt in pts])
    (fixed, per_seq, per_key), *_ = np.linalg.lstsq(design, step, rcond=None)
    fitted = design @ np.array([fixed, per_seq, per_key])
    result["fit_ms"] = {"fixed": float(fixed), "per_sequence": float(per_seq), "per_key": float(per_key),
                        "max_relative_error": float(np.max(np.abs(fitted - step) / step))}  # fmt: skip
    per = {c: per_seq + per_key * c for c in contexts}  # what one more sequence adds to a step
    result["unbounded_batch_vs_batch_4"] = {
        str(c): float((fixed / 4 + per[c]) / per[c]) if per[c] > 0 else None for c in contexts
    }
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        report(args, result)
        return
    print(f"{'context':>8} {'batch':>6} {'step ms':>9} {'ms/seq':>8} {'tok/s':>8}")
    for pt in pts:
        print(f"{pt['context']:>8} {pt['batch']:>6} {pt['step_ms']:>9.1f} {pt['ms_per_sequence']:>8.1f} "
              f"{pt['tokens_per_s']:>8.1f}")  # fmt: skip
    report(args, {k: v for k, v in result.items() if k != "points"})


if __name__ == "__main__":
    main()
