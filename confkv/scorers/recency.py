"""Recency: the newest blocks are worth most (a sliding window; with sinks, StreamingLLM)."""

from __future__ import annotations

import torch

from confkv.scorers.base import BlockScorer, BlockView, register


@register
class RecencyScorer(BlockScorer):
    name = "recency"

    def score(self, view: BlockView) -> torch.Tensor:
        return torch.tensor(view.logical, dtype=torch.float32)
