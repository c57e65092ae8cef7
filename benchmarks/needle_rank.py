"""Where the question's attention puts the block that holds the answer, over the whole prompt (nothing evicted).

    python benchmarks/needle_rank.py --queries 1,8,32

For the standard suite's held-out multi-key prompts and its 2,000-token pass-key prompts over prose, a plain
Hugging Face forward pass (SDPA) records the attention of the prompt's last ``W`` queries; every 16-token block
between the sink block and the last 8 blocks (what a policy may evict) is then ranked three ways:

* ``sum``: attention summed over layers, heads and queries (what SnapKV's vote and ``recall`` rank by);
* ``max``: each head's share of attention among those blocks, the largest over layers and heads (what
  ``reselect_after_prompt`` ranks by);
* ``top10``: the same shares, summed over the ten heads that give the block most.

Rank 1 means the answer's block is the first a policy keeping a few blocks would keep. This is what motivated
``CacheManager.reselect``: whether a policy that keeps ~20 of ~150 blocks can keep the record the question asks for.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from confkv.bench.workloads import make_workload
from confkv.model_loader import load_model

BLOCK, RECENT_BLOCKS = 16, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--queries", default="1,8,32", help="comma-separated: how many of the prompt's last queries vote")
    args = p.parse_args()
    windows = [int(w) for w in args.queries.split(",")]
    recorded: list[torch.Tensor] = []
    window = [1]

    def recording(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):  # type: ignore[no-untyped-def]
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)
        w, t = window[0], key.shape[2]
        q = query[0, :, -w:].float()  # [heads, w, D]
        k = key[0].float().repeat_interleave(query.shape[1] // key.shape[1], 0)  # [heads, T, D]
        s = torch.einsum("hwd,htd->hwt", q, k) * scaling
        s.masked_fill_(torch.arange(t)[None, None, :] > torch.arange(t - w, t)[None, :, None], float("-inf"))
        recorded.append(s.softmax(-1).sum(dim=1))  # [heads, T]
        return out

    AttentionInterface.register("needle_rank", recording)
    lm = load_model(args.model, device="cpu")
    model, tok = lm.model, lm.tokenizer
    model.config._attn_implementation = "needle_rank"
    items = make_workload("multikey", tok, "heldout", n=4, length=2500, num_pairs=6)
    items += make_workload("passkey", tok, "heldout", n=1, lengths=(2000,), depths=(0.1, 0.5, 0.9), filler="prose")
    print(f"{'item':<22} {'depth':>5} {'block':>9}  " + "  ".join(f"W={w}: sum / max / top10" for w in windows))
    for it in items:
        ids = list(it.prompt_ids)
        pieces = [tok.decode([t]) for t in ids]
        starts, text = [], ""
        for piece in pieces:
            starts.append(len(text))
            text += piece
        at = text.find(it.answer)
        answer_block = max(i for i, s in enumerate(starts) if s <= at) // BLOCK
        n_blocks = (len(ids) + BLOCK - 1) // BLOCK
        evictable = list(range(1, n_blocks - RECENT_BLOCKS))
        cells = []
        for w in windows:
            window[0] = w
            recorded.clear()
            with torch.inference_mode():
                model(torch.tensor([ids]))
            per_head = torch.cat(recorded)  # [layers * heads, T]
            blocks = torch.zeros(per_head.shape[0], n_blocks)
            blocks.index_add_(1, torch.arange(len(ids)) // BLOCK, per_head)
            raw = blocks[:, evictable]  # [layers * heads, blocks]: attention as recorded
            share = raw / raw.sum(dim=1, keepdim=True).clamp_min(1e-12)  # each head's share among these blocks
            ranks = []
            for score in (raw.sum(0), share.amax(0), share.topk(10, dim=0).values.sum(0)):
                order = sorted(range(len(evictable)), key=lambda j: -float(score[j]))
                ranks.append(order.index(evictable.index(answer_block)) + 1)
            cells.append(f"{ranks[0]:>4} / {ranks[1]:>3} / {ranks[2]:>3}")
        print(f"{it.item_id:<22} {it.meta.get('depth', 0):>5} {answer_block:>4}/{n_blocks:<4}  "
              + "  ".join(f"{c:>22}" for c in cells), flush=True)  # fmt: skip
    print(f"(ranks among the {BLOCK}-token blocks between the sink block and the last {RECENT_BLOCKS}: n_blocks - "
          f"{RECENT_BLOCKS + 1} of them; 1 = kept first)")  # fmt: skip


if __name__ == "__main__":
    main()
