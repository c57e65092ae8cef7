"""Time to read one long prompt under ``full`` and under evicting policies: an evicting policy must read a prompt
longer than its ``max_size`` in the engine's token-budget chunks (trimmed between chunks), not a block per step.

    python benchmarks/long_prefill.py --tokens 3000 --policies full,dynamic,streaming --repeats 2

``--kv-cache-dtypes auto,fp8`` times each policy at each pool dtype (rows ``POLICY@DTYPE``; ``auto`` keeps the bare
name), each against ``full`` at ``auto``.

One chat prompt of ``--tokens`` tokens (held-out documentation and a question) is generated to a single token;
the best of ``--repeats`` wall times is reported per policy, with its ratio to ``full``'s. The policies are the
throughput suite's (``dynamic``: base 256, max 1,024, 128 recent; fixed ones at its ``max_size``), so the prompt is
longer than what an evicting policy keeps and is trimmed between chunks; the run refuses a prompt that would fit.
"""

from __future__ import annotations

import time

from common import load, parser, report, setup

from confkv import LLM, SamplingParams
from confkv.bench.corpus import split_passage
from confkv.bench.stream_rows import stream_policies
from confkv.bench.streams import ThroughputSpec
from confkv.bench.workloads import render_chat


def long_prompt(tokenizer, tokens: int) -> list[int]:
    ids = tokenizer(split_passage(6 * tokens, 0, "heldout"), add_special_tokens=False)["input_ids"]
    shell = len(render_chat(tokenizer, [{"role": "user", "content": "Summarise this.\n\n"}]))
    text = tokenizer.decode(ids[: max(16, tokens - shell)])
    return list(render_chat(tokenizer, [{"role": "user", "content": f"Summarise this.\n\n{text}"}]))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--policies", default="full,dynamic,streaming")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-dtypes", default="auto", help="each policy at each of these pool dtypes")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    prompt = long_prompt(loaded.tokenizer, args.tokens)
    result: dict = {**env, "prompt_tokens": len(prompt), "max_num_batched_tokens": args.max_num_batched_tokens}
    one = SamplingParams(max_tokens=1)
    names = args.policies.split(",")
    policies = dict(stream_policies(names, [], ThroughputSpec()))
    dtypes = args.kv_cache_dtypes.split(",")
    rows = [(pol, dt, pol if dt == "auto" else f"{pol}@{dt}") for pol in names for dt in dtypes]  # auto: plain name
    for policy, dtype, row in rows:
        cache_policy = policies[policy]
        if cache_policy.controller != "full" and len(prompt) <= cache_policy.max_size:
            raise SystemExit(f"a {len(prompt)}-token prompt fits {policy}'s max_size {cache_policy.max_size}: "
                             "nothing would be trimmed; raise --tokens")  # fmt: skip
        result[f"{row}_max_size"] = cache_policy.max_size
        llm = LLM(args.model, cache_policy, loaded=loaded, kv_cache_memory="1GiB", kv_cache_dtype=dtype,
                  max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = llm.generate([prompt], one)[0]
            times.append(time.perf_counter() - t0)
        result[f"{row}_peak_resident_tokens"] = out.kv["peak_resident_tokens"]  # max_size plus a chunk at most
        result[f"{row}_prefill_s"] = min(times)
    for _, _, row in rows:
        if "full_prefill_s" in result:
            result[f"{row}_vs_full"] = result[f"{row}_prefill_s"] / result["full_prefill_s"]
    report(args, result)


if __name__ == "__main__":
    main()
