"""Time of one decode step with many sequences of long context, where it goes, and the page faults it takes.

    python benchmarks/decode_step.py --context 512 --batch 16 --policies full,dynamic --steps 10 --profile

``--batch`` sequences of ``--context`` prompt tokens (consecutive windows of README.md) are read, run 20 decode steps
to settle, then ``--steps`` decode steps are timed. Reported per policy: milliseconds per step, decode tokens/s,
minor page faults per step (``getrusage``: memory the C allocator handed back to the OS and faulted in again), and
with ``--profile`` the share of the step's time in the heaviest torch operators (``torch.profiler``, self CPU
time), which is what says whether the step is bound by the linear layers, the KV gather or attention.
"""

from __future__ import annotations

import resource
import time

from common import load, parser, readme_windows, report, setup, start_decoding
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from confkv import LLM, SamplingParams
from confkv.kv import attention

SETTLE_STEPS = 20


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--policies", default="full,dynamic")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="add the heaviest operators' share of the step time")
    p.add_argument("--allow-cudnn", action="store_true", help="on CUDA, let attention use cuDNN's SDPA (to compare)")
    p.add_argument("--no-pack", action="store_true", help="transformers' own linear layers, not the packed ones")
    args = p.parse_args()
    if args.allow_cudnn:
        attention.CUDA_SDPA_BACKENDS.insert(0, SDPBackend.CUDNN_ATTENTION)
    device, env = setup(args)
    loaded = load(args, device)
    prompts = readme_windows(loaded, args.context, args.batch)
    result: dict = {**env, "context": args.context, "batch": args.batch, "steps": args.steps}
    # the first sequences decode while the last ones still read their prompts (chunks of 512 tokens), and every
    # sequence must still be running through the timed and profiled steps: a limit of settle + steps finished some
    # before (an unbounded one makes ``full`` commit the model's whole context per sequence and admit fewer)
    reading = -(-args.batch * args.context // 512) + args.batch
    params = SamplingParams(max_tokens=reading + SETTLE_STEPS + 2 * args.steps + 8, ignore_eos=True)
    for policy in args.policies.split(","):
        llm = LLM(args.model, policy, loaded=loaded, max_batch_size=args.batch, kv_cache_memory="2GiB",
                  pack_weights=not args.no_pack)  # fmt: skip
        engine = llm.engine
        start_decoding(engine, prompts, params, SETTLE_STEPS)
        running = engine.scheduler.running
        made = sum(len(s.output_token_ids) for s in running)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        elapsed = time.perf_counter() - t0
        step_s = elapsed / args.steps
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / args.steps
        if len(running) != args.batch:
            raise SystemExit(f"{len(running)} of {args.batch} sequences decoding: the step is not the one asked for")
        result[f"{policy}_step_ms"] = step_s * 1000
        result[f"{policy}_decode_tokens_per_s"] = (sum(len(s.output_token_ids) for s in running) - made) / elapsed
        result[f"{policy}_minor_faults_per_step"] = faults
        if args.profile:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    engine.step()
            assert len(engine.scheduler.running) == args.batch
            ops = prof.key_averages()
            total = sum(op.self_cpu_time_total for op in ops)
            for op in sorted(ops, key=lambda o: o.self_cpu_time_total, reverse=True)[:6]:
                result[f"{policy}_share_{op.key}"] = op.self_cpu_time_total / total
        for rid in map(str, range(args.batch)):
            engine.abort_request(rid)
    report(args, result)


if __name__ == "__main__":
    main()
