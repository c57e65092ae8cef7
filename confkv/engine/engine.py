"""The engine loop: ``add_request`` / ``step`` / ``abort_request``, one step per forward pass.

A step reads as schedule, run, postprocess (nano-vllm's shape): apply a policy swap handed in since the last step
(``policy_swap``) -> schedule chunks (``scheduler``: admission by what each policy keeps) -> run the model over the
pool (``runner``) -> commit -> the sampling rows: confidence signals, each sequence's controller updates its budget,
expansions recall host blocks and defer the token to a second pass (``recall``), then sample and check stops
(``decode``, ``stopping``); a scored text's rows go to its recorder (``scored``) -> the cache manager trims every
sequence to its budget. Requests come in through ``intake`` (every check, once).

A step cannot corrupt state: slots are reserved for the step's tokens before the forward pass and given back if it
raises; the chunks are then run one by one so that only the request whose chunk fails is finished with an error,
and every other request continues as if nothing happened. ``step`` never blocks on anything but the forward pass.
The engine is not thread-safe: one thread steps it; ``request_policy`` and ``record_refused_policy`` are the only
methods other threads may call.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from confkv.cache.manager import CacheManager
from confkv.config import CachePolicy, EngineConfig
from confkv.controllers import Controller
from confkv.engine.allocator import keep_freed_memory
from confkv.engine.decode import Decoder
from confkv.engine.intake import Intake, Prompt, RequestLimits
from confkv.engine.linear import pack_linears
from confkv.engine.params import SamplingParams
from confkv.engine.policy_swap import PolicySwitch
from confkv.engine.recall import Recaller
from confkv.engine.runner import ForwardResult, ModelRunner
from confkv.engine.scheduler import ScheduledChunk, Scheduler
from confkv.engine.scored import ScoredRows
from confkv.engine.sequence import RequestOutput, Sequence, Status, StepOutput
from confkv.engine.stats import engine_stats
from confkv.engine.stopping import output_text
from confkv.errors import ConfkvError
from confkv.kv import attention, kernel
from confkv.kv.host import HostTier
from confkv.kv.kv_format import KVFormat
from confkv.kv.pool import BlockPool
from confkv.model_loader import LoadedModel, load_model, resolve_device
from confkv.sessions.record import model_fingerprint
from confkv.sessions.state import SessionOptions
from confkv.sessions.tiers import SessionTiers

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestLimits", "StepOutput", "available_memory"]


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool: free device memory on CUDA, ``MemAvailable`` on the host."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        policy: CachePolicy | None = None,
        loaded: LoadedModel | None = None,
        policy_info: dict[str, str | None] | None = None,
        sessions: SessionOptions | None = None,
    ) -> None:
        """``policy_info`` says where the start-up policy came from (``name``, ``version``, ``source``: a registry
        reference, a file); by default its controller's name from ``startup``. ``sessions`` configures the session
        tiers (default: in memory only, no object storage)."""
        self.config = config = config or EngineConfig()
        policy = policy or CachePolicy()
        if loaded is not None and config.device is None:
            self.device = next(loaded.model.parameters()).device
        else:
            self.device = resolve_device(config.device)
        impl = attention.register()
        keep_freed_memory()
        self.loaded = loaded or load_model(
            config.model, device=self.device, dtype=config.dtype, cache_dir=config.cache_dir, seed=config.seed
        )
        self.model = self.loaded.model
        self.model.set_attn_implementation(impl)
        if config.pack_weights:
            pack_linears(self.model)
        self.tokenizer = self.loaded.tokenizer
        if config.max_model_len is not None and config.max_model_len > self.loaded.max_model_len:
            raise ConfkvError(
                f"max_model_len {config.max_model_len} is more than the model's context ({self.loaded.max_model_len})"
            )
        self.max_model_len = config.max_model_len or self.loaded.max_model_len

        layers, kv_heads, head_dim = BlockPool.geometry(self.model.config)
        dtype = next(self.model.parameters()).dtype
        per_block = BlockPool.bytes_per_block_for(
            layers, kv_heads, head_dim, policy.block_size, dtype, config.kv_cache_dtype
        )
        kv_bytes = config.kv_cache_memory or int(config.kv_cache_fraction * available_memory(self.device))
        self.pool = BlockPool(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=policy.block_size,
            num_blocks=int(kv_bytes) // per_block,
            dtype=dtype,
            device=self.device,
            kv_cache_dtype=config.kv_cache_dtype,
            float_window=config.kv_float_window,
        )
        scaling = attention.probe(self.model, self.pool, self.model.config.vocab_size)
        if attention.DECODE_KERNEL and kernel.supported(self.pool):
            kernel.load()  # a quantised CPU pool's decode kernel: built (once per machine) now, not in a request
        host_fmt = None
        if config.host_kv_dtype not in (None, config.kv_cache_dtype):  # the lower tiers in a form of their own
            try:
                host_fmt = KVFormat(config.host_kv_dtype, head_dim, policy.block_size, dtype)
            except ValueError as err:
                raise ConfkvError(f"host_kv_dtype: {err}") from None
            if host_fmt.bytes_per_token(layers, kv_heads) > self.pool.fmt.bytes_per_token(layers, kv_heads):
                raise ConfkvError(f"host_kv_dtype {config.host_kv_dtype} is less compact than kv_cache_dtype "
                                  f"{config.kv_cache_dtype}: the lower tiers may only quantise further")  # fmt: skip
        self.host = HostTier(policy.host_cache_memory, pin_memory=self.device.type == "cuda", fmt=host_fmt)
        self.policies = PolicySwitch(policy, policy_info)
        self.manager = CacheManager(self.pool, self.host, scaling)
        if policy.demote_dtype != "none":  # a geometry the demoted format cannot lay out: refused here, in one line
            try:
                self.manager.demoted.format_named(policy.demote_dtype)
            except ValueError as err:
                raise ConfkvError(f"demote_dtype: {err}") from None
        self.scheduler = Scheduler(
            self.manager,
            config.max_batch_size,
            config.max_num_batched_tokens,
            self.max_model_len,
            policy.memory_high_watermark,
            policy.low_watermark,
            config.admission,
        )
        self.runner = ModelRunner(self.model, self.pool, self.manager.demoted)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.request_errors: Counter[str] = Counter()
        self.sessions = SessionTiers(
            self.manager,
            sessions or SessionOptions(),
            identity=lambda: model_fingerprint(self.model, self.tokenizer),
            policy=lambda: (self.policy.model_dump(mode="json"), self.policy_info.get("version")),
            lookup=self._seqs.get,
            new_seq_id=self.new_seq_id,
        )
        self.scheduler.reclaim = self.sessions.reclaim
        self.recall = Recaller(self.manager, self.scheduler, self.host)
        self.intake = Intake(self.tokenizer, self.model.config.vocab_size, self.max_model_len, self.device,
                             config.seed, self.manager, self.scheduler, self.sessions, self.policies,
                             self.new_seq_id, self._seqs)  # fmt: skip
        self.decoder = Decoder(self.pool, self.manager, self.recall, self.tokenizer, self.loaded.eos_token_ids,
                               self.max_model_len, self._finish, self._fail)  # fmt: skip
        self.scored_rows = ScoredRows(self.pool, self.manager, self.recall, self._finish)

    # ------------------------------------------------------------------------------------------------- policy
    @property
    def policy(self) -> CachePolicy:
        return self.policies.policy

    @property
    def controller(self) -> Controller:
        return self.policies.controller

    @property
    def policy_info(self) -> dict[str, str | None]:
        return self.policies.info

    @property
    def policy_swaps(self) -> int:
        return self.policies.swaps

    @property
    def policy_swaps_refused(self) -> int:
        return self.policies.refused

    def controller_for(self, overrides: dict[str, Any] | None) -> Controller:
        """The engine's controller, or one for the engine's policy with a request's overrides (validated)."""
        return self.policies.controller_for(overrides)

    def set_policy(
        self, policy: CachePolicy, *, source: str = "api", version: str | None = None, name: str | None = None
    ) -> None:
        """Swap the policy now, between steps (call it from the thread that steps the engine); what carries over is
        ``confkv.engine.policy_swap``'s to say. A smaller ``host_cache_memory`` drops the host tier's oldest blocks
        at once."""
        self._swap(policy, self.policies.build(policy), _info(policy, source, version, name))

    def request_policy(
        self, policy: CachePolicy, *, source: str = "api", version: str | None = None, name: str | None = None
    ) -> None:
        """Hand a policy to the engine from any thread; it is built and validated here (a learned policy's
        network is loaded now, outside any step) and swapped in at the start of the next step."""
        self.policies.request(policy, _info(policy, source, version, name))

    def record_refused_policy(self, source: str, reason: str) -> None:
        """Count (and log) a policy that was not swapped in because it failed to load or validate."""
        self.policies.record_refused(source, reason)

    def _swap(self, policy: CachePolicy, controller: Controller, info: dict[str, str | None]) -> None:
        self.policies.swap(policy, controller, info, self._seqs.values())
        self.scheduler.set_watermarks(policy.memory_high_watermark, policy.low_watermark)
        self.manager.mark_dropped(self.host.resize(int(policy.host_cache_memory)))

    # ------------------------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        return self.intake.tokenize(prompt, chat)

    def tokenize_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """The model's chat template over a whole conversation, ending with the assistant's turn to speak."""
        return self.intake.tokenize_messages(messages)

    def new_seq_id(self) -> int:
        """A sequence id unique within this engine (requests and scored items share the cache manager)."""
        return next(self._ids)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        chat: bool = False,
        policy_overrides: dict[str, Any] | None = None,
        session_id: str | None = None,
        limits: RequestLimits | None = None,
    ) -> Sequence:
        """Queue a request; bad input raises ``ConfkvError`` (its ``param`` names the field) and leaves every
        other request untouched (``confkv.engine.intake``).

        ``prompt`` is text, token ids, or a chat's messages. ``params`` are ``SamplingParams`` or their keywords.
        ``policy_overrides`` changes policy keys for this request only (not the engine-wide ones). ``session_id``
        continues a session: the prompt (the whole conversation so far) reuses the KV the session kept, and only
        its new tokens are computed (``confkv.sessions.tiers``). ``limits`` are a server's.
        """
        seq = self.intake.admit(request_id, prompt, params, chat=chat, policy_overrides=policy_overrides,
                                session_id=session_id, limits=limits)  # fmt: skip
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_scored(
        self,
        request_id: str,
        token_ids: list[int],
        score_from: int,
        recorder: Any,
        *,
        controller: Controller | None = None,
        chunk: int | None = None,
        paused: bool = False,
    ) -> Sequence:
        """Queue a text for teacher-forced scoring (``Intake.admit_scored``); it runs through ``step`` like any
        request."""
        seq = self.intake.admit_scored(request_id, token_ids, score_from, recorder, controller=controller,
                                       chunk=chunk, paused=paused)  # fmt: skip
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request (an environment sets ``controller`` on it to steer its budget)."""
        return self._seqs.get(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return RequestOutput.from_sequence(seq, self.pool.bytes_per_block)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def resize(self, request_id: str, budget: float) -> None:
        """Set a live sequence's budget now, between steps: contract by evicting, expand (as far as memory allows)
        with a recall scored by its newest query. An environment uses it so that an action governs the very next
        segment instead of the one after."""
        self.recall.resize(self._seqs[request_id], budget)

    # ----------------------------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        pending = self.policies.take_pending()
        if pending is not None:
            self._swap(*pending)
        self.sessions.housekeeping()
        sched = self.scheduler.schedule()
        outputs = [self._fail(seq, reason, "too_large") for seq, reason in sched.failed]
        if not sched.chunks:
            if any(seq.restoring for seq in self.scheduler.waiting):
                self.sessions.wait_for_restores(0.02)  # nothing else to do: wait for a record, do not spin
            elif self.scheduler.running and not outputs:
                raise RuntimeError("running requests but nothing scheduled (an engine bug)")
            return outputs
        self.num_steps += 1
        for chunks, res in self._forward(sched.chunks, outputs):
            outputs.extend(self._postprocess(chunks, res))
        return outputs

    def _run(self, chunks: list[ScheduledChunk]) -> ForwardResult:
        # a scored sequence's chunk of its text needs every row's logits (each row scores the next token)
        all_rows = {ch.seq.seq_id for ch in chunks if ch.seq.scored and ch.start >= ch.seq.num_prompt_tokens}
        return self.runner.run(chunks, capture=self.recall.capture(chunks), all_rows=all_rows)

    def _forward(
        self, chunks: list[ScheduledChunk], outputs: list[StepOutput]
    ) -> list[tuple[list[ScheduledChunk], ForwardResult]]:
        """Run the pass; if it raises, undo every reservation and run each chunk alone, failing only those that
        still raise (their failure reaches ``outputs``)."""
        try:
            return [(chunks, self._run(chunks))]
        except Exception as err:  # any failure of the pass must leave the other requests intact
            for ch in chunks:
                if ch.undo is not None:
                    self.manager.rollback(ch.seq.kv, ch.undo)
            if len(chunks) == 1:
                outputs.append(self._fail(chunks[0].seq, f"forward pass failed: {err}", "forward"))
                return []
            log.warning("forward pass over %d chunks failed (%s); running them one by one", len(chunks), err)
        done = []
        for ch in chunks:
            ch.undo = None if ch.rerun else self.manager.reserve(ch.seq.kv, ch.num_tokens)
            try:
                done.append(([ch], self._run([ch])))
            except Exception as err:
                if ch.undo is not None:  # a second pass reserved nothing
                    self.manager.rollback(ch.seq.kv, ch.undo)
                outputs.append(self._fail(ch.seq, f"forward pass failed: {err}", "forward"))
        return done

    def _postprocess(self, chunks: list[ScheduledChunk], res: ForwardResult) -> list[StepOutput]:
        self.runner.commit(res)
        for ch, resident in zip(chunks, res.resident, strict=True):
            self.recall.note_stale(ch, resident)
            if ch.rerun:
                continue
            ch.seq.num_computed += ch.num_tokens
            ch.seq.kv.stats.record_compute(resident, len(ch.seq.kv.table.device_blocks()), generated=False)
        outputs: list[StepOutput] = []
        self.recall.keep_queries(res)
        if any(not ch.seq.scored for ch in res.sampling):
            outputs = self.decoder.step(res, chunks)
        for i, ch in enumerate(chunks):
            if ch.seq.scored and ch.samples:
                outputs.append(self.scored_rows.step(ch, res, i))
        for ch in chunks:
            seq = ch.seq
            if not seq.finished:
                computed = 0 if ch.rerun else ch.num_tokens
                self.manager.after_step(seq.kv, seq.ctrl.budget, computed, seq.prompt_done, self._room(seq))
                if seq.scored and seq.num_uncomputed == 0 and not seq.rerun:
                    seq.token_ids.extend(seq.next_forced_chunk())
        return outputs

    def _room(self, seq: Sequence) -> Callable[[], float]:
        return lambda: self.scheduler.expansion_room(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        seq.finish_time = time.perf_counter()
        seq.text = output_text(seq, self.tokenizer)
        self.scheduler.remove(seq)
        if not self.sessions.park(seq):
            self.sessions.release(seq)
            self.manager.close(seq.kv)
        del self._seqs[seq.request_id]

    def _fail(self, seq: Sequence, reason: str, kind: str) -> StepOutput:
        """Finish one request with an error of its own; nothing else is touched."""
        log.warning("request %s failed (%s): %s", seq.request_id, kind, reason)
        seq.error = reason
        self.request_errors[kind] += 1
        self._finish(seq, "error")
        output = RequestOutput.from_sequence(seq, self.pool.bytes_per_block)
        return StepOutput(seq.request_id, [], finished=True, output=output, error=reason)

    # ---------------------------------------------------------------------------------------------------- stats
    @property
    def num_reruns(self) -> int:
        """Second passes run after a recall (or a reselection) brought blocks back."""
        return self.recall.num_reruns

    @property
    def rerun_tokens(self) -> int:
        return self.recall.rerun_tokens

    def stats(self) -> dict[str, Any]:
        """Engine-wide gauges and counters (counters are monotonic since start; the server's /metrics reads these)."""
        return engine_stats(self)

    # ------------------------------------------------------------------------------------------------- sessions
    def session_running(self, session_id: str) -> bool:
        """Whether a request of this session is running now."""
        return session_id in self.sessions.active

    def delete_session(self, session_id: str) -> bool:
        """Forget a session in every tier (its running request, if any, finishes unparked)."""
        return self.sessions.delete(session_id)

    def flush_sessions(self, timeout_s: float = 60.0) -> int:
        """Write every session held in memory to object storage and wait (before a shutdown); returns how many."""
        return self.sessions.flush(timeout_s)

    def housekeeping(self) -> None:
        """Session tier moves and expiry for an idle engine (``step`` does this itself when it runs)."""
        self.sessions.housekeeping()

    def close(self) -> None:
        """Stop the background session writer (sessions in memory are not written: see ``flush_sessions``)."""
        self.sessions.close()


def _info(policy: CachePolicy, source: str, version: str | None, name: str | None) -> dict[str, str | None]:
    return {"name": name or policy.controller, "version": version, "source": source}
