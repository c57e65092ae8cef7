"""Shared bits of the benchmark scripts: argument parsing, model loading, and a JSON-line report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confkv.bench.evaluator import Evaluator, build_workloads
from confkv.bench.provenance import git_commit
from confkv.bench.specs import SuiteSpec, suite_spec
from confkv.bench.workloads import render_chat
from confkv.engine.engine import LLMEngine
from confkv.engine.params import SamplingParams
from confkv.model_loader import LoadedModel, load_model, resolve_device

#: Eight chat prompts of different lengths, the same for engine and Hugging Face runs.
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "Explain how a bicycle stays upright while moving.",
    "List five fruits and say one fact about each of them.",
    "Describe the water cycle to a ten-year-old.",
    "Give me three tips for writing clear emails at work, with an example for each.",
    "Why do cats purr? Give the main scientific explanations.",
    "Summarise the plot of a detective story you invent, in a paragraph.",
]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", help="model dtype (default: float32 on CPU, bf16/fp16 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def variant_args(p: argparse.ArgumentParser, *, items: int, split: str, baselines: str) -> None:
    """Arguments of the scripts that run one policy file against fixed baselines matched to its memory."""
    p.add_argument("--policy-file", required=True, help="the variant (a dynamic or learned policy)")
    p.add_argument("--items", type=int, default=items)
    split_arg(p, split)
    p.add_argument("--baselines", default=baselines)


def split_arg(p: argparse.ArgumentParser, default: str = "heldout") -> None:
    """Which items: the keys of ``docs/bench/policies`` were chosen on held-out ones, so train items check them."""
    p.add_argument("--split", choices=("train", "heldout"), default=default)


def shrunk_spec(spec: SuiteSpec, items: int, names: Iterable[str]) -> SuiteSpec:
    """``spec`` with at most ``items`` items (its first ones) of each workload in ``names``."""
    return dataclasses.replace(spec, **{n: {**getattr(spec, n), "n": min(items, getattr(spec, n)["n"])} for n in names})


def setup(args: argparse.Namespace) -> tuple[torch.device, dict]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    env = {
        "model": args.model,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "commit": git_commit(),
    }
    return device, env


def load(args: argparse.Namespace, device: torch.device) -> LoadedModel:
    return load_model(args.model, device=device, dtype=args.dtype)


def longgen_evaluator(
    args: argparse.Namespace, loaded: LoadedModel, free_tokens: int | None = None, seed: int = 0
) -> Evaluator:
    """The standard suite's free long generation over ``args.items`` prompts of ``args.split`` (no references)."""
    spec = suite_spec(args.model, "standard")
    spec = dataclasses.replace(
        spec, longgen={**spec.longgen, "n": args.items}, free_tokens=free_tokens or spec.free_tokens
    )
    workloads = build_workloads(loaded.tokenizer, spec, args.split, seed)
    return Evaluator(loaded, args.model, spec, workloads, references={}, engine={"seed": seed})


def chat_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    return list(render_chat(loaded.tokenizer, [{"role": "user", "content": prompt}]))


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_windows(loaded: LoadedModel, context: int, batch: int, stride: int = 37) -> list[list[int]]:
    """``batch`` prompts of ``context`` tokens: overlapping windows of README.md, ``stride`` tokens apart (the text
    repeated when it is too short), so decode-step timings see distinct sequences of a chosen length."""
    ids = loaded.tokenizer(README.read_text())["input_ids"]
    if len(ids) < context + stride * batch:
        ids = ids * (1 + (context + stride * batch) // len(ids))
    return [ids[i * stride : i * stride + context] for i in range(batch)]


def read_prompts(engine: LLMEngine) -> None:
    """Step ``engine`` until every request it holds has read its prompt and sampled a first token."""
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def start_decoding(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, settle_steps: int) -> None:
    """Submit ``prompts``, read them all, then take ``settle_steps`` decode steps, so that the steps timed next are
    decode steps over every sequence at its settled length."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    read_prompts(engine)
    for _ in range(settle_steps):
        engine.step()


def report(args: argparse.Namespace, result: dict) -> None:
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key:>32}: {value}")
