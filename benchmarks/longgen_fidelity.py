"""Quality on the long-generation stream, measured on ``full``'s own answers (issue 34, item 4a/4b).

``full`` answers the throughput suite's long-generation requests (greedy, ``ignore_eos``); each policy then reads
those answers back teacher-forced through its own cache (``confkv.scoring``, the tuner's path): the mean KL from
``full``'s next-token distribution (its top-32, ``scoring.kl_from_topk``) and the share of tokens whose top-1 is
``full``'s token. Unlike text overlap, these cannot drift apart at a near-tie: every position sees the same
context. Each policy's own free answers are also scored against ``full``'s with BLEU-4 (sacrebleu) and ROUGE-L.
Every figure has a 95% bootstrap interval over requests (1,000 resamples). The mean resident KV is what each policy
held while scoring, as a share of what ``full`` holds, in tokens and in bytes (at the row's KV dtype against
``full``'s at the model's dtype). A row may name its pool's dtype as the throughput suite's do
(``--policies snapkv@128:int8``, ``--policy-file rule.yaml:int8``); ``full:int8`` is then a row of its own.
``--paired-against ROW[,ROW...]`` adds each other row's KL minus that row's, resampling the same requests for both
(a paired bootstrap): two rows whose own intervals overlap can still differ on every request, and the
difference's interval says whether one is worse. ``--noise-floor DTYPE`` adds ``full`` itself with the weights and
KV in another dtype (row ``full@DTYPE``): what the same figures read when only the order and precision of the
arithmetic change, the floor under which no policy's text can be told from ``full``'s.

    .venv/bin/python benchmarks/longgen_fidelity.py --requests 8 --output-tokens 256,512 --policies dynamic,window
    .venv/bin/python benchmarks/longgen_fidelity.py --policies full:int8,snapkv@128:int8 --policy-file rule.yaml:int8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
import torch

from confkv import LLM, SamplingParams
from confkv.bench.reference import build_references
from confkv.bench.stream_rows import is_reference, stream_rows
from confkv.bench.streams import LONGGEN_CPU, make_longgen_requests
from confkv.bench.textmetrics import bleu4, rouge_l
from confkv.bench.throughput import auto_bytes_per_token
from confkv.errors import ConfkvError
from confkv.model_loader import load_model
from confkv.scoring import ScoreItem, Scorer

RESAMPLES = 1000


def interval(values: list[float], stat, seed: int = 0) -> tuple[float, float, float]:
    """``stat`` over all requests and its 95% bootstrap interval over requests."""
    rng = np.random.default_rng(seed)
    idx = np.arange(len(values))
    draws = [stat(rng.choice(idx, size=len(idx), replace=True)) for _ in range(RESAMPLES)]
    return float(stat(idx)), float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def bytes_share(res, auto_per_token: float) -> float:
    """An item's resident bytes over ``full``'s at the model's dtype: its resident tokens at the pool's dtype, plus
    its demoted copies (their peak) and float window's copies (their mean) over the item's mean full length."""
    full_bytes = float(res.full.double().mean()) * auto_per_token
    extra = float(res.kv.get("demoted_peak_bytes") or 0) + float(res.kv.get("float_window_mean_bytes") or 0)
    return res.kv_fraction * float(res.kv["bytes_per_token"]) / auto_per_token + extra / full_bytes


def pooled_mean(per: list[np.ndarray], idx) -> float:
    """The mean over every token of the requests ``idx`` (a request counts by its length)."""
    return float(np.concatenate([per[i] for i in idx]).mean())


def paired_kl(kl: list[np.ndarray], base: list[np.ndarray]) -> tuple[float, float, float]:
    """Pooled KL of one row minus another's over the same requests, each resample drawing the same requests for
    both, so what every request shares (its text, its hard spots) cancels out of the interval."""
    return interval(kl, lambda idx: pooled_mean(kl, idx) - pooled_mean(base, idx))


def quality(
    scored: list, own: list[str], ref_texts: list[str], auto_per_token: float
) -> dict[str, tuple[float, float, float]]:
    """Fidelity (KL, top-1 agreement) on full's answers, the resident KV share in tokens and in bytes (against
    ``full``'s at ``auto_per_token``, the model's dtype), and text overlap of the policy's own answers with full's,
    each with its interval over requests."""
    kl = [res.kl.double().numpy() for res in scored]
    top1 = [res.greedy_match.double().numpy() for res in scored]
    kv = [res.kv_fraction for res in scored]
    kv_bytes = [bytes_share(res, auto_per_token) for res in scored]
    rouge = [rouge_l([a], [b]) for a, b in zip(own, ref_texts, strict=True)]  # per pair: the mean is ROUGE-L

    def pooled(per: list[np.ndarray]):
        return lambda idx: pooled_mean(per, idx)

    return {
        "kl": interval(kl, pooled(kl)),
        "top1_agreement": interval(top1, pooled(top1)),
        "kv_fraction": interval(kv, lambda idx: float(np.mean([kv[i] for i in idx]))),
        "kv_bytes_fraction": interval(kv_bytes, lambda idx: float(np.mean([kv_bytes[i] for i in idx]))),
        "bleu4_vs_full": interval(own, lambda idx: bleu4([own[i] for i in idx], [ref_texts[i] for i in idx])),
        "rougeL_vs_full": interval(rouge, lambda idx: float(np.mean([rouge[i] for i in idx]))),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--output-tokens", default="256,512", help="MIN,MAX tokens per answer")
    ap.add_argument(
        "--policies", default="dynamic",
        help="built-in policies at the stream's sizes (comma-separated), each POLICY[:KV_DTYPE[:demote=DTYPE]] "
        "(snapkv@128:int8)",
    )  # fmt: skip
    ap.add_argument("--policy-file", action="append", default=[], help="also a YAML policy, PATH[:KV_DTYPE]")
    ap.add_argument(
        "--paired-against", metavar="ROW[,ROW]", default="",
        help="also each other row's KL minus each of these rows' (row names as printed, e.g. snapkv@320:int8), "
        "with a paired bootstrap interval over requests",
    )  # fmt: skip
    ap.add_argument("--noise-floor", metavar="DTYPE", help="also full with its weights in DTYPE (e.g. bfloat16)")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=512,
        help="tokens per engine step for full and every policy (the throughput suite's --max-num-batched-tokens): "
        "a prompt is read, and under an evicting policy trimmed, in chunks of this size",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        run(args)
    except ConfkvError as err:
        print(f"longgen_fidelity.py: {err}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> None:
    """Full's answers, then every row read back over them and answering freely; the JSON on stdout's last line."""
    t0 = time.perf_counter()
    low, high = (int(v) for v in args.output_tokens.split(","))
    spec = dataclasses.replace(LONGGEN_CPU, requests=args.requests, output_tokens=(low, high))
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    chosen = stream_rows(names, args.policy_file, spec)  # a bad entry is one line before the model loads
    loaded = load_model(args.model, device="cpu")
    requests = make_longgen_requests(loaded.tokenizer, spec)
    prompts = [list(r.prompt_ids) for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    chunk = {"max_batch_size": len(prompts), "max_num_batched_tokens": args.max_num_batched_tokens}
    full = LLM(args.model, "full", loaded=loaded, **chunk)
    answers = full.generate(prompts, params)
    items = [(p + o.token_ids, 0, len(p)) for p, o in zip(prompts, answers, strict=True)]
    refs = build_references(full, items)
    ref_texts = [o.text for o in answers]
    auto = auto_bytes_per_token(full)
    rows = {}
    kl_of: dict[str, list[np.ndarray]] = {}
    scored_rows = [r.name for r in chosen if not is_reference(r, "auto")]
    bases = [b.strip() for b in args.paired_against.split(",") if b.strip()]
    for b in bases:
        if b not in scored_rows:
            raise ConfkvError(f"--paired-against {b!r} is not one of the rows ({', '.join(scored_rows)})")
    for row in chosen:
        if is_reference(row, "auto"):
            continue  # full at auto is the reference itself
        llm = LLM(args.model, row.policy, loaded=loaded, kv_cache_dtype=row.kv_cache_dtype, **chunk)
        scored = Scorer(llm.engine).score([ScoreItem(r.scored_ids, r.score_from, reference=r.topk) for r in refs])
        own = [o.text for o in llm.generate(prompts, params)]
        kl_of[row.name] = [res.kl.double().numpy() for res in scored]
        rows[row.name] = {"kv_cache_dtype": row.kv_cache_dtype, **quality(scored, own, ref_texts, auto)}
        print(row.name, {k: v if isinstance(v, str) else tuple(round(x, 4) for x in v)
                         for k, v in rows[row.name].items()}, flush=True)  # fmt: skip
    if args.noise_floor:
        other = load_model(args.model, device="cpu", dtype=args.noise_floor)
        llm = LLM(args.model, "full", loaded=other, **chunk)
        scored = Scorer(llm.engine).score([ScoreItem(r.scored_ids, r.score_from, reference=r.topk) for r in refs])
        own = [o.text for o in llm.generate(prompts, params)]
        name = f"full@{args.noise_floor}"
        rows[name] = {"kv_cache_dtype": "auto", **quality(scored, own, ref_texts, auto)}
        print(name, {k: v if isinstance(v, str) else tuple(round(x, 4) for x in v)
                     for k, v in rows[name].items()}, flush=True)  # fmt: skip
    for b in bases:
        for name in (n for n in kl_of if n != b):
            diff = rows[name][f"kl_minus_{b}"] = paired_kl(kl_of[name], kl_of[b])
            print(name, "KL minus", b, tuple(round(x, 5) for x in diff), flush=True)
    out = {
        "model": args.model,
        "requests": len(prompts),
        "output_tokens": [low, high],
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - t0, 1),
        "policies": rows,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    sys.exit(main())
