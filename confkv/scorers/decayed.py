"""Decayed attention: heavy hitters whose votes fade, between H2O (nothing fades) and TOVA (only the newest counts).

The prompt's last ``snapkv_window`` queries vote as in SnapKV; then every decode step multiplies what was recorded
by ``attention_decay`` before adding its own query's attention, so a block's score is an exponential moving sum of
the attention it received (half-life ``ln 2 / -ln attention_decay`` steps: about 14 at the default 0.95). Chosen
because the narrow-swing rankings in BENCHMARKS.md trade one workload against another: TOVA's newest-query ranking
leads forced long generation but trails prose, where accumulated and prompt-selected rankings do better; a decayed
record keeps the recent steps' consensus without H2O's staleness, and its one knob spans the two.
Teacher-forced chunks of output count their queries alike and decay what came before by the chunk's length.
"""

from __future__ import annotations

import torch

from confkv.scorers.base import BlockScorer, BlockView, register


@register
class DecayedScorer(BlockScorer):
    name = "decayed"
    prefill_attention = "window"
    decode_attention = "decay"

    @property
    def decode_decay(self) -> float:
        return self.policy.attention_decay

    def score(self, view: BlockView) -> torch.Tensor:
        return view.mass.sum(dim=-1)
