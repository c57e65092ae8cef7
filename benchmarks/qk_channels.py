"""How well a block's keys stand in for the queries, channel by channel.

    python benchmarks/qk_channels.py --tokens 768

fp8's scale search (``Fp8KeyCodec``) weighs each channel's rounding error by the keys' mean square in it, because
the error that matters is in ``q . k`` and no write into the pool sees a query. This reads one held-out passage
through the model (its own attention, with a hook that keeps each layer's queries and keys after RoPE) and reports,
over every layer and KV head: the correlation across channels of the logarithms of the queries' mean square (the
query heads of the group averaged) and the keys', and the share of the queries' energy that falls in the keys'
largest eighth of channels (an eighth if the two were unrelated).
"""

from __future__ import annotations

import statistics

import torch
from common import load, parser, report, setup
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from confkv.bench.corpus import split_passage


def channel_energies(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the queries' and keys' mean square per channel: ``[heads, D]`` and ``[kv_heads, D]``."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module, query, key, value, attention_mask, **kw):
        seen.append((query[0].float().square().mean(1), key[0].float().square().mean(1)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("qk_capture", capture)
    before = model.config._attn_implementation
    model.set_attn_implementation("qk_capture")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.set_attn_implementation(before)
    return seen


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=768)
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    text = split_passage(6 * args.tokens, 0, "heldout")
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens].to(device)
    corr, share = [], []
    for q2, k2 in channel_energies(loaded.model, ids):
        q2 = q2.view(k2.shape[0], -1, k2.shape[-1]).mean(1)  # the query heads that read each KV head
        top = max(1, k2.shape[-1] // 8)
        for q, k in zip(q2, k2, strict=True):
            corr.append(float(torch.corrcoef(torch.stack([q.clamp_min(1e-12).log(), k.clamp_min(1e-12).log()]))[0, 1]))
            share.append(float(q[k.topk(top).indices].sum() / q.sum()))
    result = {**env, "tokens": int(ids.shape[1]), "layer_heads": len(corr)}
    for name, xs in (("log_corr", corr), ("query_share_in_keys_top_eighth", share)):
        result |= {f"{name}_median": statistics.median(xs), f"{name}_min": min(xs), f"{name}_max": max(xs)}
    report(args, result)


if __name__ == "__main__":
    main()
