"""SnapKV (Li et al. 2024): the prompt's last ``snapkv_window`` queries (the question, in a chat) vote for the
tokens they attend to; votes are smoothed over neighbouring tokens (average pooling, kernel 5, as kvpress does) so
that a selected token keeps its context. Decode attention is not recorded: the selection made at the end of the
prompt stays and generated tokens slide.

A prompt longer than the policy keeps is read chunk by chunk, as kvpress's ``ChunkPress`` applies a press: each
chunk's last queries vote and the prompt is trimmed to the policy's size before the next chunk, whose vote replaces
this one's. So a sequence never holds more than its size plus one chunk (what admission reserves), and a prompt that
fits is selected by its own last queries exactly as in the paper."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from confkv.scorers.base import BlockScorer, BlockView, register

POOL_KERNEL = 5


@register
class SnapKVScorer(BlockScorer):
    name = "snapkv"
    prefill_attention = "window"

    def score(self, view: BlockView) -> torch.Tensor:
        mass = view.mass.float()  # [n, bs]
        flat = mass.reshape(1, 1, -1)
        pooled = F.avg_pool1d(flat, POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2, count_include_pad=False)
        return pooled.reshape(mass.shape).sum(dim=-1)
