"""The engine loop: ``add_request`` / ``step`` / ``abort_request``, one step per forward pass.

One step: apply a policy swap handed in since the last step -> schedule chunks (admission by what each policy
keeps) -> run the model over the pool -> commit -> confidence signals of the sampling rows -> each sequence's
controller updates its budget -> on expansion the cache manager recalls host blocks, and a sequence that got blocks
back chooses no token this step: its last token is computed again as a row of the next step's batch (so the token
chosen under uncertainty sees the recalled context, without a forward pass of its own) -> sample -> stop checks ->
the cache manager trims every sequence to its budget.

A step cannot corrupt state: slots are reserved for the step's tokens before the forward pass and given back if it
raises; the chunks are then run one by one so that only the request whose chunk fails is finished with an error,
and every other request continues as if nothing happened. ``step`` never blocks on anything but the forward pass.
The engine is not thread-safe: one thread steps it; ``request_policy`` and ``record_refused_policy`` are the only
methods other threads may call.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from confkv.cache.manager import CacheManager
from confkv.confidence import Signals, confidence_signals
from confkv.config import CachePolicy, EngineConfig
from confkv.controllers import Controller, StepSignals, make_controller
from confkv.engine.allocator import keep_freed_memory
from confkv.engine.linear import pack_linears
from confkv.engine.params import SamplingParams
from confkv.engine.runner import ForwardResult, ModelRunner
from confkv.engine.sampler import sample
from confkv.engine.scheduler import ScheduledChunk, Scheduler
from confkv.engine.sequence import RequestOutput, Sequence, Status, TokenLogprobs
from confkv.errors import ConfkvError
from confkv.kv import attention
from confkv.kv.host import HostTier
from confkv.kv.pool import BlockPool
from confkv.model_loader import LoadedModel, load_model, resolve_device
from confkv.sessions.record import model_fingerprint
from confkv.sessions.tiers import SessionOptions, SessionTiers

log = logging.getLogger(__name__)

#: Policy keys that size engine-wide resources and so cannot differ per request.
ENGINE_WIDE_KEYS = frozenset({"block_size", "host_cache_memory", "memory_high_watermark", "memory_low_watermark"})
#: Keys a request may not set: they would load files named by the client.
FORBIDDEN_OVERRIDES = frozenset({"learned_path"})


@dataclass
class StepOutput:
    """What one step did for one request: its new token (if any) and, once finished, the full output.

    ``entropy``, ``gap``, ``top1_prob`` and ``resident`` describe the step that chose the token (for metrics);
    ``logprob`` is the token's log-probability and ``top_logprobs`` the most likely alternatives when the request
    asked for them. ``error`` is set when the request failed (alone: the others continue).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None
    error: str | None = None
    entropy: float | None = None
    gap: float | None = None
    top1_prob: float | None = None
    resident: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


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
    import os

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
        self.policy = policy = policy or CachePolicy()
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
        per_block = BlockPool.bytes_per_block_for(layers, kv_heads, head_dim, policy.block_size, dtype)
        kv_bytes = config.kv_cache_memory or int(config.kv_cache_fraction * available_memory(self.device))
        self.pool = BlockPool(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=policy.block_size,
            num_blocks=int(kv_bytes) // per_block,
            dtype=dtype,
            device=self.device,
        )
        scaling = attention.probe(self.model, self.pool, self.model.config.vocab_size)
        self.host = HostTier(policy.host_cache_memory, pin_memory=self.device.type == "cuda")
        self.controller = make_controller(policy)
        self.manager = CacheManager(self.pool, self.host, scaling)
        self.scheduler = Scheduler(
            self.manager,
            config.max_batch_size,
            config.max_num_batched_tokens,
            self.max_model_len,
            policy.memory_high_watermark,
            policy.low_watermark,
        )
        self.runner = ModelRunner(self.model, self.pool)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_reruns = 0
        self.rerun_tokens = 0
        self.request_errors: Counter[str] = Counter()
        self.policy_info: dict[str, str | None] = {"name": policy.controller, "version": None, "source": "startup",
                                                   **(policy_info or {})}  # fmt: skip
        self.policy_swaps = 0
        self.policy_swaps_refused = 0
        self._lock = threading.Lock()
        self._pending_policy: tuple[CachePolicy, Controller, dict[str, str | None]] | None = None
        self.sessions = SessionTiers(
            self.manager,
            sessions or SessionOptions(),
            identity=lambda: model_fingerprint(self.model, self.tokenizer),
            policy=lambda: (self.policy.model_dump(mode="json"), self.policy_info.get("version")),
            lookup=self._seqs.get,
            new_seq_id=self.new_seq_id,
        )
        self.scheduler.reclaim = self.sessions.reclaim

    # ------------------------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenize_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def tokenize_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """The model's chat template over a whole conversation, ending with the assistant's turn to speak."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def new_seq_id(self) -> int:
        """A sequence id unique within this engine (requests and scored items share the cache manager)."""
        return next(self._ids)

    def controller_for(self, overrides: dict[str, Any] | None) -> Controller:
        """The engine's controller, or one for the engine's policy with a request's overrides (validated)."""
        if not overrides:
            return self.controller
        bad = sorted((set(overrides) & (ENGINE_WIDE_KEYS | FORBIDDEN_OVERRIDES)) - {"controller"})
        if bad:
            raise ConfkvError(f"policy key {bad[0]!r} cannot be set per request (it is engine-wide)")
        unknown = sorted(set(overrides) - set(CachePolicy.model_fields))
        if unknown:
            raise ConfkvError(f"unknown policy key {unknown[0]!r}")
        if overrides.get("controller") == "learned" and self.policy.controller != "learned":
            raise ConfkvError("controller 'learned' cannot be chosen per request; serve a learned policy instead")
        return self.controller.derive(self.policy.replace(**overrides))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        policy_overrides: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> None:
        """Queue a request; bad input raises ``ConfkvError`` and leaves every other request untouched.

        ``policy_overrides`` changes policy keys for this request only (not the engine-wide ones). ``session_id``
        continues a session: the prompt (the whole conversation so far) reuses the KV the session kept, and only
        its new tokens are computed (``confkv.sessions.tiers``).
        """
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ConfkvError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfkvError("prompt is empty")
            text: str | None = prompt
            token_ids = self.tokenize(prompt, chat=chat)
        else:
            text, token_ids = None, [int(t) for t in prompt]
            vocab = self.model.config.vocab_size
            if any(t < 0 or t >= vocab for t in token_ids):
                raise ConfkvError(f"prompt token ids must lie in [0, {vocab})")
        if not token_ids:
            raise ConfkvError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ConfkvError(
                f"prompt has {len(token_ids)} tokens but the model's context is {self.max_model_len} tokens"
            )
        controller = self.controller_for(policy_overrides)
        if session_id is not None:
            self.sessions.check(session_id)  # before any state is made for the request
        seq_id = self.new_seq_id()
        state = controller.init_state()
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else self.config.seed + seq_id)
        seq = Sequence(
            seq_id=seq_id,
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            kv=self.manager.open(seq_id, controller, state.budget),
            ctrl=state,
            generator=generator,
            overrides=dict(policy_overrides or {}),
            logprobs=[] if params.logprobs is not None else None,
        )
        need = self.scheduler.committed(seq)
        if need > self.pool.num_blocks:
            self.manager.close(seq.kv)
            raise ConfkvError(
                f"request needs {need} KV blocks under policy {controller.name!r} but the pool holds "
                f"{self.pool.num_blocks} ({self.pool.total_bytes / 2**20:.1f} MiB); raise kv_cache_memory or "
                "shorten the request"
            )
        if session_id is not None:
            self.sessions.attach(seq, session_id)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

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
        """Queue a text for teacher-forced scoring: its first ``score_from`` tokens are read as a prompt, then the
        rest is fed ``chunk`` tokens at a time (default ``compact_interval``), each step's rows handed to
        ``recorder.record(first_position, signals, resident, budgets)``. Runs through ``step`` like any request."""
        if len(token_ids) < 2 or not 1 <= score_from < len(token_ids):
            raise ConfkvError(f"a scored text needs score_from in [1, {len(token_ids) - 1}] (got {score_from})")
        if len(token_ids) > self.max_model_len:
            raise ConfkvError(f"a scored text has {len(token_ids)} tokens; the context is {self.max_model_len}")
        if request_id in self._seqs:
            raise ConfkvError(f"request id {request_id!r} is already in use")
        controller = controller or self.controller
        seq_id = self.new_seq_id()
        state = controller.init_state()
        seq = Sequence(
            seq_id=seq_id,
            request_id=request_id,
            prompt=None,
            prompt_token_ids=list(token_ids[:score_from]),
            params=SamplingParams(max_tokens=len(token_ids) - score_from),
            kv=self.manager.open(seq_id, controller, state.budget),
            ctrl=state,
            forced=list(token_ids),
            forced_chunk=chunk or controller.policy.compact_interval,
            recorder=recorder,
            paused=paused,
        )
        need = self.scheduler.committed(seq)
        if need > self.pool.num_blocks:
            self.manager.close(seq.kv)
            raise ConfkvError("a scored text does not fit in the KV pool; raise kv_cache_memory")
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

    # ------------------------------------------------------------------------------------------------- policy
    def set_policy(
        self, policy: CachePolicy, *, source: str = "api", version: str | None = None, name: str | None = None
    ) -> None:
        """Swap the policy between steps (call it from the thread that steps the engine).

        What carries over for every live sequence: its KV in every tier, block importance, the applied budget
        (clamped to the new policy's ``max_size``), the controller's budget (``Controller.adopt``: ``dynamic`` keeps
        it clamped to its range, fixed policies use their size) and the compaction tick. What resets: a learned
        controller's knobs and segment. Per-request overrides are re-applied on top of the new policy; a request
        whose overrides do not apply to it (a scorer the new preset does not take, a ``base_size`` above its
        ``max_size``) finishes under the policy it had. A smaller budget is reached by the normal contraction, never
        by evicting at the swap; a smaller ``host_cache_memory`` drops the host tier's oldest blocks at once.
        """
        self._swap(policy, self._controller_of(policy), {"name": name or policy.controller, "version": version,
                                                         "source": source})  # fmt: skip

    def request_policy(
        self, policy: CachePolicy, *, source: str = "api", version: str | None = None, name: str | None = None
    ) -> None:
        """Hand a policy to the engine from any thread; it is built and validated here (a learned policy's
        network is loaded now, outside any step) and swapped in at the start of the next step."""
        controller = self._controller_of(policy)
        with self._lock:
            self._pending_policy = (policy, controller, {"name": name or policy.controller, "version": version,
                                                         "source": source})  # fmt: skip

    def record_refused_policy(self, source: str, reason: str) -> None:
        """Count (and log) a policy that was not swapped in because it failed to load or validate."""
        with self._lock:
            self.policy_swaps_refused += 1
        log.warning("policy from %s refused, keeping the current one: %s", source, reason)

    def _controller_of(self, policy: CachePolicy) -> Controller:
        if policy.block_size != self.policy.block_size:
            raise ConfkvError("a new policy cannot change block_size while the engine runs")
        return make_controller(policy)

    def _swap(self, policy: CachePolicy, controller: Controller, info: dict[str, str | None]) -> None:
        # every request's controller is built before anything changes, so that a swap is never half applied
        plan: list[tuple[Sequence, Controller]] = []
        for seq in self._seqs.values():
            try:
                plan.append((seq, controller.derive(policy.replace(**seq.overrides)) if seq.overrides else controller))
            except ConfkvError as err:
                log.warning("request %s keeps its policy: its overrides do not apply to the new one (%s)",
                            seq.request_id, err)  # fmt: skip
        self.policy = policy
        self.controller = controller
        self.scheduler.set_watermarks(policy.memory_high_watermark, policy.low_watermark)
        self.manager.mark_dropped(self.host.resize(int(policy.host_cache_memory)))
        for seq, c in plan:
            seq.ctrl = c.adopt(seq.ctrl)
            seq.kv.controller = c
            seq.kv.budget = min(seq.kv.budget, c.max_budget)
        self.policy_info = info
        self.policy_swaps += 1
        log.info("policy swapped to %s (version %s, from %s)", info["name"], info["version"], info["source"])

    def _apply_pending_policy(self) -> None:
        with self._lock:
            pending, self._pending_policy = self._pending_policy, None
        if pending is not None:
            self._swap(*pending)

    # ----------------------------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        self._apply_pending_policy()
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
            outputs.extend(self._process(chunks, res))
        return outputs

    def _capture(self, chunks: list[ScheduledChunk]) -> set[int]:
        """Sequences whose sampling query is kept: those that might recall host blocks this step, or whose prompt
        ends here and picks the blocks it keeps."""
        return {
            ch.seq.seq_id
            for ch in chunks
            if ch.samples
            and ch.seq.kv.controller.recalls
            and (self.host.has_blocks(ch.seq.seq_id) or self._reselects(ch))
        }

    @staticmethod
    def _reselects(ch: ScheduledChunk) -> bool:
        """Whether this chunk ends a sequence's prompt under a policy whose question picks what stays."""
        seq = ch.seq
        return (seq.kv.controller.policy.reselect_after_prompt and not ch.rerun and not seq.kv.prompt_trimmed
                and ch.start + ch.num_tokens == seq.num_prompt_tokens)  # fmt: skip

    def _run(self, chunks: list[ScheduledChunk]) -> ForwardResult:
        # a scored sequence's chunk of its text needs every row's logits (each row scores the next token)
        all_rows = {ch.seq.seq_id for ch in chunks if ch.seq.scored and ch.start >= ch.seq.num_prompt_tokens}
        return self.runner.run(chunks, capture=self._capture(chunks), all_rows=all_rows)

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

    def _process(self, chunks: list[ScheduledChunk], res: ForwardResult) -> list[StepOutput]:
        self.runner.commit(res)
        for ch, resident in zip(chunks, res.resident, strict=True):
            self._note_stale(ch, resident)
            if ch.rerun:
                continue
            ch.seq.num_computed += ch.num_tokens
            ch.seq.kv.stats.record_compute(resident, len(ch.seq.kv.table.device_blocks()), generated=False)
        outputs: list[StepOutput] = []
        self._keep_queries(res)
        if any(not ch.seq.scored for ch in res.sampling):
            outputs = self._sample(res, chunks)
        for i, ch in enumerate(chunks):
            if ch.seq.scored and ch.samples:
                outputs.append(self._score(ch, res, i))
        for ch in chunks:
            seq = ch.seq
            if not seq.finished:
                computed = 0 if ch.rerun else ch.num_tokens
                self.manager.after_step(seq.kv, seq.ctrl.budget, computed, seq.prompt_done, self._room(seq))
                if seq.scored and seq.num_uncomputed == 0 and not seq.rerun:
                    seq.token_ids.extend(seq.next_forced_chunk())
        return outputs

    @staticmethod
    def _note_stale(ch: ScheduledChunk, resident: int) -> None:
        """Track which generated tokens were computed over a trimmed context, for ``recompute: stale``. A rerun
        counts as a fresh computation: it saw what the recall brought back, the most the policy gives."""
        seq = ch.seq
        if ch.rerun:
            seq.stale_from = None
        elif seq.stale_from is None and ch.start >= seq.num_prompt_tokens and resident < ch.start + ch.num_tokens:
            seq.stale_from = ch.start

    def _keep_queries(self, res: ForwardResult) -> None:
        """Remember each capturing sequence's newest query and log-sum-exp (for a recall between steps)."""
        for ch in res.sampling:
            row = res.captured.get(ch.seq.seq_id)
            if row is not None:
                q = torch.stack([layer_q[row] for layer_q in res.batch.captured_q])
                lse = torch.stack([layer_lse[row] for layer_lse in res.batch.captured_lse])
                ch.seq.last_query = (q, lse)

    def _score(self, ch: ScheduledChunk, res: ForwardResult, index: int) -> StepOutput:
        """Teacher-forced rows of one scored sequence: each row's distribution scores the next token of its text.

        The controller sees every token's signals in order; an expansion recalls with the chunk's last query,
        contraction waits for the compaction tick, exactly as between decode steps. In a chunk of one token (as
        ``compact_interval: 1`` gives) a recall is applied to that token as decode applies it: the row is computed
        again with the recalled blocks and scored from the second pass, so scoring is decoding with the text forced.
        In a longer chunk it takes effect from the next chunk (a decision at a chunk's end governs the next chunk,
        as an RL environment's action does). A reselection at the prompt's end (``reselect_after_prompt``) takes
        effect from the next chunk: the text's first token is scored as the prompt left the cache.
        """
        seq, kv = ch.seq, ch.seq.kv
        row0, count = res.spans[index]
        resident = res.resident[index]
        if ch.rerun:  # the last row again, after the recall its first pass set off: its signals were counted then
            seq.rerun = 0
            last = confidence_signals(res.logits[row0 + count - 1 : row0 + count])
            return self._record_scored(seq, ch.start + ch.num_tokens - 1, last, resident, [seq.ctrl.budget])
        first = ch.start + ch.num_tokens - count  # position of the first row with logits
        signals = confidence_signals(res.logits[row0 : row0 + count])
        host = signals.stacked().tolist()
        c, state = seq.controller, seq.ctrl
        budgets = []
        for i in range(count):
            s = StepSignals(host[0][i], host[1][i], host[2][i], resident - count + 1 + i, first + 1 + i,
                            self.pool.usage)  # fmt: skip
            state = c.update(state, s)
            budgets.append(state.budget)
        seq.ctrl = state
        if seq.seq_id in res.captured and self._reselects(ch):
            self.manager.reselect(kv, seq.last_query[0], state.budget)
        elif (c.evicts and state.budget > kv.budget and seq.prompt_done and self._expand(seq, state.budget, res)
              and ch.num_tokens == 1):  # fmt: skip
            self._defer(seq)  # the row waits for its second pass
            return StepOutput(seq.request_id, [], finished=False)
        return self._record_scored(seq, first, signals, resident, budgets)

    def _record_scored(
        self, seq: Sequence, first: int, signals: Signals, resident: int, budgets: list[float]
    ) -> StepOutput:
        """Hand scored rows (predicting tokens ``first + 1 ...``, the last over ``resident`` keys) to the recorder."""
        count = len(budgets)
        seq.kv.stats.resident_sum += sum(resident - count + 1 + i for i in range(count))
        seq.kv.stats.resident_count += count
        seq.recorder.record(first, signals, resident, budgets)
        done = first + count >= len(seq.forced) - 1
        if done:
            self._finish(seq, "length")
        return StepOutput(seq.request_id, [], finished=done)

    def _room(self, seq: Sequence) -> Callable[[], float]:
        return lambda: self.scheduler.expansion_room(seq)

    def _expand(self, seq: Sequence, budget: float, res: ForwardResult | None) -> bool:
        """The controller's budget rose: raise the applied budget as far as memory allows and recall host blocks
        into it, scored with this step's query (or, between steps, the newest one kept). Returns whether blocks came
        back (so the step must be recomputed)."""
        kv, sched = seq.kv, self.scheduler
        kv.stats.expansions += 1
        self.manager.expansions += 1
        if sched.tripped:
            sched.refused_expansions += 1
            return False
        new = min(budget, kv.budget + sched.expansion_room(seq))
        if new <= kv.budget:
            sched.refused_expansions += 1
            return False
        can_recall = (seq.prompt_done and kv.prompt_trimmed and seq.last_query is not None
                      and (res is None or seq.seq_id in res.captured))  # fmt: skip
        if seq.controller.policy.expand_by == "budget":
            kv.budget = new
            return can_recall and bool(self.manager.recall(kv, *seq.last_query))
        if not can_recall:
            return False
        # grow by what recall brings back and is worth it, nothing more: new tokens do not fill a raised budget
        old = kv.budget
        kv.budget = new
        back = self.manager.recall(kv, *seq.last_query, min_share=1.0)
        kv.budget = max(old, float(kv.table.resident_tokens())) if back else old
        return bool(back)

    def resize(self, request_id: str, budget: float) -> None:
        """Set a live sequence's budget now, between steps: contract by evicting, expand (as far as memory allows)
        with a recall scored by its newest query. An environment uses it so that an action governs the very next
        segment instead of the one after."""
        seq = self._seqs[request_id]
        c = seq.controller
        if not c.evicts:
            return
        seq.ctrl = replace(seq.ctrl, budget=budget)
        if budget > seq.kv.budget:
            self._expand(seq, budget, None)
        elif budget < seq.kv.budget:
            seq.kv.budget = budget
            self.manager.contractions += 1
        if seq.prompt_done and seq.kv.table.resident_tokens() > seq.kv.budget:
            self.manager.evict_to(seq.kv, seq.kv.budget)

    def _defer(self, seq: Sequence) -> None:
        """Blocks came back: the token is chosen next step, from this one recomputed with them (only tokens of the
        protected recent window are sure to be resident, and the second pass must fit in one step). Under
        ``recompute: stale`` every token computed over a trimmed context since the last recomputation is computed
        again too: a near-tie is decided by those tokens' keys and values as much as by which older blocks are
        resident (BENCHMARKS.md, "Stale keys")."""
        c = seq.kv.controller
        n = c.policy.recompute_tokens
        if c.policy.recompute == "stale" and seq.stale_from is not None:
            n = max(n, seq.num_computed - seq.stale_from)
        seq.rerun = min(n, max(1, c.protected_recent), seq.num_computed, self.scheduler.max_num_batched_tokens)
        self.num_reruns += 1
        self.rerun_tokens += seq.rerun

    def _sample(self, res: ForwardResult, chunks: list[ScheduledChunk]) -> list[StepOutput]:
        """Choose the next token of every generating sequence that reached its end this step."""
        resident_of = {id(ch): r for ch, r in zip(chunks, res.resident, strict=True)}
        row_of = {id(ch): res.spans[i][0] for i, ch in enumerate(chunks)}
        sampling = [ch for ch in res.sampling if not ch.seq.scored]
        resident = [resident_of[id(ch)] for ch in sampling]
        logits = res.logits[[row_of[id(ch)] for ch in sampling]]
        signals = confidence_signals(logits)
        host_signals = signals.stacked().tolist()
        expanded = [False] * len(sampling)
        deferred: set[int] = set()
        for i, ch in enumerate(sampling):
            seq = ch.seq
            c = seq.kv.controller
            if ch.rerun:  # computed again after last step's recall: its signals were counted then
                seq.rerun = 0
                expanded[i] = True
                continue
            s = StepSignals(
                host_signals[0][i],
                host_signals[1][i],
                host_signals[2][i],
                resident=resident[i],
                position=len(seq.token_ids),
                pool_usage=self.pool.usage,
            )
            state = c.update(seq.ctrl, s)
            seq.pending_signals = s
            if seq.seq_id in res.captured and self._reselects(ch):
                if self.manager.reselect(seq.kv, seq.last_query[0], state.budget):
                    self._defer(seq)
                    deferred.add(i)
            elif c.evicts and state.budget > seq.ctrl.budget:
                expanded[i] = True
                if self._expand(seq, state.budget, res):
                    self._defer(seq)
                    deferred.add(i)
            seq.ctrl = state
        if deferred:
            keep = [i for i in range(len(sampling)) if i not in deferred]
            sampling = [sampling[i] for i in keep]
            resident = [resident[i] for i in keep]
            expanded = [expanded[i] for i in keep]
            logits = logits[keep]
            signals = signals.rows(keep)
            host_signals = [[row[i] for i in keep] for row in host_signals]
            if not sampling:
                return []
        tokens, errors = sample(
            logits, signals, [ch.seq.params for ch in sampling], [ch.seq.generator for ch in sampling]
        )
        chosen_lp = signals.logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        want_top = max((ch.seq.params.logprobs or 0 for ch in sampling), default=0)
        top = signals.logprobs.topk(want_top, dim=-1) if want_top else None
        token_list = tokens.tolist()
        now = time.perf_counter()
        outputs = []
        for i, ch in enumerate(sampling):
            seq = ch.seq
            if i in errors:
                outputs.append(self._fail(seq, errors[i], "sampling"))
                continue
            tr = seq.trace
            tr.entropy.append(host_signals[0][i])
            tr.gap.append(host_signals[1][i])
            tr.top1_prob.append(host_signals[2][i])
            tr.resident.append(resident[i])
            tr.budget.append(seq.ctrl.budget if seq.kv.controller.evicts else float(resident[i]))
            tr.expanded.append(expanded[i])
            seq.decided_on.append(seq.pending_signals)
            seq.kv.stats.record_compute(resident[i], len(seq.kv.table.device_blocks()), generated=True)
            if seq.first_token_time is None:
                seq.first_token_time = now
            token = token_list[i]
            seq.token_ids.append(token)
            alternatives = None
            if seq.logprobs is not None:
                k = seq.params.logprobs or 0
                alternatives = (
                    list(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist(), strict=True))
                    if top is not None and k
                    else []
                )
                seq.logprobs.append(TokenLogprobs(token, chosen_lp[i], tuple(alternatives)))
            reason = self._stop_reason(seq, token)
            out = StepOutput(
                seq.request_id,
                [token],
                finished=reason is not None,
                entropy=host_signals[0][i],
                gap=host_signals[1][i],
                top1_prob=host_signals[2][i],
                resident=resident[i],
                logprob=chosen_lp[i],
                top_logprobs=alternatives,
            )
            if reason is not None:
                self._finish(seq, reason)
                out.output = RequestOutput.from_sequence(seq, self.pool.bytes_per_block)
            outputs.append(out)
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.loaded.eos_token_ids):
            return "stop"
        if p.stop and self._stop_in_tail(seq):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _stop_in_tail(self, seq: Sequence) -> bool:
        """Whether a stop string ends in the newest tokens: only the tail is decoded, not the whole output."""
        width = max(len(s) for s in seq.params.stop) + 8
        tail = self.tokenizer.decode(seq.output_token_ids[-width:], skip_special_tokens=True)
        return any(s in tail for s in seq.params.stop)

    def _stop_cut(self, seq: Sequence, text: str) -> int | None:
        """Where the earliest stop string starts in the output text, if one occurs."""
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        seq.finish_time = time.perf_counter()
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        cut = self._stop_cut(seq, text) if seq.params.stop else None
        seq.text = text if cut is None else text[:cut]
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
    def stats(self) -> dict[str, Any]:
        """Engine-wide gauges and counters (counters are monotonic since start; the server's /metrics reads these)."""
        s, m = self.scheduler, self.manager
        return {
            "pool_blocks": self.pool.num_blocks,
            "pool_used_blocks": self.pool.num_used,
            "pool_usage": self.pool.usage,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_total_bytes": self.pool.total_bytes,
            "committed_blocks": s.committed_total(),
            "host_used_bytes": self.host.used_bytes,
            "host_peak_bytes": self.host.peak_bytes,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "evicted_blocks": m.evicted_blocks,
            "recalled_blocks": m.recalled_blocks,
            "recall_hits": m.recall_hits,
            "recall_queries": m.recall_queries,
            "reselections": m.reselections,
            "expansions": m.expansions,
            "refused_expansions": s.refused_expansions,
            "contractions": m.contractions,
            "breaker_trips": s.breaker_trips,
            "breaker_tripped": s.tripped,
            "preemptions": s.preemptions,
            "recomputed_tokens": s.recomputed_tokens + self.rerun_tokens,
            "steps": self.num_steps,
            "reruns": self.num_reruns,
            "policy_swaps": self.policy_swaps,
            "policy_swaps_refused": self.policy_swaps_refused,
            "request_errors": sum(self.request_errors.values()),
            "request_errors_by_kind": dict(self.request_errors),
            **self.sessions.stats(),
        }

    # ------------------------------------------------------------------------------------------------- sessions
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
