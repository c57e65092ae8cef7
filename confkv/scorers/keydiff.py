"""KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference"):
keep the keys that differ most from the rest. Keys that point the way most keys point add little a query could not
find elsewhere, so a token's score is minus the cosine similarity of its key to the mean direction of the
sequence's evictable keys (per layer and KV head), and a block's score is its tokens' mean over layers and heads.
Like ``knorm`` it needs nothing recorded, so decode keeps the fused attention kernel and the ranking does not depend
on which queries happened to come; unlike ``knorm`` it looks at direction, not length."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from confkv.scorers.base import BlockScorer, BlockView, register


@register
class KeyDiffScorer(BlockScorer):
    name = "keydiff"

    def score(self, view: BlockView) -> torch.Tensor:
        keys = F.normalize(view.keys().float(), dim=-1)  # [layers, n, bs, kvh, D]
        anchor = F.normalize(keys.mean(dim=(1, 2), keepdim=True), dim=-1)  # the mean direction per layer and head
        similarity = (keys * anchor).sum(dim=-1)  # [layers, n, bs, kvh]
        return -similarity.mean(dim=(0, 2, 3))
