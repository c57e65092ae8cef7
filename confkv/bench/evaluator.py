"""The ``Evaluator``: one loaded model, a suite's workloads and their full-cache references, and each measure of
a policy on them (teacher-forced scoring, retrieval, free long generation, batch throughput). The tuner's
scripts and ``benchmarks/`` use it as ``confkv bench`` does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from confkv.bench.memory import Usage, token_bytes
from confkv.bench.reference import Reference, ReferenceStore, build_references
from confkv.bench.specs import TEACHER_FORCED, SuiteSpec
from confkv.bench.textmetrics import bleu4, rouge_l
from confkv.bench.workloads import WorkloadItem, make_workload
from confkv.config import CachePolicy
from confkv.engine.params import SamplingParams
from confkv.kv.pool import BlockPool
from confkv.llm import LLM
from confkv.model_loader import LoadedModel, load_model
from confkv.scoring import ScoreItem, Scorer


def _nvml_peak(device: torch.device) -> int | None:
    """Device memory in use now (NVML), when a GPU runs the benchmark; ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # pynvml missing or no driver: the column stays empty
        return None


@dataclass
class Workloads:
    passkey: list[WorkloadItem]
    multikey: list[WorkloadItem]
    prose: list[WorkloadItem]
    longgen: list[WorkloadItem]
    chat: list[WorkloadItem]


def build_workloads(tokenizer: Any, spec: SuiteSpec, split: str, seed: int) -> Workloads:
    def make(name: str) -> list[WorkloadItem]:
        sizes = dict(getattr(spec, name))
        n = sizes.pop("n")
        return make_workload(name, tokenizer, split=split, n=n, seed=seed, **sizes)

    return Workloads(*(make(name) for name in ("passkey", "multikey", "prose", "longgen", "chat")))


@dataclass
class Evaluator:
    """Measures policies on fixed workloads against stored full-cache references (also used by the tuner)."""

    loaded: LoadedModel
    model: str
    spec: SuiteSpec
    workloads: Workloads
    references: dict[str, list[Reference]]
    #: Engine settings every measured engine gets unless a measure sets its own (``device``, ``kv_cache_memory``).
    engine: dict[str, Any] = field(default_factory=dict)
    progress: bool = False

    @classmethod
    def prepare(
        cls,
        model: str,
        spec: SuiteSpec,
        *,
        split: str = "heldout",
        seed: int = 0,
        device: str | None = None,
        dtype: str = "auto",
        cache_dir: str | None = None,
        kv_cache_memory: int | str | None = None,
        kv_cache_dtype: str = "auto",
        host_kv_dtype: str | None = None,
        kv_float_window: int = 0,
        loaded: LoadedModel | None = None,
        reference_root: str | Path | None = None,
        progress: bool = False,
    ) -> Evaluator:
        """Load the model (the engine's device rule: ``--device``, else CUDA when present), build the workloads and
        the full-cache references. The references are always ``full`` at ``kv_cache_dtype: auto``; every measured
        engine stores its KV at ``kv_cache_dtype``, so a quantised ``full`` is measured against the exact one."""
        loaded = loaded or load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, seed=seed)
        engine = {"seed": seed, **({"kv_cache_memory": kv_cache_memory} if kv_cache_memory is not None else {})}
        full = LLM(model, "full", loaded=loaded, **engine)
        wl = build_workloads(loaded.tokenizer, spec, split, seed)
        store = ReferenceStore(full, reference_root)
        refs: dict[str, list[Reference]] = {}
        for name in TEACHER_FORCED:
            items = getattr(wl, name)
            triples = [(list(it.prompt_ids), it.max_tokens, it.score_from if name == "prose" else None) for it in items]
            if name == "prose":
                triples = [(p, 0, max(1, s or 1)) for p, _, s in triples]
            refs[name] = build_references(full, triples, store, use_tqdm=progress, label=f"references: {name}")
        measured = {
            **engine,
            "kv_cache_dtype": kv_cache_dtype,
            "host_kv_dtype": host_kv_dtype,
            "kv_float_window": kv_float_window,
        }
        return cls(loaded, model, spec, wl, refs, measured, progress)

    def llm(self, policy: CachePolicy, **engine: Any) -> LLM:
        return LLM(self.model, policy, loaded=self.loaded, **{**self.engine, **engine})

    def at(self, kv_cache_dtype: str | None) -> Evaluator:
        """This evaluator with its measured engines at ``kv_cache_dtype`` (a row's own dtype; None: unchanged). The
        workloads and references are shared, so rows at different dtypes are measured against the same ones."""
        if kv_cache_dtype is None:
            return self
        return dataclasses.replace(self, engine={**self.engine, "kv_cache_dtype": kv_cache_dtype})

    def usage(self, mode: Literal["chunked", "decode"], policy: CachePolicy) -> Usage:
        """An empty ``Usage`` that knows a token's bytes at the model's dtype (the byte fractions' denominator)."""
        return Usage(mode, auto_bytes_per_token=token_bytes(self.loaded, "auto", policy.block_size))

    # ----------------------------------------------------------------------------------------------- measures
    def score_workload(self, policy: CachePolicy, name: str) -> tuple[dict[str, Any], Usage]:
        """One teacher-forced workload: KL to full per token (and perplexity on prose), and its resident KV."""
        refs = self.references[name]
        results = Scorer(self.llm(policy).engine).score(
            [ScoreItem(r.scored_ids, r.score_from, r.topk) for r in refs], use_tqdm=self.progress
        )
        usage = self.usage("chunked", policy)
        for ref, res in zip(refs, results, strict=True):
            usage.add_scored(res, len(ref.scored_ids))
        kl_sum = sum(float(r.kl.sum()) for r in results if r.kl is not None)
        tokens = sum(r.num_tokens for r in results)
        out: dict[str, Any] = {"kl_mean": kl_sum / tokens, "kl_sum": kl_sum, "tokens": tokens}
        if name == "prose":
            out["ppl"] = math.exp(float(-torch.cat([r.token_logprobs for r in results]).mean()))
            out["ppl_full"] = math.exp(float(-torch.cat([r.token_logprobs for r in refs]).mean()))
            out["ppl_delta_rel"] = out["ppl"] / out["ppl_full"] - 1.0
        return out, usage

    def retrieve(self, policy: CachePolicy, name: str) -> tuple[dict[str, Any], Usage]:
        """One retrieval workload generated freely: accuracy (per filler for pass-key), its grid, resident KV."""
        items = getattr(self.workloads, name)
        outs = self.llm(policy).generate(
            [list(it.prompt_ids) for it in items],
            [SamplingParams(max_tokens=it.max_tokens) for it in items],
            use_tqdm=self.progress,
        )
        usage = self.usage("decode", policy)
        for o in outs:
            usage.add_generated(o)
        correct = [bool(it.correct(o.text)) for it, o in zip(items, outs, strict=True)]
        out: dict[str, Any] = {
            "acc": sum(correct) / len(correct),
            # the engine's own mean (every generated token, the first included), kept for older readers
            "kv_fraction_engine": sum(o.kv["mean_resident_tokens"] for o in outs)
            / sum(o.prompt_tokens + (o.generated_tokens - 1) / 2 for o in outs),
        }
        if name == "passkey":
            out["grid"] = [
                {
                    "length": it.meta.get("length"),
                    "depth": it.meta.get("depth"),
                    "filler": it.meta.get("filler", "repeat"),
                    "correct": c,
                }
                for it, c in zip(items, correct, strict=True)
            ]
            by_filler: dict[str, list[bool]] = {}
            for cell in out["grid"]:
                by_filler.setdefault(cell["filler"], []).append(cell["correct"])
            out["acc_by_filler"] = {k: sum(v) / len(v) for k, v in by_filler.items()}
        return out, usage

    def generate_long(self, policy: CachePolicy, full_texts: list[str] | None) -> tuple[dict[str, Any], Usage]:
        """Long answers generated freely (EOS ignored, so every policy writes the same number of tokens): speed, a
        per-token trace, resident KV and, given full's texts, BLEU-4 and ROUGE-L against them."""
        items = self.workloads.longgen
        llm = self.llm(policy, max_batch_size=len(items))
        n = self.spec.free_tokens
        t0 = time.perf_counter()
        outs = llm.generate(
            [list(it.prompt_ids) for it in items], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=self.progress
        )
        elapsed = time.perf_counter() - t0
        usage = self.usage("decode", policy)
        for o in outs:
            usage.add_generated(o)
        tr = outs[0].trace
        out: dict[str, Any] = {
            "tokens_per_s": sum(o.generated_tokens for o in outs) / elapsed,
            "seconds": elapsed,
            "texts": [o.text for o in outs],
            "trace": {
                "resident": tr.resident,
                "budget": tr.budget,
                "entropy": tr.entropy,
                "gap": tr.gap,
                "expanded": tr.expanded,
                # token i is computed over the prompt and the i tokens before it (the first in the prompt's last chunk)
                "full_tokens": [outs[0].prompt_tokens + i for i in range(len(tr.resident))],
            },
            "nvml_peak_bytes": _nvml_peak(llm.engine.device),
        }
        if full_texts is not None:
            out["bleu4_vs_full"] = bleu4(out["texts"], full_texts)
            out["rougeL_vs_full"] = rouge_l(out["texts"], full_texts)
        return out, usage

    # ------------------------------------------------------------------------------------- serving measure
    def batch_throughput(self, policy: CachePolicy) -> dict[str, Any]:
        """Requests/s under a KV pool that holds at most a third of ``max_batch_size`` full-cache sequences."""
        b = self.spec.batch
        prose = self.workloads.prose
        base = [list(it.prompt_ids) for it in prose]
        prompts = []
        for i in range(b["requests"]):
            ids = base[i % len(base)]
            off = (i * 37) % max(1, len(ids) - b["prompt_tokens"])
            prompts.append(ids[off : off + b["prompt_tokens"]])
        # bytes of the model's dtype: a quantised kv_cache_dtype gets the same bytes, so more tokens (matched on bytes)
        block_bytes = BlockPool.bytes_per_block_for(
            *BlockPool.geometry(self.loaded.model.config), policy.block_size, next(self.loaded.model.parameters()).dtype
        )
        per_seq = -(-(b["prompt_tokens"] + b["max_tokens"]) // policy.block_size)
        fits = max(1, b["max_batch_size"] // 3)
        pool_bytes = (fits * per_seq + 1) * block_bytes
        llm = self.llm(policy, kv_cache_memory=pool_bytes, max_batch_size=b["max_batch_size"])
        t0 = time.perf_counter()
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=b["max_tokens"], ignore_eos=True), use_tqdm=self.progress
        )
        elapsed = time.perf_counter() - t0
        return {
            "requests_per_s": len(outs) / elapsed,
            "batch_pool_blocks": llm.engine.pool.num_blocks,
            "batch_preemptions": llm.engine.scheduler.preemptions,
        }
