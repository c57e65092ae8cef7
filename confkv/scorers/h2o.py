"""Heavy hitters (H2O, Zhang et al. 2023): the attention a block has received, accumulated over the prompt's
queries (a strided sample of them, see ``confkv.kv.attention.PREFILL_VOTE_STRIDE``) and every decode step."""

from __future__ import annotations

import torch

from confkv.scorers.base import BlockScorer, BlockView, register


@register
class H2OScorer(BlockScorer):
    name = "h2o"
    prefill_attention = "all"
    decode_attention = "accumulate"

    def score(self, view: BlockView) -> torch.Tensor:
        return view.mass.sum(dim=-1)
