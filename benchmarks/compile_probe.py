"""Would ``torch.compile`` make the CPU decode step cheaper? The engine's step with the model run eager or compiled.

    python benchmarks/compile_probe.py --modes eager,inductor,inductor-freezing --batch 16 --context 128

A decode step of a 135M model at 16 sequences spends about half its time outside the linear layers, in many small
operators (norms, rotary, residuals, attention), the kind of overhead a compiler fuses away. Each mode builds its
own engine (``full``, ``--batch`` sequences of ``--context`` prompt tokens), reads the prompts, runs 5 decode steps
to settle (compilation happens here) and times 3 rounds of ``--steps`` decode steps:

* ``eager``: the engine as it ships (oneDNN-packed linear layers, transformers' modules).
* ``inductor``: ``torch.compile(model, dynamic=True)`` over transformers' own linear layers (inductor cannot lower
  the packed oneDNN weights with dynamic shapes); confkv's attention stays eager (``torch._dynamo.disable``), since
  it reads the packed batch's Python structure.
* ``inductor-freezing``: the same with inductor's weight freezing, which packs the weights itself but makes every
  layer's weights constants of its own graph, so each layer compiles separately.

Reported: prompt-reading seconds (compilation included), the settling steps' seconds, and milliseconds per step.
"""

from __future__ import annotations

import time

import torch
from common import load, parser, read_prompts, readme_windows, report, setup
from transformers import AttentionInterface

from confkv import LLM, SamplingParams
from confkv.kv import attention


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--modes", default="eager,inductor,inductor-freezing")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    prompts = readme_windows(loaded, args.context, args.batch)
    result: dict = {**env, "batch": args.batch, "context": args.context}
    for mode in args.modes.split(","):
        # each compiled mode needs the model's own nn.Linear layers: load it afresh (the engine packs in place)
        fresh = load(args, device) if mode != "eager" else loaded
        llm = LLM(args.model, "full", loaded=fresh, max_batch_size=args.batch, kv_cache_memory="2GiB",
                  pack_weights=mode == "eager")  # fmt: skip
        engine = llm.engine
        if mode != "eager":
            import torch._inductor.config as inductor_config

            inductor_config.freezing = mode == "inductor-freezing"
            AttentionInterface.register(
                attention.ATTN_IMPLEMENTATION, torch._dynamo.disable(attention.confkv_attention)
            )
            engine.runner.model = torch.compile(engine.runner.model, dynamic=True)
        params = SamplingParams(max_tokens=10 * (5 + 3 * args.steps), ignore_eos=True)  # none finishes while timed
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{mode}-{i}", prompt, params)
        t0 = time.perf_counter()
        read_prompts(engine)
        result[f"{mode}_prompts_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(5):
            engine.step()
        result[f"{mode}_settle_s"] = time.perf_counter() - t0
        rounds = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            rounds.append((time.perf_counter() - t0) / args.steps * 1000)
        result[f"{mode}_step_ms"] = ", ".join(f"{r:.1f}" for r in rounds)
        result[f"{mode}_running"] = len(engine.scheduler.running)  # all of --batch: the steps decoded every one
        for i in range(args.batch):
            engine.abort_request(f"{mode}-{i}")
        attention.register()
        torch._dynamo.reset()
    report(args, result)


if __name__ == "__main__":
    main()
