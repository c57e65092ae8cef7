"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"): keep what the newest query attends to.

Each decode step's attention replaces what was recorded before (summed over layers and heads, where TOVA averages
over heads per layer: confkv keeps one block table for all layers); after the prompt, the prompt's last query.
Chosen as the fifth method because it is the query-aware ranking closest to what the confidence signal itself
reads: the step the model is computing now, not the attention accumulated over a past it may no longer need, which
is where heavy-hitter ranking goes stale in long generations (and kvpress's leaderboard puts it well above
accumulated attention at equal compression)."""

from __future__ import annotations

import torch

from confkv.scorers.base import BlockScorer, BlockView, register


@register
class TOVAScorer(BlockScorer):
    name = "tova"
    prefill_attention = "window"
    decode_attention = "replace"

    @property
    def prefill_window(self) -> int:
        return 1

    def score(self, view: BlockView) -> torch.Tensor:
        return view.mass.sum(dim=-1)
