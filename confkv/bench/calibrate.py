"""``confkv calibrate``: measure the model's own next-token signals and write the thresholds that fit it.

Calibration reads a text with the full cache (teacher-forced, so every token's distribution is the model's own
with nothing evicted) and writes a policy file whose thresholds are quantiles of what it saw; where the file is kept
and how the default policy reads it back is ``confkv.calibration``.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from confkv.bench.workloads import make_workload
from confkv.config import CachePolicy
from confkv.errors import ConfkvError
from confkv.llm import LLM
from confkv.model_loader import source_fingerprint

ENTROPY_QUANTILE = 0.8  # entropy_threshold: the entropy 20% of tokens exceed
GAP_QUANTILE = 0.2  # gap_threshold: the top-1/top-2 gap 20% of tokens fall below
LEVELS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
PASSAGE_TOKENS = 1024  # calibration passages: long enough for a real context, several for variety
SKIP_TOKENS = 16  # a passage's first tokens are predicted with almost no context: not scored
TEXT_SEED = 7  # which train-split passages (the tuner's episodes use seed 0)


# ------------------------------------------------------------------------------------------------- measuring
def default_passages(tokenizer: Any, tokens: int) -> tuple[list[list[int]], str]:
    """Train-split documentation passages, ``tokens`` in all (of at most ``PASSAGE_TOKENS`` each)."""
    n = max(1, math.ceil(tokens / PASSAGE_TOKENS))
    length = max(SKIP_TOKENS + 2, math.ceil(tokens / n))
    items = make_workload("prose", tokenizer, split="train", n=n, seed=TEXT_SEED, length=length)
    source = f"documentation corpus, train split: {n} passage(s) of {length} tokens (seed {TEXT_SEED})"
    return [list(it.prompt_ids) for it in items], source


def file_passages(tokenizer: Any, text: str, tokens: int | None) -> list[list[int]]:
    """A text cut into passages of ``PASSAGE_TOKENS`` (the last may be shorter), up to ``tokens`` in all."""
    ids = list(tokenizer(text)["input_ids"])
    if tokens is not None:
        ids = ids[:tokens]
    passages = [ids[i : i + PASSAGE_TOKENS] for i in range(0, len(ids), PASSAGE_TOKENS)]
    return [p for p in passages if len(p) > SKIP_TOKENS + 1]


@dataclass
class Calibration:
    model: str
    source: str
    entropy: torch.Tensor  # per scored token, nats
    gap: torch.Tensor  # top-1 minus top-2 probability
    entropy_quantile: float = ENTROPY_QUANTILE
    gap_quantile: float = GAP_QUANTILE
    #: ``model_loader.source_fingerprint`` of the weights measured: a model re-exported in place is not taken for
    #: this one (None for tiny-random, which its seed defines)
    weights: str | None = None
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))

    @property
    def tokens(self) -> int:
        return int(self.entropy.numel())

    @property
    def entropy_threshold(self) -> float:
        return float(torch.quantile(self.entropy.float(), self.entropy_quantile))

    @property
    def gap_threshold(self) -> float:
        return min(1.0, max(0.0, float(torch.quantile(self.gap.float(), self.gap_quantile))))

    def uncertain_share(self, entropy_threshold: float, gap_threshold: float) -> float:
        """Share of tokens the rule's test calls uncertain under these thresholds."""
        return float(((self.entropy > entropy_threshold) | (self.gap < gap_threshold)).float().mean())

    def policy(self, base: CachePolicy | None = None) -> CachePolicy:
        base = base or CachePolicy()
        return base.replace(
            entropy_threshold=round(self.entropy_threshold, 4), gap_threshold=round(self.gap_threshold, 4)
        )

    def metadata(self) -> dict[str, Any]:
        q = torch.tensor(LEVELS)
        ent = torch.quantile(self.entropy.float(), q).tolist()
        gap = torch.quantile(self.gap.float(), q).tolist()
        default = CachePolicy()
        return {
            "model": self.model,
            "weights": self.weights,
            "text": self.source,
            "tokens": self.tokens,
            "created": self.created,
            "entropy_quantile": self.entropy_quantile,
            "gap_quantile": self.gap_quantile,
            "uncertain_share": round(self.uncertain_share(self.entropy_threshold, self.gap_threshold), 4),
            "uncertain_share_at_requirement_defaults": round(
                self.uncertain_share(default.entropy_threshold, default.gap_threshold), 4
            ),
            "entropy_mean": round(float(self.entropy.mean()), 4),
            "entropy_quantiles": {f"{lv:g}": round(v, 4) for lv, v in zip(LEVELS, ent, strict=True)},
            "gap_quantiles": {f"{lv:g}": round(v, 4) for lv, v in zip(LEVELS, gap, strict=True)},
        }

    def write(self, path: str | Path, base: CachePolicy | None = None) -> Path:
        """A policy file (``cache_policy:``, loadable by ``--policy-file``) with the measurement under
        ``calibration:`` and a comment saying how the thresholds were chosen."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        policy = self.policy(base)
        meta = self.metadata()
        head = (
            f"# confkv calibrate: {self.model}, {self.tokens} tokens of {self.source}\n"
            f"# entropy_threshold = the entropy {100 * (1 - self.entropy_quantile):.0f}% of tokens exceed "
            f"(quantile {self.entropy_quantile:g}): {policy.entropy_threshold:g} nats\n"
            f"# gap_threshold = the top-1/top-2 gap {100 * self.gap_quantile:.0f}% of tokens fall below "
            f"(quantile {self.gap_quantile:g}): {policy.gap_threshold:g}\n"
            f"# together they call {100 * meta['uncertain_share']:.1f}% of tokens uncertain (the requirement's "
            f"3.5 / 0.15: {100 * meta['uncertain_share_at_requirement_defaults']:.1f}%)\n"
        )
        body = yaml.safe_dump(
            {"cache_policy": policy.model_dump(mode="json", exclude_none=True), "calibration": meta}, sort_keys=False
        )
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(head + body)
        tmp.replace(path)
        return path


def calibrate(
    model: str,
    *,
    text: str | None = None,
    tokens: int | None = None,
    entropy_quantile: float = ENTROPY_QUANTILE,
    gap_quantile: float = GAP_QUANTILE,
    device: str | None = None,
    dtype: str = "auto",
    cache_dir: str | None = None,
    kv_cache_memory: int | str | None = None,
    source: str | None = None,
    kv_cache_dtype: str = "auto",
    host_kv_dtype: str | None = None,
    kv_float_window: int = 0,
) -> Calibration:
    """Score the calibration text with the full cache and keep every scored token's entropy and gap."""
    for name, q in (("entropy", entropy_quantile), ("gap", gap_quantile)):
        if not 0.0 < q < 1.0:
            raise ConfkvError(f"--{name}-quantile must lie strictly between 0 and 1 (got {q})")
    if tokens is not None and tokens < SKIP_TOKENS + 2:
        raise ConfkvError(f"--tokens must be at least {SKIP_TOKENS + 2}")
    llm = LLM(model, "full", device=device, dtype=dtype, cache_dir=cache_dir, kv_cache_memory=kv_cache_memory,
              kv_cache_dtype=kv_cache_dtype, host_kv_dtype=host_kv_dtype, kv_float_window=kv_float_window,
              max_batch_size=8)  # fmt: skip
    if text is None:
        passages, what = default_passages(llm.tokenizer, tokens or 4096)
    else:
        passages, what = file_passages(llm.tokenizer, text, tokens), source or "a text file"
    if not passages:
        raise ConfkvError(f"the calibration text is too short: it needs more than {SKIP_TOKENS + 1} tokens")
    results = llm.score(passages, SKIP_TOKENS)
    entropy = torch.cat([r.entropy for r in results])
    gap = torch.cat([r.gap for r in results])
    return Calibration(model, what, entropy, gap, entropy_quantile, gap_quantile,
                       weights=source_fingerprint(model, cache_dir))  # fmt: skip
