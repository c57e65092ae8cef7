"""Engine throughput against Hugging Face ``generate`` on the same prompts, greedy, same batch size.

    python benchmarks/throughput.py --batch 8 --max-tokens 128 [--policies full,dynamic]

Both sides generate exactly ``--max-tokens`` tokens per prompt (EOS ignored). Hugging Face runs the prompts as
one left-padded batch with its dynamic cache (SDPA attention); the engine runs them through continuous batching.
Each side runs once untimed first (warm-up), then ``--repeats`` timed runs, interleaved; the best is reported.
"""

from __future__ import annotations

import time

import torch
from common import PROMPTS, chat_ids, load, parser, report, setup

from confkv import LLM, SamplingParams


def hf_generate(loaded, prompts: list[list[int]], max_tokens: int) -> float:
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=loaded.model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=loaded.model.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = loaded.model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            pad_token_id=pad,
        )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert out.shape[1] - width == max_tokens
    return elapsed


def engine_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policies", default="full", help="comma-separated engine policies to time")
    args = p.parse_args()
    device, env = setup(args)
    reference = load(args, device)
    prompts = [chat_ids(reference, PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]
    total = args.batch * args.max_tokens
    result: dict = {**env, "batch": args.batch, "max_tokens": args.max_tokens,
                    "prompt_tokens": sum(len(x) for x in prompts)}  # fmt: skip

    llms = {
        name: LLM(args.model, name, loaded=load(args, device), max_batch_size=args.batch, device=args.device)
        for name in args.policies.split(",")
    }
    hf_generate(reference, prompts[:2], 4)
    for llm in llms.values():
        engine_generate(llm, prompts[:2], 4)
    # interleaved repeats, best of each: drift in machine speed hits both sides alike
    times: dict[str, list[float]] = {"hf": [], **{name: [] for name in llms}}
    for _ in range(args.repeats):
        times["hf"].append(hf_generate(reference, prompts, args.max_tokens))
        for name, llm in llms.items():
            times[name].append(engine_generate(llm, prompts, args.max_tokens)[0])
    hf_s = min(times["hf"])
    result["hf_generate_s"] = hf_s
    result["hf_tokens_per_s"] = total / hf_s
    for name in llms:
        best = min(times[name])
        result[f"{name}_s"] = best
        result[f"{name}_tokens_per_s"] = total / best
        result[f"{name}_speedup_vs_hf"] = hf_s / best
    report(args, result)


if __name__ == "__main__":
    main()
