"""Next-token choice: greedy rows reuse the top-1 id the confidence pass already found; sampled rows apply
temperature, top-k and top-p and draw with the request's own generator, so a seeded request gives the same
tokens whatever else shares its batch."""

from __future__ import annotations

import torch

from confkv.confidence import Signals
from confkv.engine.params import SamplingParams


def _filtered_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scaled = logits.float() / p.temperature
    if p.top_k and p.top_k < scaled.numel():
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p; the first token always stays
        drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
        drop[0] = False  # a top_p below float32's range rounds to 0, which the first token's 0 would reach
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scaled, dim=-1)


def sample(
    logits: torch.Tensor,
    signals: Signals,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, dict[int, str]]:
    """One token id per row of ``logits`` (``[rows, vocab]``), on the logits' device, and the rows that could not
    be sampled (non-finite logits, say) with the reason: those requests fail alone."""
    tokens = signals.top1_id.clone()
    errors: dict[int, str] = {}
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        try:
            probs = _filtered_logprobs(logits[row], p).exp()
            tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
        except RuntimeError as err:
            errors[row] = f"sampling failed: {err}"
    return tokens, errors
