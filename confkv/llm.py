"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from confkv.config import CachePolicy, make_engine_config
from confkv.engine.engine import LLMEngine
from confkv.engine.params import SamplingParams
from confkv.engine.sequence import RequestOutput
from confkv.errors import ConfkvError
from confkv.model_loader import LoadedModel
from confkv.policy_source import PolicyFollower, choose_policy
from confkv.sessions.state import SessionOptions

if TYPE_CHECKING:
    from confkv.scoring import ScoreResult


class LLM:
    """A model plus a KV cache policy, ready to generate.

    ``policy`` is a controller name (``"dynamic"``, ``"full"``, ...) or a ``CachePolicy``; ``policy_file`` a YAML
    file with a ``cache_policy:`` mapping; any other keyword that names a policy key (``max_size=2048``) overrides
    it. ``kv_cache_memory`` sizes the device pool in bytes (``"1GiB"``); unset, a quarter of free memory.
    ``kv_cache_dtype`` is how the pool stores K and V: ``"auto"`` (the model's dtype), ``"int8"``, ``"fp8"`` or
    ``"int4"`` (quantised as they are written; the same bytes hold 4-6x the tokens); ``host_kv_dtype`` (default: the
    same) how the host tier and session records store them, when more compact than the pool. ``kv_float_window``
    (tokens, default 0) keeps each sequence's newest tokens also in the model's dtype beside a quantised pool, read
    exactly by attention (``confkv/kv/window.py``); no effect at ``"auto"``.

    ``policy_file`` may be a registry reference (``"registry://NAME@production"``, see ``store.refs``): the
    version the alias points at is loaded, and unless ``policy_watch_interval_s`` is None a ``PolicyFollower``
    (``confkv.policy_source``) follows the alias (polling at that interval; at once on PostgreSQL's NOTIFY) and
    hands each new version to the engine, which swaps it in between two steps. ``close()`` stops it.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        policy: str | CachePolicy | None = None,
        *,
        policy_file: str | Path | None = None,
        kv_cache_memory: int | str | None = None,
        kv_cache_dtype: str = "auto",
        host_kv_dtype: str | None = None,
        kv_float_window: int = 0,
        max_batch_size: int = 32,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        device: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        cache_dir: str | None = None,
        pack_weights: bool = True,
        admission: str = "on_demand",
        loaded: LoadedModel | None = None,
        registry_url: str | None = None,
        policy_watch_interval_s: float | None = 5.0,
        sessions: SessionOptions | None = None,
        **policy_overrides: Any,
    ) -> None:
        self.policy_watcher: PolicyFollower | None = None
        # the model's calibrated thresholds, when it has them, for the default policy
        choice = choose_policy(policy, policy_file, policy_overrides or None, model=model, cache_dir=cache_dir,
                               registry_url=registry_url)  # fmt: skip
        config = make_engine_config(
            {
                "model": model,
                "device": device,
                "dtype": dtype,
                "kv_cache_memory": kv_cache_memory,
                "kv_cache_dtype": kv_cache_dtype,
                "host_kv_dtype": host_kv_dtype,
                "kv_float_window": kv_float_window,
                "max_batch_size": max_batch_size,
                "max_num_batched_tokens": max_num_batched_tokens,
                "max_model_len": max_model_len,
                "seed": seed,
                "cache_dir": cache_dir,
                "pack_weights": pack_weights,
                "admission": admission,
            }
        )
        self.engine = LLMEngine(config, choice.policy, loaded=loaded, policy_info=choice.info, sessions=sessions)
        self._batches = itertools.count()
        if choice.resolved is not None and choice.followable and policy_watch_interval_s is not None:
            engine = self.engine
            self.policy_watcher = PolicyFollower(
                choice,
                lambda p, info: engine.request_policy(p, source=info["source"] or "", version=info["version"],
                                                      name=info["name"]),
                engine.record_refused_policy,
                interval_s=policy_watch_interval_s,
                registry_url=registry_url,
            ).start()  # fmt: skip

    def close(self) -> None:
        """Stop following a registry alias and the session writer (sessions with a store: ``flush_sessions``
        first to keep them)."""
        watcher, self.policy_watcher = getattr(self, "policy_watcher", None), None
        if watcher is not None:
            watcher.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def policy(self) -> CachePolicy:
        return self.engine.policy

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
        use_tqdm: bool = False,
        session_id: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs come back in prompt order.

        ``session_id`` (one per prompt, or one for a single prompt) continues sessions: each prompt is the whole
        conversation so far and reuses the KV its session kept (``RequestOutput.cached_tokens``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            raise ConfkvError("no prompts given")
        sessions = session_id if isinstance(session_id, list) else [session_id] * len(prompts)
        if len(sessions) != len(prompts):
            raise ConfkvError(f"{len(sessions)} session ids for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ConfkvError(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
        engine = self.engine
        batch = next(self._batches)
        ids = [f"gen-{batch}-{i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p, sid in zip(ids, prompts, params, sessions, strict=True):
                engine.add_request(rid, prompt, p, chat=chat, session_id=sid)
        except ConfkvError:
            for rid in ids:
                engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while len(done) < len(prompts):
                for out in engine.step():
                    if out.finished and out.output is not None and out.request_id in ids:
                        done[out.request_id] = out.output
                        bar.update(1)
        return [done[rid] for rid in ids]

    def score(
        self,
        texts: list[str] | list[list[int]],
        score_from: int | list[int] = 1,
        *,
        use_tqdm: bool = False,
    ) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of each text under this policy (see ``confkv.scoring``)."""
        from confkv.scoring import ScoreItem, Scorer

        starts = [score_from] * len(texts) if isinstance(score_from, int) else list(score_from)
        items = []
        for text, start in zip(texts, starts, strict=True):
            ids = list(self.engine.tokenizer(text)["input_ids"]) if isinstance(text, str) else [int(t) for t in text]
            items.append(ScoreItem(ids, start))
        return Scorer(self.engine).score(items, use_tqdm=use_tqdm)

    def chat(
        self,
        messages: str | list[str] | list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
        session_id: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Chat through the model's template: user messages (one turn each), or conversations (lists of
        ``{"role", "content"}`` turns, system and assistant included), one output per message or conversation."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]  # type: ignore[list-item]
        if isinstance(messages, list) and messages and isinstance(messages[0], list):
            ids = [self.engine.tokenize_messages(conv) for conv in messages]  # type: ignore[arg-type]
            return self.generate(ids, sampling_params, use_tqdm=use_tqdm, session_id=session_id)
        return self.generate(messages, sampling_params, chat=True, use_tqdm=use_tqdm, session_id=session_id)
