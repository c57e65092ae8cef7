"""Confidence signals against their definitions, including masked (-inf) logits and half-precision input."""

from __future__ import annotations

import math

import torch

from confkv.confidence import confidence_signals


def test_signals_match_their_definitions():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    s = confidence_signals(logits)
    probs = logits.softmax(-1)
    torch.testing.assert_close(s.entropy, -(probs * probs.log()).sum(-1))
    top = probs.topk(2, -1)
    torch.testing.assert_close(s.top1_prob, top.values[:, 0])
    torch.testing.assert_close(s.gap, top.values[:, 0] - top.values[:, 1])
    assert s.top1_id.tolist() == logits.argmax(-1).tolist()


def test_uniform_and_masked_rows():
    logits = torch.zeros(3, 64)
    logits[1, 8:] = float("-inf")  # 8 equally likely tokens, the rest impossible
    logits[2, 1:] = float("-inf")  # certain
    s = confidence_signals(logits)
    assert torch.isfinite(s.entropy).all()
    torch.testing.assert_close(s.entropy, torch.tensor([math.log(64), math.log(8), 0.0]))
    assert s.gap[2].item() == 1.0 and s.top1_prob[2].item() == 1.0


def test_half_precision_logits_give_float32_signals():
    torch.manual_seed(1)
    logits = torch.randn(4, 200)
    half = confidence_signals(logits.bfloat16())
    assert half.entropy.dtype == torch.float32
    torch.testing.assert_close(half.entropy, confidence_signals(logits.bfloat16().float()).entropy)


def test_rows_selects_the_signals_of_some_rows():
    logits = torch.randn(5, 64)
    picked = confidence_signals(logits).rows([0, 3])
    alone = confidence_signals(logits[[0, 3]])
    for name in ("entropy", "gap", "top1_prob", "top1_id", "logprobs"):
        torch.testing.assert_close(getattr(picked, name), getattr(alone, name))


def test_the_greedy_token_of_a_tie_is_the_first_as_in_hugging_face():
    """Exact ties at the top happen with bf16/fp16 logits; Hugging Face's greedy search takes ``argmax``, the first
    of them."""
    logits = torch.zeros(3, 50_000)
    logits[0, [7, 31_000]] = 5.0
    logits[1, [49_999, 2, 30]] = 1.0
    logits[2, 123] = 9.0
    s = confidence_signals(logits.to(torch.bfloat16))
    assert s.top1_id.tolist() == [7, 2, 123] == logits.argmax(-1).tolist()
    assert float(s.gap[0]) == 0.0
