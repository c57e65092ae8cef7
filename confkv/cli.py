"""``confkv``: the command line.

User mistakes (bad flags, bad policy values, an empty or too long prompt, a model that cannot be found) end with
one line on stderr and exit status 2; argparse's own usage errors use the same status.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from confkv.config import BUILTIN_POLICIES
from confkv.errors import ConfkvError
from confkv.plugins import CONTROLLERS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=os.environ.get("CONFKV_MODEL", "smollm2-135m"),
        help="smollm2-135m (default), tiny-random, a local Hugging Face folder or a .gguf file",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", default=None, help="device KV pool size, e.g. 512MiB (default: 1/4 of free)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="how the KV pool stores K and V: auto (the model's dtype), int8, fp8 (e4m3) or int4, quantised per "
        "token and KV head (default: auto)",
    )
    p.add_argument(
        "--cache-dir", default=None, help="converted-model cache (default: $CONFKV_CACHE or ~/.cache/confkv)"
    )


def _add_chunk_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per engine step: a long prompt is read (and, under an evicting policy, trimmed) in such chunks",
    )


def _add_admission_arg(p: argparse.ArgumentParser, several: bool = False) -> None:
    p.add_argument(
        "--admission",
        default="on_demand",
        help="on_demand (default): allocate blocks as tokens are computed and preempt (swap to host or recompute) "
        "when the pool runs out, as vLLM does; reserve: admit while every sequence's projected blocks fit, no "
        "preemption under full" + ("; comma-separated to run each policy under each" if several else ""),
    )


def _admissions(value: str) -> tuple[str, ...]:
    """``--admission``'s modes, checked (one line on a bad one)."""
    from confkv.engine.scheduler import ADMISSION_MODES

    modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    if not modes or set(modes) - set(ADMISSION_MODES):
        raise ConfkvError(f"--admission takes {' or '.join(ADMISSION_MODES)}, not {value!r}")
    return modes


def _one_admission(value: str) -> str:
    modes = _admissions(value)
    if len(modes) > 1:
        raise ConfkvError("--admission takes one mode here (several only for bench --suite throughput)")
    return modes[0]


def _add_policy_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """--policy, --policy-file, --set; ``serving`` (``confkv serve``) adds vLLM's spelling ``--cache-policy``,
    registry references (``registry://NAME@ALIAS``, followed live) and a policy file that is watched."""
    registry = ", or registry://NAME@ALIAS (followed live)" if serving else ""
    watched = "; watched and reloaded when it changes" if serving else ""
    p.add_argument(
        "--policy",
        *(["--cache-policy"] if serving else []),
        dest="policy",
        default=None,
        help=f"KV cache policy: {', '.join(CONTROLLERS)}{registry} (default: dynamic, or the policy file's controller)",
    )
    p.add_argument("--policy-file", default=None, help=f"YAML file with a top-level cache_policy: mapping{watched}")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one policy key (repeatable), e.g. --set max_size=2048",
    )


def package_version() -> str:
    """The installed package's version (``pyproject.toml``), or ``unknown`` when the code runs from a checkout that
    was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("confkv")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="confkv", description="LLM inference whose KV cache is sized by the model's own confidence."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine decisions to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of one prompt and report its KV statistics")
    _add_model_args(gen)
    _add_chunk_arg(gen)
    _add_admission_arg(gen)
    _add_policy_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text and a summary")

    score = sub.add_parser("score", help="score a text teacher-forced under a policy (perplexity and KV use)")
    _add_model_args(score)
    _add_chunk_arg(score)
    _add_policy_args(score)
    score.add_argument("--text-file", required=True, help="the text to score ('-' for stdin)")
    score.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens of the text")
    score.add_argument("--context", type=int, default=1, help="tokens read as context before scoring starts")
    score.add_argument("--json", action="store_true", help="print one JSON object")

    bench = sub.add_parser("bench", help="measure policies against the full cache: results.json, report.md, plots")
    _add_model_args(bench)
    bench.add_argument(
        "--suite",
        choices=["quick", "standard", "throughput", "longgen"],
        default="quick",
        help="quality and memory against the full cache: quick (items of about 1,000 tokens, for CI) or standard "
        "(2,000-4,000 tokens, 33-50 minutes on 2 CPU cores); throughput: requests served from one KV pool; longgen: "
        "--runs long answers per policy and the curves of what each policy does along them",
    )
    bench.add_argument(
        "--policies",
        default=None,
        help="comma-separated built-in policies (default: all; throughput suite: full,dynamic); dynamic uses the "
        "requirement's defaults scaled",
    )
    bench.add_argument(
        "--policy-file",
        action="append",
        default=[],
        help="also measure this YAML policy; quick/standard: a dynamic or learned one gets its own fixed "
        "baselines, matched to its memory (window@NAME, ...)",
    )
    bench.add_argument("--out", required=True, help="output folder")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--split", choices=["heldout", "train"], default="heldout",
        help="quick/standard: which items (train: the tuner's; check that a policy chosen on held-out items was not "
        "fitted to them)",
    )  # fmt: skip
    bench.add_argument(
        "--scenarios", default="burst,poisson",
        help="throughput suite: burst (all at start) and/or poisson arrivals of the chat stream; longgen and/or "
        "longgen_poisson for the long-generation stream (short asks, outputs 1,024-4,096 tokens on a GPU, 256-512 "
        "on a CPU)",
    )  # fmt: skip
    bench.add_argument("--arrival-rate", type=float, default=None, help="throughput suite: poisson requests/s")
    bench.add_argument("--requests", type=int, default=None, help="throughput suite: number of requests (48)")
    bench.add_argument("--no-hf", action="store_true", help="throughput suite: skip Hugging Face static batching")
    _add_admission_arg(bench, several=True)
    bench.add_argument(
        "--output-tokens", default=None, metavar="MIN,MAX",
        help="throughput suite: draw output lengths from this range instead of the stream's (the pool follows)",
    )  # fmt: skip
    bench.add_argument(
        "--runs", type=int, default=None,
        help="longgen suite: long answers per policy (default 16 on a CPU, 128 on a GPU, 6 for tiny-random; 1,000 is "
        "the requirement's)",
    )  # fmt: skip
    bench.add_argument(
        "--ceiling", type=int, default=None, metavar="N",
        help="throughput suite: also run full with a pool N times larger (row full:Nx), the most any policy could give",
    )  # fmt: skip
    bench.add_argument(
        "--max-tokens", type=int, default=None,
        help="throughput suite: every request generates this many tokens (prompts and pool as drawn); 1 times prompt "
        "reading alone",
    )  # fmt: skip

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (streaming, /metrics)")
    _add_model_args(serve)
    _add_chunk_arg(serve)
    _add_admission_arg(serve)
    _add_policy_args(serve, serving=True)
    from confkv.server.settings import add_serve_arguments

    add_serve_arguments(serve)
    from confkv.scaleout.options import add_scaleout_arguments

    add_scaleout_arguments(serve)

    cal = sub.add_parser(
        "calibrate",
        help="measure the model's own entropy and top-1/top-2 gap and write thresholds that fit it (the default "
        "policy for the model uses them)",
    )
    _add_model_args(cal)
    cal.add_argument(
        "--text-file", default=None, help="calibration text (default: train-split documentation from the corpus)"
    )
    cal.add_argument("--tokens", type=int, default=None, help="tokens to read (default 4096; a --text-file: all)")
    cal.add_argument("--entropy-quantile", type=float, default=0.8, help="entropy_threshold: this quantile (0.8)")
    cal.add_argument("--gap-quantile", type=float, default=0.2, help="gap_threshold: this quantile (0.2)")
    cal.add_argument(
        "--out",
        default=None,
        help="policy file to write (default: $CONFKV_CACHE/calibration/<model>.yaml, which the default policy of "
        "the model then uses)",
    )
    return parser


def _read_text(path: str, what: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ConfkvError(f"cannot read {what} file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfkvError(f"{what} file {path} is not UTF-8 text") from None


def check_kv_cache_dtype(name: str) -> None:
    """Refuse a bad ``--kv-cache-dtype`` with the engine setting's one-line error before any model loads."""
    from confkv.config import make_engine_config

    make_engine_config({"kv_cache_dtype": name})


def _read_prompt(args: argparse.Namespace) -> str:
    return args.prompt if args.prompt is not None else _read_text(args.prompt_file, "prompt")


def _make_llm(args: argparse.Namespace, max_batch_size: int = 1):
    from confkv.config import parse_overrides
    from confkv.llm import LLM

    return LLM(
        model=args.model,
        policy=args.policy,
        policy_file=args.policy_file,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        max_batch_size=max_batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        dtype=args.dtype,
        seed=getattr(args, "seed", 0),
        cache_dir=args.cache_dir,
        admission=_one_admission(getattr(args, "admission", "on_demand")),
        **parse_overrides(args.overrides),
    )


def _summary(out: dict) -> str:
    kv, t, s = out["kv"], out["timing"], out["signals"]
    return (
        f"[{out['prompt_tokens']} prompt + {out['generated_tokens']} generated tokens, finish={out['finish_reason']}] "
        f"KV resident mean {kv['mean_resident_tokens']:.0f} / peak {kv['peak_resident_tokens']} of "
        f"{kv['full_tokens']} tokens, {kv['peak_device_bytes'] / 2**20:.2f} MiB peak at {kv['kv_cache_dtype']}; "
        f"evicted {kv['evicted_blocks']} recalled {kv['recalled_blocks']} blocks; "
        f"entropy mean {s['entropy']['mean']:.2f}; "
        f"prefill {t['prefill_s']:.2f}s decode {t['decode_s']:.2f}s ({t['tokens_per_s']:.1f} tok/s)"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from confkv.config import parse_overrides
    from confkv.engine.params import SamplingParams

    prompt = _read_prompt(args)
    if not prompt.strip():
        raise ConfkvError("prompt is empty")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    parse_overrides(args.overrides)  # bad keys fail before the model loads
    llm = _make_llm(args)
    out = llm.generate(prompt, params, chat=args.chat)[0].to_dict()
    out["kv"]["kv_cache_dtype"] = llm.engine.pool.kv_cache_dtype
    if args.json:
        print(json.dumps(out))
    if out["finish_reason"] == "error":
        print(f"confkv: error: generation failed: {out['error']}", file=sys.stderr)
        return 1
    if not args.json:
        print(out["text"])
        print(_summary(out), file=sys.stderr)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from confkv.config import parse_overrides
    from confkv.scoring import ScoreItem, Scorer

    text = _read_text(args.text_file, "text")
    if not text.strip():
        raise ConfkvError("text is empty")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfkvError("--max-tokens must be at least 1")
    if args.context < 1:
        raise ConfkvError("--context must be at least 1")
    parse_overrides(args.overrides)
    llm = _make_llm(args)
    ids = list(llm.tokenizer(text)["input_ids"])
    if args.max_tokens is not None:
        ids = ids[: args.context + args.max_tokens]
    if len(ids) <= args.context:
        raise ConfkvError(f"the text has {len(ids)} tokens, not more than --context {args.context}")
    (result,) = Scorer(llm.engine).score([ScoreItem(ids, args.context)])
    out = result.to_dict()
    if args.json:
        print(json.dumps(out))
    else:
        kv = out["kv"]
        print(
            f"{out['tokens']} tokens scored: nll {out['nll_mean']:.4f}, ppl {out['ppl']:.3f}; KV resident mean "
            f"{kv['mean_resident_tokens']:.0f} of {kv['full_tokens']} tokens ({100 * out['kv_fraction']:.1f}% of "
            f"full), evicted {kv['evicted_blocks']} recalled {kv['recalled_blocks']} blocks"
        )
    return 0


def out_folder(path: str) -> Path:
    """Create ``--out`` before any model loads: an existing file there (or a parent that is a file) would otherwise
    surface only when the results are written, after minutes of loading or an hour of benchmark, as a traceback."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfkvError(f"--out {path} is an existing file; give a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfkvError(f"cannot create --out {path}: {err.strerror or err}") from None
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from confkv.bench.report import write_report
    from confkv.bench.suite import run_suite
    from confkv.progress import bars

    check_kv_cache_dtype(args.kv_cache_dtype)  # before the model loads
    if args.suite == "throughput":
        return _bench_throughput(args)
    if args.suite == "longgen":
        return _bench_longgen(args)
    policies = [p.strip() for p in (args.policies or ",".join(BUILTIN_POLICIES)).split(",") if p.strip()]
    unknown = [p for p in policies if p not in BUILTIN_POLICIES]
    if unknown:
        raise ConfkvError(f"unknown policy {unknown[0]!r}; choose from {', '.join(BUILTIN_POLICIES)}")
    if not policies and not args.policy_file:
        raise ConfkvError("no policy to measure")
    for f in args.policy_file:
        from confkv.policy_source import load_policy

        load_policy(f)
    out_folder(args.out)
    results = run_suite(
        args.model,
        args.suite,
        policies,
        policy_files=args.policy_file,
        device=args.device,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        split=args.split,
        progress=bars(),
        log=lambda line: print(line, file=sys.stderr),
    )
    paths = write_report(results, args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    from confkv.bench.throughput import SCENARIOS, run_throughput
    from confkv.bench.throughput_report import write_throughput_report

    policies = [p.strip() for p in (args.policies or "full,dynamic").split(",") if p.strip()]
    admissions = _admissions(args.admission)
    scenarios = tuple(dict.fromkeys(s.strip() for s in args.scenarios.split(",") if s.strip()))
    if not scenarios or set(scenarios) - set(SCENARIOS):
        raise ConfkvError(f"--scenarios takes {', '.join(SCENARIOS)}")
    for f in args.policy_file:
        from confkv.policy_source import load_policy

        load_policy(f)
    changes = {"arrival_rate": args.arrival_rate, "requests": args.requests, "max_tokens": args.max_tokens}
    if any(v is not None and not (math.isfinite(v) and v > 0) for v in changes.values()):
        raise ConfkvError("--arrival-rate, --requests and --max-tokens must be positive numbers")
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.ceiling is not None and args.ceiling < 2:
        raise ConfkvError("--ceiling takes a whole number of at least 2 (the pool's multiple)")
    if args.output_tokens is not None:
        changes["output_tokens"] = _token_range(args.output_tokens)
    out_folder(args.out)
    results = run_throughput(
        args.model, policies, policy_files=args.policy_file, scenarios=scenarios, changes=changes, ceiling=args.ceiling,
        hf=not args.no_hf,
        device=args.device, dtype=args.dtype, cache_dir=args.cache_dir, seed=args.seed, admissions=admissions,
        kv_cache_dtype=args.kv_cache_dtype, log=lambda line: print(line, file=sys.stderr),
    )  # fmt: skip
    paths = write_throughput_report(results, args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _bench_longgen(args: argparse.Namespace) -> int:
    from confkv.bench.curves import run_curves
    from confkv.bench.curves_report import write_curves_report

    policies = [p.strip() for p in (args.policies or "full,dynamic").split(",") if p.strip()]
    admission = _one_admission(args.admission)
    if args.runs is not None and args.runs < 1:
        raise ConfkvError("--runs must be a positive number")
    for f in args.policy_file:
        from confkv.policy_source import load_policy

        load_policy(f)
    changes = {"output_tokens": _token_range(args.output_tokens)} if args.output_tokens else {}
    out_folder(args.out)
    results = run_curves(
        args.model, policies, runs=args.runs, policy_files=args.policy_file, changes=changes, admission=admission,
        device=args.device, dtype=args.dtype, cache_dir=args.cache_dir, seed=args.seed,
        log=lambda line: print(line, file=sys.stderr),
    )  # fmt: skip
    paths = write_curves_report(results, args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _token_range(value: str) -> tuple[int, int]:
    """``MIN,MAX`` tokens, both positive and in order (one line on anything else)."""
    try:
        low, high = (int(v) for v in value.split(","))
    except ValueError:
        raise ConfkvError(f"--output-tokens takes MIN,MAX (two whole numbers), not {value!r}") from None
    if not 0 < low <= high:
        raise ConfkvError(f"--output-tokens takes 0 < MIN <= MAX, not {value!r}")
    return low, high


def cmd_calibrate(args: argparse.Namespace) -> int:
    from confkv.bench.calibrate import calibrate
    from confkv.calibration import calibration_path

    check_kv_cache_dtype(args.kv_cache_dtype)
    out = args.out or calibration_path(args.model, args.cache_dir)
    if out is None:
        raise ConfkvError("calibration is off (CONFKV_CALIBRATION); name a file with --out")
    if Path(out).is_dir() or str(out).endswith(("/", os.sep)):  # found before the scoring, not after it
        raise ConfkvError(f"--out {out} is a folder; name the policy file to write ({Path(out) / 'calib.yaml'}, say)")
    text = _read_text(args.text_file, "text") if args.text_file else None
    result = calibrate(
        args.model, text=text, tokens=args.tokens, entropy_quantile=args.entropy_quantile,
        gap_quantile=args.gap_quantile, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir,
        kv_cache_memory=args.kv_cache_memory, source=args.text_file, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    path = result.write(out)
    policy, meta = result.policy(), result.metadata()
    print(
        f"{args.model}: {meta['tokens']} tokens; entropy_threshold {policy.entropy_threshold:g} (quantile "
        f"{args.entropy_quantile:g}), gap_threshold {policy.gap_threshold:g} (quantile {args.gap_quantile:g}): "
        f"{100 * meta['uncertain_share']:.1f}% of tokens uncertain (3.5 / 0.15: "
        f"{100 * meta['uncertain_share_at_requirement_defaults']:.1f}%)",
        file=sys.stderr,
    )
    print(json.dumps({"path": str(path), "entropy_threshold": policy.entropy_threshold,
                      "gap_threshold": policy.gap_threshold, **meta}))  # fmt: skip
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:  # Ray is imported here and only here
        from confkv.scaleout.launch import serve_replicas

        return serve_replicas(args)
    from confkv.server.main import serve

    return serve(args)


def quiet_libraries(verbose: bool = False) -> None:
    """Log warnings only and hide transformers' loading bars: the CLIs print their own results and errors."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def run_command(
    prog: str, command: Callable[[argparse.Namespace], int], args: argparse.Namespace, user_errors: tuple = ()
) -> int:
    """Run a subcommand; a user error becomes one stderr line and exit status 2, Ctrl-C exit status 130 (SIGTERM,
    which ``confkv-tune train`` turns into an interrupt with its ``signum``: 143)."""
    try:
        return command(args)
    except (ConfkvError, *user_errors) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        return 128 + int(getattr(err, "signum", 2))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries(args.verbose)
    commands = {"generate": cmd_generate, "score": cmd_score, "bench": cmd_bench, "serve": cmd_serve,
                "calibrate": cmd_calibrate}  # fmt: skip
    return run_command("confkv", commands[args.command], args, user_errors=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
