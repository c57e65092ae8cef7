"""The confidence signals' share of a decode step.

    python benchmarks/confidence_cost.py --batch 8 --context 512 --steps 50

Runs ``--batch`` sequences of about ``--context`` tokens through the engine under ``full``, then times
``--steps`` decode steps (whole ``LLMEngine.step`` calls) and, separately, ``confidence_signals`` on logits of
the same shape. The signals run inside the step, so their share is the second time over the first.
"""

from __future__ import annotations

import time

import torch
from common import load, parser, report, setup

from confkv import LLM, SamplingParams
from confkv.confidence import confidence_signals


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--policy", default="full")
    args = p.parse_args()
    device, env = setup(args)
    llm = LLM(args.model, args.policy, loaded=load(args, device), max_batch_size=args.batch, device=args.device)
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 10, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(100, vocab - 100, (args.context,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    while any(len(s.output_token_ids) == 0 for s in engine._seqs.values()):
        engine.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - t0) / args.steps

    logits = torch.randn(args.batch, vocab, device=device, dtype=engine.model.dtype) * 4
    for _ in range(5):
        confidence_signals(logits).stacked().tolist()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        confidence_signals(logits).stacked().tolist()  # includes the one host transfer the engine makes
    sync()
    signals_s = (time.perf_counter() - t0) / args.steps
    report(
        args,
        {
            **env,
            "policy": args.policy,
            "batch": args.batch,
            "context": args.context,
            "vocab": vocab,
            "decode_step_ms": step_s * 1e3,
            "signals_ms": signals_s * 1e3,
            "signals_share_of_step": signals_s / step_s,
        },
    )


if __name__ == "__main__":
    main()
