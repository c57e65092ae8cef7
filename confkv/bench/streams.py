"""The throughput suite's request streams: what each scenario sends and how big a pool it gets.

* ``chat`` (scenarios ``burst`` and ``poisson``): chat prompts of 1,000-2,000 tokens of held-out documentation with
  a task after them, outputs of 64-256 tokens;
* ``longgen`` (``longgen``, ``longgen_poisson``): short chat prompts (100-300 tokens) asking for a story, report,
  documentation or code, outputs of 1,024-4,096 tokens on a GPU and fewer on a CPU.

Every request ignores EOS so that every policy generates the same number of tokens; the pool holds ``full_fits`` of
the stream's longest request under ``full``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from confkv.bench.corpus import split_passage
from confkv.bench.workloads import longgen_prompts, render_chat
from confkv.kv.pool import BlockPool
from confkv.model_loader import LoadedModel

TASKS = (
    "Summarise the excerpt above in a few sentences.",
    "List the main rules the excerpt above describes, one per line.",
    "Explain the excerpt above to a programmer who is new to Python.",
    "Write five questions a student could answer from the excerpt above.",
    "Give an example program that uses what the excerpt above describes, and explain it.",
    "What are the most common mistakes related to the excerpt above? Explain each.",
)


@dataclass(frozen=True)
class ThroughputSpec:
    requests: int = 48
    prompt_tokens: tuple[int, int] = (1000, 2000)
    output_tokens: tuple[int, int] = (64, 256)
    full_fits: int = 4
    max_batch_size: int = 32
    max_num_batched_tokens: int = 512
    arrival_rate: float = 0.15  # requests/s of the poisson scenario
    scale: float = 0.25  # the requirement's dynamic sizes times this (base 256, max 1024, 128 recent)
    #: every request generates this many tokens instead of its drawn length (prompts and pool unchanged): 1 times
    #: prompt reading alone
    max_tokens: int | None = None
    #: which requests: "chat" (documentation excerpts with a task) or "longgen" (short asks for long texts)
    stream: str = "chat"


#: For tiny-random (tests, CI): the same shape at toy sizes.
TINY_THROUGHPUT = ThroughputSpec(
    requests=8, prompt_tokens=(100, 200), output_tokens=(8, 24), full_fits=2, max_batch_size=8,
    max_num_batched_tokens=128, arrival_rate=40.0, scale=1 / 16,
)  # fmt: skip


#: The long-generation stream at the requirement's size (a GPU): 1,024-4,096 tokens per answer, many users.
LONGGEN_GPU = ThroughputSpec(
    requests=128, prompt_tokens=(100, 300), output_tokens=(1024, 4096), full_fits=8, max_batch_size=64,
    max_num_batched_tokens=2048, arrival_rate=2.0, scale=1.0, stream="longgen",
)  # fmt: skip
#: Its CPU default, scaled to minutes on 2 cores: outputs and dynamic's sizes cut by 8, 16 requests.
LONGGEN_CPU = ThroughputSpec(
    requests=16, prompt_tokens=(100, 300), output_tokens=(256, 512), full_fits=4, max_batch_size=16,
    max_num_batched_tokens=512, arrival_rate=0.2, scale=0.125, stream="longgen",
)  # fmt: skip
#: For tiny-random (tests, CI).
TINY_LONGGEN = ThroughputSpec(
    requests=6, prompt_tokens=(200, 300), output_tokens=(32, 64), full_fits=2, max_batch_size=6,
    max_num_batched_tokens=128, arrival_rate=40.0, scale=1 / 16, stream="longgen",
)  # fmt: skip
#: scenario -> the stream it runs
SCENARIOS: dict[str, str] = {"burst": "chat", "poisson": "chat", "longgen": "longgen", "longgen_poisson": "longgen"}


def default_spec(model: str, stream: str, device_type: str = "cpu") -> ThroughputSpec:
    """The stream's spec for a model and device: toy sizes for tiny-random, the requirement's on a GPU."""
    if stream == "chat":
        return TINY_THROUGHPUT if model == "tiny-random" else ThroughputSpec()
    if model == "tiny-random":
        return TINY_LONGGEN
    return LONGGEN_GPU if device_type == "cuda" else LONGGEN_CPU


@dataclass(frozen=True)
class StreamRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0


def make_requests(tokenizer: Any, spec: ThroughputSpec, seed: int = 0) -> list[StreamRequest]:
    """Chat requests over held-out documentation, lengths drawn uniformly from the spec's ranges, by ``seed``."""
    rng = random.Random(f"throughput/{seed}")
    out = []
    for i in range(spec.requests):
        target = rng.randint(*spec.prompt_tokens)
        task = TASKS[i % len(TASKS)]
        passage = split_passage(6 * target, seed * 1000 + i, "heldout")
        ids = tokenizer(passage, add_special_tokens=False)["input_ids"]
        shell = _chat(tokenizer, "{}", task)
        room = max(16, target - len(shell))
        excerpt = tokenizer.decode(ids[:room])
        prompt = _chat(tokenizer, excerpt, task)
        drawn = rng.randint(*spec.output_tokens)
        out.append(StreamRequest(tuple(prompt[: spec.prompt_tokens[1]]), spec.max_tokens or drawn))
    return out


def make_longgen_requests(tokenizer: Any, spec: ThroughputSpec, seed: int = 0) -> list[StreamRequest]:
    """Short chat prompts asking for long texts: a request from the held-out long-generation templates and
    topics, after a few lines of held-out documentation as notes to draw on (which bring the prompt to its drawn
    length); each asks for about as many words as its output length allows."""
    rng = random.Random(f"throughput-longgen/{seed}")
    asks = longgen_prompts("heldout")
    rng.shuffle(asks)
    out = []
    for i in range(spec.requests):
        target = rng.randint(*spec.prompt_tokens)
        max_tokens = spec.max_tokens or rng.randint(*spec.output_tokens)
        _, template, topic = asks[i % len(asks)]
        ask = template.format(topic=topic) + f" Aim for about {max(10, round(0.075 * max_tokens) * 10)} words."
        room = max(0, target - len(_longgen_chat(tokenizer, " ", ask)))  # the prompt with empty notes
        ids = tokenizer(split_passage(6 * target, seed * 1000 + i, "heldout"), add_special_tokens=False)["input_ids"]
        prompt = _longgen_chat(tokenizer, tokenizer.decode(ids[:room]) if room else "", ask)
        while len(prompt) > spec.prompt_tokens[1] and room > 0:  # decoding and encoding again can add a few
            room = max(0, room - 8)
            prompt = _longgen_chat(tokenizer, tokenizer.decode(ids[:room]) if room else "", ask)
        out.append(StreamRequest(prompt, max_tokens))
    return out


def _longgen_chat(tokenizer: Any, notes: str, ask: str) -> tuple[int, ...]:
    content = f"Some notes you may draw on:\n\n{notes}\n\n{ask}" if notes else ask
    return render_chat(tokenizer, [{"role": "user", "content": content}])


def stream_requests(tokenizer: Any, spec: ThroughputSpec, seed: int = 0) -> list[StreamRequest]:
    """The spec's stream of requests (``stream``: chat or longgen)."""
    if spec.stream == "longgen":
        return make_longgen_requests(tokenizer, spec, seed)
    return make_requests(tokenizer, spec, seed)


def _chat(tokenizer: Any, excerpt: str, task: str) -> tuple[int, ...]:
    content = f"Read this excerpt of the Python documentation.\n\n{excerpt}\n\n{task}"
    return render_chat(tokenizer, [{"role": "user", "content": content}])


def with_poisson_arrivals(requests: list[StreamRequest], rate: float, seed: int = 0) -> list[StreamRequest]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, size=len(requests)))
    t -= t[0]
    return [StreamRequest(r.prompt_ids, r.max_tokens, float(a)) for r, a in zip(requests, t, strict=True)]


def pool_bytes_for(loaded: LoadedModel, spec: ThroughputSpec, block_size: int) -> int:
    """A pool that holds exactly ``full_fits`` of the longest possible requests under ``full`` (plus one block)."""
    per_block = BlockPool.bytes_per_block_for(
        *BlockPool.geometry(loaded.model.config), block_size, next(loaded.model.parameters()).dtype
    )
    longest = spec.prompt_tokens[1] + spec.output_tokens[1]
    return (spec.full_fits * -(-longest // block_size) + 1) * per_block
