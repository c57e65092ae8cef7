"""Key norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"): keys
with a small L2 norm draw the most attention, so a block's score is minus its keys' mean norm over layers, heads
and tokens. Needs nothing recorded: the keys are in the pool."""

from __future__ import annotations

import torch

from confkv.scorers.base import BlockScorer, BlockView, register


@register
class KeyNormScorer(BlockScorer):
    name = "knorm"

    def score(self, view: BlockView) -> torch.Tensor:
        keys = view.keys().float()  # [layers, n, bs, kvh, D]
        return -keys.norm(dim=-1).mean(dim=(0, 2, 3))
