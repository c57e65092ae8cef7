"""Model families beyond Llama, on tiny random configs built in code: run exactly or be refused at load.

Random weights hide attention bugs from greedy tokens (a wrong sliding window can leave every argmax unchanged), so
each family is checked twice: ``full`` greedy output equals Hugging Face ``generate``, and the teacher-forced
log-probabilities equal Hugging Face's own forward pass.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

from confkv import LLM, SamplingParams
from confkv.cli import main
from confkv.errors import UnsupportedModelError
from confkv.model_loader import tiny_random_tokenizer

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, initializer_range=0.3,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
TEXT = "Sliding windows and biases must be handled by the attention function, or refused. " * 3  # ~250 tokens


def _folder(tmp_path, config) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    tiny_random_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


def _hf(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(Qwen2Config(**COMMON), id="qwen2"),
        pytest.param(MistralConfig(**COMMON, sliding_window=32), id="mistral-sliding-32"),
        pytest.param(
            Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=48, max_window_layers=1),
            id="qwen2-sliding-layer1",
        ),
    ],
)
def test_full_matches_hugging_face(tmp_path, config):
    folder = _folder(tmp_path, config)
    hf = _hf(folder)
    ids = list(tiny_random_tokenizer()(TEXT)["input_ids"])
    assert len(ids) > 4 * (getattr(config, "sliding_window", None) or 0)

    llm = LLM(folder, "full", max_num_batched_tokens=64)  # several prefill chunks, then decode
    out = llm.generate(ids, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    assert out.token_ids == ref

    (scored,) = llm.score([ids], score_from=1)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    ref_lp = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(scored.token_logprobs, ref_lp, atol=1e-4)


def test_soft_capping_is_refused_at_load(tmp_path, capsys):
    folder = _folder(tmp_path, Gemma2Config(**COMMON, attn_logit_softcapping=50.0, sliding_window=64))
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        LLM(folder, "full")
    capsys.readouterr()
    assert main(["generate", "--model", folder, "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("confkv: error:") and "soft-capping (softcap=50.0)" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("config", "what"),
    [
        pytest.param(
            Phi3Config(**{**COMMON, "max_position_embeddings": 256}, original_max_position_embeddings=32,
                       rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [8.0] * 8}),
            "'longrope'", id="phi3-longrope",
        ),
        pytest.param(LlamaConfig(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic'",
                     id="llama-dynamic-ntk"),
    ],
)  # fmt: skip
def test_rope_scaling_that_follows_the_batch_is_refused_at_load(tmp_path, capsys, config, what):
    """Dynamic and long-RoPE scaling pick their frequencies from the longest position in a forward pass: in a
    packed batch a short request would be rotated by another's length, and a chunked prompt unlike Hugging Face's
    whole one. Refused at load, in one line."""
    folder = _folder(tmp_path, config)
    with pytest.raises(UnsupportedModelError, match="RoPE scaling"):
        LLM(folder, "full")
    capsys.readouterr()
    assert main(["generate", "--model", folder, "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("confkv: error:") and what in err and len(err.splitlines()) == 1


def test_attention_layer_types_without_a_mask_here_are_refused():
    from confkv.kv.attention import config_refusal

    assert config_refusal(Qwen2Config(**COMMON)) is None
    assert config_refusal(MistralConfig(**COMMON, sliding_window=32)) is None
    chunked = Qwen2Config(**COMMON)
    chunked.layer_types = ["chunked_attention", "full_attention"]  # Llama 4's, which lives only in the dense mask
    assert "chunked_attention" in config_refusal(chunked)
