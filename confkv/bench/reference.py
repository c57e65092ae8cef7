"""Full-cache references, computed once per (model, item, code version) and kept on disk.

Every policy is judged against the ``full`` cache: its greedy continuation (for BLEU/ROUGE and teacher forcing),
and its top-k next-token log-probabilities at every scored position (for KL). Computing them is the expensive
part of an evaluation, and they do not depend on the policy under test, so they are stored under
``$CONFKV_CACHE/references/<model key>/<item key>.safetensors`` and reused by every later run (benchmarks, tuner).
Bump ``REFERENCE_VERSION`` whenever the way references are computed changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from confkv.bench.scored import score_items
from confkv.engine.params import SamplingParams
from confkv.llm import LLM
from confkv.model_loader import cache_root
from confkv.progress import Stage, stage
from confkv.scoring import REFERENCE_TOPK, ScoreItem, TopK

REFERENCE_VERSION = 1


@dataclass
class Reference:
    """What the full cache does on one item.

    ``continuation``: full's greedy output tokens (empty for pure scoring items). ``topk`` and ``token_logprobs``
    cover the scored tokens of ``scored_ids`` from ``score_from`` on: the item's own text for scoring items, the
    prompt plus full's continuation for generation items.
    """

    continuation: list[int]
    text: str
    scored_ids: list[int]
    score_from: int
    topk: TopK
    token_logprobs: torch.Tensor

    @property
    def ppl(self) -> float:
        return float((-self.token_logprobs.mean()).exp())


def model_key(llm: LLM) -> str:
    """Name plus a hash of the architecture, the files the weights came from (a model re-exported in place under
    the same config), the generation config (its EOS tokens end full's answers), dtype, device type and (for
    generated models) seed: references never mix models, and fp32 on a GPU is not taken for fp32 on the CPU."""
    from confkv.model_loader import source_fingerprint

    e = llm.engine
    blob = json.dumps(
        {
            "name": e.loaded.name,
            "config": e.model.config.to_dict(),
            "source": source_fingerprint(e.loaded.name, e.config.cache_dir),
            "generation": sorted(e.loaded.eos_token_ids),
            "dtype": str(next(e.model.parameters()).dtype),
            "device": e.device.type,
            "seed": e.config.seed,
        },
        sort_keys=True,
        default=str,
    )
    slug = Path(e.loaded.name).name.replace(os.sep, "_") or "model"
    return f"{slug}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def item_key(prompt_ids: list[int] | tuple[int, ...], max_tokens: int, score_from: int | None, topk: int) -> str:
    blob = json.dumps([REFERENCE_VERSION, list(prompt_ids), max_tokens, score_from, topk])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class ReferenceStore:
    """A folder of references for one model."""

    def __init__(self, llm: LLM, root: str | Path | None = None) -> None:
        base = Path(root) if root is not None else cache_root() / "references"
        self.folder = base / model_key(llm)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def get(self, key: str) -> Reference | None:
        p = self.path(key)
        if not p.is_file():
            return None
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(p))
        doc = json.loads(meta["reference"])
        return Reference(
            continuation=doc["continuation"],
            text=doc["text"],
            scored_ids=doc["scored_ids"],
            score_from=doc["score_from"],
            topk=TopK(tensors["topk_ids"], tensors["topk_logprobs"]),
            token_logprobs=tensors["token_logprobs"],
        )

    def put(self, key: str, ref: Reference) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        doc = {
            "continuation": ref.continuation,
            "text": ref.text,
            "scored_ids": ref.scored_ids,
            "score_from": ref.score_from,
        }
        tmp = self.path(key).with_suffix(".tmp")
        save_file(
            {
                "topk_ids": ref.topk.ids.contiguous(),
                "topk_logprobs": ref.topk.logprobs.contiguous(),
                "token_logprobs": ref.token_logprobs.contiguous(),
            },
            str(tmp),
            metadata={"reference": json.dumps(doc)},
        )
        tmp.replace(self.path(key))


def build_references(
    full: LLM,
    items: list[tuple[list[int], int, int | None]],
    store: ReferenceStore | None = None,
    *,
    topk: int = REFERENCE_TOPK,
    use_tqdm: bool = False,
    label: str = "full-cache references",
) -> list[Reference]:
    """References for ``(prompt_ids, max_tokens, score_from)`` triples, from the store where present.

    ``score_from`` set: a scoring item (the prompt is the text, scored from that index; ``max_tokens`` unused).
    ``score_from`` None: a generation item: full generates ``max_tokens`` greedily (EOS ends it early), then the
    prompt plus that continuation is scored from the prompt's end. The items not in the store are a progress stage
    named ``label`` (``confkv.progress``), counted as they are scored; ``use_tqdm`` also draws the engine's bars.
    """
    if full.policy.controller != "full":
        raise ValueError("references come from the full cache")
    keys = [item_key(p, m, s, topk) for p, m, s in items]
    out: list[Reference | None] = [store.get(k) if store else None for k in keys]
    missing = [i for i, r in enumerate(out) if r is None]
    if not missing:
        return [r for r in out if r is not None]
    with stage(label, total=len(missing), unit="items") as progress:
        _compute(full, items, missing, out, keys, store, topk, use_tqdm, progress)
    return [r for r in out if r is not None]


def _compute(
    full: LLM,
    items: list[tuple[list[int], int, int | None]],
    missing: list[int],
    out: list[Reference | None],
    keys: list[str],
    store: ReferenceStore | None,
    topk: int,
    use_tqdm: bool,
    progress: Stage,
) -> None:
    """Generate full's answers to the generation items, then score every missing item, filling ``out``."""
    gen = [i for i in missing if items[i][2] is None]
    continuations: dict[int, tuple[list[int], str]] = {}
    if gen:
        progress.set_note(f"generating full's answers to {len(gen)}")
        params = [SamplingParams(max_tokens=items[i][1]) for i in gen]
        outs = full.generate([list(items[i][0]) for i in gen], params, use_tqdm=use_tqdm)
        continuations = {i: (o.token_ids, o.text) for i, o in zip(gen, outs, strict=True)}
        progress.set_note("scoring")
    to_score = []
    for i in missing:
        prompt, _, score_from = items[i]
        if score_from is None:
            ids = list(prompt) + continuations[i][0]
            start = len(prompt)
            if len(ids) <= start:  # full ended at once: score the end-of-sequence token it chose
                ids.append(full.engine.tokenizer.eos_token_id or 0)
        else:
            ids, start = list(prompt), score_from
        to_score.append(ScoreItem(ids, start))
    scored = score_items(full.engine, to_score, keep_topk=topk, on_done=lambda _: progress.update(1))
    for i, item, res in zip(missing, to_score, scored, strict=True):
        cont, text = continuations.get(i, ([], ""))
        assert res.topk is not None
        ref = Reference(cont, text, item.token_ids, item.score_from, res.topk, res.token_logprobs)
        out[i] = ref
        if store is not None:
            store.put(keys[i], ref)
