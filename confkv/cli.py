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

from confkv.cli_args import build_parser, parse_admission, parse_admissions
from confkv.config import BUILTIN_POLICIES, MIN_BATCHED_TOKENS
from confkv.errors import ConfkvError


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


def check_kv_cache_dtype(name: str, host: str | None = None, float_window: int = 0) -> None:
    """Refuse a bad ``--kv-cache-dtype``, ``--host-kv-dtype`` or ``--kv-float-window`` with the engine setting's
    one-line error before any model loads."""
    from confkv.config import make_engine_config

    make_engine_config({"kv_cache_dtype": name, "host_kv_dtype": host, "kv_float_window": float_window})


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
        host_kv_dtype=args.host_kv_dtype,
        kv_float_window=args.kv_float_window,
        max_batch_size=max_batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        dtype=args.dtype,
        seed=getattr(args, "seed", 0),
        cache_dir=args.cache_dir,
        admission=parse_admission(getattr(args, "admission", "on_demand")),
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

    check_kv_cache_dtype(args.kv_cache_dtype, args.host_kv_dtype, args.kv_float_window)  # before the model loads
    if args.suite == "throughput":
        return _bench_throughput(args)
    if args.suite == "longgen":
        return _bench_longgen(args)
    from confkv.bench.specs import parse_row

    policies = [p.strip() for p in (args.policies or ",".join(BUILTIN_POLICIES)).split(",") if p.strip()]
    for p in policies:
        parse_row(p, BUILTIN_POLICIES)  # POLICY[:KV_DTYPE[:demote=DTYPE]], a one-line error before the model loads
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
        host_kv_dtype=args.host_kv_dtype,
        kv_float_window=args.kv_float_window,
        seed=args.seed,
        split=args.split,
        progress=bars(),
        log=lambda line: print(line, file=sys.stderr),
    )
    paths = write_report(results, args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    from confkv.bench.stream_rows import stream_rows
    from confkv.bench.streams import ThroughputSpec
    from confkv.bench.throughput import SCENARIOS, run_throughput
    from confkv.bench.throughput_report import write_throughput_report

    policies = [p.strip() for p in (args.policies or "full,dynamic").split(",") if p.strip()]
    admissions = parse_admissions(args.admission)
    scenarios = tuple(dict.fromkeys(s.strip() for s in args.scenarios.split(",") if s.strip()))
    if not scenarios or set(scenarios) - set(SCENARIOS):
        raise ConfkvError(f"--scenarios takes {', '.join(SCENARIOS)}")
    stream_rows(policies, args.policy_file, ThroughputSpec(), args.kv_cache_dtype)  # one line on a bad entry, now
    changes = {"arrival_rate": args.arrival_rate, "requests": args.requests, "max_tokens": args.max_tokens}
    if any(v is not None and not (math.isfinite(v) and v > 0) for v in changes.values()):
        raise ConfkvError("--arrival-rate, --requests and --max-tokens must be positive numbers")
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.repeats < 1:
        raise ConfkvError("--repeats takes a whole number of at least 1 (runs of every row)")
    if args.ceiling is not None and args.ceiling < 2:
        raise ConfkvError("--ceiling takes a whole number of at least 2 (the pool's multiple)")
    if args.output_tokens is not None:
        changes["output_tokens"] = _token_range(args.output_tokens)
    changes.update(_operating_point(args))
    out_folder(args.out)
    results = run_throughput(
        args.model, policies, policy_files=args.policy_file, scenarios=scenarios, changes=changes, ceiling=args.ceiling,
        repeats=args.repeats, hf=not args.no_hf,
        device=args.device, dtype=args.dtype, cache_dir=args.cache_dir, seed=args.seed, admissions=admissions,
        kv_cache_dtype=args.kv_cache_dtype, host_kv_dtype=args.host_kv_dtype, kv_float_window=args.kv_float_window,
        log=lambda line: print(line, file=sys.stderr),
    )  # fmt: skip
    paths = write_throughput_report(results, args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _bench_longgen(args: argparse.Namespace) -> int:
    from confkv.bench.curves import run_curves
    from confkv.bench.curves_report import write_curves_report

    policies = [p.strip() for p in (args.policies or "full,dynamic").split(",") if p.strip()]
    admission = parse_admission(args.admission)
    if args.runs is not None and args.runs < 1:
        raise ConfkvError("--runs must be a positive number")
    for f in args.policy_file:
        from confkv.policy_source import load_policy

        load_policy(f)
    changes = {"output_tokens": _token_range(args.output_tokens)} if args.output_tokens else {}
    changes.update(_operating_point(args))
    out_folder(args.out)
    results = run_curves(
        args.model, policies, runs=args.runs, policy_files=args.policy_file, changes=changes, admission=admission,
        device=args.device, dtype=args.dtype, cache_dir=args.cache_dir, seed=args.seed,
        log=lambda line: print(line, file=sys.stderr),
    )  # fmt: skip
    paths = write_curves_report(results, args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _operating_point(args: argparse.Namespace) -> dict[str, int]:
    """``--full-fits``, ``--max-batch-size`` and ``--max-num-batched-tokens`` as stream spec fields (the pool-size
    sweep of issue 34: every row of a run gets the same pool, batch bound and prompt chunk, so ``full`` runs under
    the settings the policies do); whole numbers of at least 1 (the chunk: at least the engine's 16), one line
    otherwise."""
    changes = {
        "full_fits": args.full_fits,
        "max_batch_size": args.max_batch_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    for key, value in changes.items():
        least = MIN_BATCHED_TOKENS if key == "max_num_batched_tokens" else 1
        if value is not None and value < least:
            raise ConfkvError(f"--{key.replace('_', '-')} takes a whole number of at least {least}, not {value}")
    return {k: v for k, v in changes.items() if v is not None}


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

    check_kv_cache_dtype(args.kv_cache_dtype, args.host_kv_dtype, args.kv_float_window)
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
        host_kv_dtype=args.host_kv_dtype, kv_float_window=args.kv_float_window,
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
