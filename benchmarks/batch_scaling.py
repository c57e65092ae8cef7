"""Decode throughput against the number of sequences running at once, under ``full`` with a pool large enough
for all of them: whether saved KV memory (more sequences per pool) can turn into tokens per second on this device.

    python benchmarks/batch_scaling.py --batches 1,4,16,32 --requests 32 --max-tokens 64

The same ``--requests`` short chat prompts run to ``--max-tokens`` tokens each (EOS ignored) with
``max_batch_size`` set to each value of ``--batches``; generated tokens over wall time is reported per batch size.
"""

from __future__ import annotations

import time

from common import PROMPTS, chat_ids, load, parser, report, setup

from confkv import LLM, SamplingParams


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--policy", default="full")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    prompts = [chat_ids(loaded, PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    result: dict = {**env, "policy": args.policy, "requests": args.requests, "max_tokens": args.max_tokens,
                    "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts)}  # fmt: skip
    LLM(args.model, args.policy, loaded=loaded, max_batch_size=4).generate(prompts[:4], SamplingParams(max_tokens=4))
    for batch in (int(b) for b in args.batches.split(",")):
        llm = LLM(args.model, args.policy, loaded=loaded, max_batch_size=batch, kv_cache_memory="2GiB")
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        result[f"batch_{batch}_tokens_per_s"] = sum(o.generated_tokens for o in outs) / elapsed
    report(args, result)


if __name__ == "__main__":
    main()
