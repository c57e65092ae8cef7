"""The ``confkv`` command line's arguments: the subcommands, their flags and the shared groups, apart from what
the commands do (``confkv.cli``), so that a launcher (``deploy/ray/app.py``) can read a command line without the
commands' imports."""

from __future__ import annotations

import argparse
import os

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
        help="how the KV pool stores K and V: auto (the model's dtype), int8, fp8 (e4m3) or int4, quantised as "
        "written (int8 and fp8 per token and KV head; int4 keys per channel within a block, values per token in "
        "groups of 32) (default: auto)",
    )
    p.add_argument(
        "--host-kv-dtype",
        default=None,
        help="how the host tier and session records store K and V, more compact than the pool (a less compact "
        "form is refused): auto, int8, fp8 or int4 (default: as --kv-cache-dtype)",
    )
    p.add_argument(
        "--kv-float-window",
        type=int,
        default=0,
        metavar="R",
        help="under a quantised --kv-cache-dtype, keep each sequence's last R tokens also in the model's dtype, read "
        "exactly by attention (Hugging Face QuantizedCache's residual_length), counted against the pool's bytes; "
        "no effect at auto (default: 0, none)",
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


def parse_admissions(value: str) -> tuple[str, ...]:
    """``--admission``'s modes, checked (one line on a bad one)."""
    from confkv.engine.scheduler import ADMISSION_MODES

    modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    if not modes or set(modes) - set(ADMISSION_MODES):
        raise ConfkvError(f"--admission takes {' or '.join(ADMISSION_MODES)}, not {value!r}")
    return modes


def parse_admission(value: str) -> str:
    modes = parse_admissions(value)
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
        "requirement's defaults scaled; throughput suite: h2o@192 is a fixed baseline at 192 tokens; "
        "POLICY:KV_DTYPE[:demote=DTYPE] gives a row its own --kv-cache-dtype (full:int8, dynamic:int8:demote=int4, "
        "snapkv@128:int8); quick/standard: baselines matched to its bytes; throughput: every row's pool has the same "
        "bytes, and full at --kv-cache-dtype stays the reference",
    )
    bench.add_argument(
        "--policy-file",
        action="append",
        default=[],
        help="also measure this YAML policy; quick/standard: a dynamic or learned one gets its own fixed "
        "baselines, matched to its memory (window@NAME, ...); throughput: PATH:KV_DTYPE[:demote=DTYPE] runs it on a "
        "pool of that dtype (rule.yaml:int8)",
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
        "--full-fits", type=int, default=None, metavar="N",
        help="throughput and longgen suites: the KV pool holds N full-cache copies of the stream's longest request "
        "(the stream's own: 4 on a CPU; --ceiling multiplies it)",
    )  # fmt: skip
    bench.add_argument(
        "--max-batch-size", type=int, default=None, metavar="N",
        help="throughput and longgen suites: at most N sequences in one step (the stream's own: 16 on a CPU)",
    )  # fmt: skip
    bench.add_argument(
        "--max-num-batched-tokens", type=int, default=None, metavar="N",
        help="throughput and longgen suites: tokens per engine step for every row (the stream's own: 512 for "
        "longgen on a CPU, 2,048 on a GPU); a prompt is read in chunks of up to N, and on-demand admission needs "
        "room for a new request's first chunk",
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
        "--repeats", type=int, default=1,
        help="throughput suite: run every row this many times, round-robin; requests/s is their mean with a 95%% "
        "interval (Student's t over the runs)",
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
