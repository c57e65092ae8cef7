"""The engine loop: ``add_request`` / ``step`` / ``abort_request``, one step per forward pass.

One step: schedule chunks -> run the model over the pool -> confidence signals of the sampling rows -> the
controller updates each budget -> on expansion the cache manager recalls host blocks and the step is recomputed
for those sequences (so the token chosen under uncertainty sees the recalled context) -> sample -> stop checks ->
the cache manager trims every sequence to its budget. ``step`` never blocks on anything but the forward pass, so an
async server can drive it from its own loop; ``set_policy`` swaps the controller between steps.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from confkv.confidence import confidence_signals
from confkv.config import CachePolicy, EngineConfig
from confkv.controllers import StepSignals, make_controller
from confkv.engine.params import SamplingParams
from confkv.engine.runner import ForwardResult, ModelRunner
from confkv.engine.sampler import sample
from confkv.engine.scheduler import ScheduledChunk, Scheduler
from confkv.engine.sequence import RequestOutput, Sequence, Status
from confkv.errors import ConfkvError
from confkv.kv import attention
from confkv.kv.host import HostTier
from confkv.kv.manager import CacheManager
from confkv.kv.pool import BlockPool
from confkv.model_loader import LoadedModel, load_model

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step did for one request: its new token (if any) and, once finished, the full output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None


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
    ) -> None:
        self.config = config = config or EngineConfig()
        self.policy = policy = policy or CachePolicy()
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        impl = attention.register()
        self.loaded = loaded or load_model(
            config.model, device=self.device, dtype=config.dtype, cache_dir=config.cache_dir, seed=config.seed
        )
        self.model = self.loaded.model
        self.model.set_attn_implementation(impl)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)

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
        self.host = HostTier(policy.host_cache_memory, pin_memory=self.device.type == "cuda")
        self.controller = make_controller(policy)
        scaling = getattr(self.model.model.layers[0].self_attn, "scaling", head_dim**-0.5)
        self.manager = CacheManager(self.pool, self.host, self.controller, scaling)
        self.scheduler = Scheduler(self.manager, config.max_batch_size, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.pool)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_reruns = 0

    # ------------------------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(prompt)["input_ids"])

    def new_seq_id(self) -> int:
        """A sequence id unique within this engine (requests and scored items share the cache manager)."""
        return next(self._ids)

    def _check_fits(self, n_prompt: int, params: SamplingParams) -> None:
        bs, c = self.pool.block_size, self.controller
        total = min(n_prompt + params.max_tokens, self.max_model_len)
        if not c.evicts:
            need = -(-total // bs)
        elif not c.evicts_during_prefill:
            need = -(-max(n_prompt, int(c.max_budget)) // bs) + 2
        else:
            need = -(-min(total, int(c.max_budget)) // bs) + 2
        if need > self.pool.num_blocks:
            raise ConfkvError(
                f"request needs {need} KV blocks under policy {c.name!r} but the pool holds {self.pool.num_blocks} "
                f"({self.pool.total_bytes / 2**20:.1f} MiB); raise kv_cache_memory or shorten the request"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
    ) -> None:
        """Queue a request; bad input raises ``ConfkvError`` and leaves every other request untouched."""
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
        self._check_fits(len(token_ids), params)
        seq_id = self.new_seq_id()
        state = self.controller.init_state()
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
            kv=self.manager.open(seq_id, state.budget),
            ctrl=state,
            generator=generator,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

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

    def set_policy(self, policy: CachePolicy) -> None:
        """Replace the controller between steps; running sequences keep their KV and restart its state."""
        if policy.block_size != self.policy.block_size:
            raise ConfkvError("a new policy cannot change block_size while the engine runs")
        self.policy = policy
        self.controller = make_controller(policy)
        self.manager.controller = self.controller
        for seq in self._seqs.values():
            seq.ctrl = self.controller.init_state()
            seq.kv.budget = seq.ctrl.budget

    # ----------------------------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("no request could be scheduled although some are waiting (KV pool too small)")
            return []
        self.num_steps += 1
        c = self.controller
        capture = set()
        if c.recalls:
            capture = {ch.seq.seq_id for ch in chunks if ch.samples and self.host.has_blocks(ch.seq.seq_id)}
        res = self.runner.run(chunks, c, capture=capture)
        for ch, resident in zip(chunks, res.resident, strict=True):
            ch.seq.num_computed += ch.num_tokens
            ch.seq.kv.stats.record_compute(resident, len(ch.seq.kv.table.device_blocks()), generated=False)

        outputs: list[StepOutput] = []
        if res.sampling:
            resident_of = {id(ch): r for ch, r in zip(chunks, res.resident, strict=True)}
            outputs = self._sample(res, [resident_of[id(ch)] for ch in res.sampling])
        for ch in chunks:
            seq = ch.seq
            if not seq.finished:
                self.manager.after_step(seq.kv, seq.ctrl.budget, ch.num_tokens, seq.prompt_done)
        return outputs

    def _sample(self, res: ForwardResult, resident: list[int]) -> list[StepOutput]:
        c = self.controller
        sampling = res.sampling
        logits = res.logits
        signals = confidence_signals(logits)
        host_signals = signals.stacked().tolist()
        expanded = [False] * len(sampling)
        rerun: list[int] = []
        for i, ch in enumerate(sampling):
            seq = ch.seq
            s = StepSignals(
                host_signals[0][i],
                host_signals[1][i],
                host_signals[2][i],
                resident=resident[i],
                position=len(seq.token_ids),
                pool_usage=self.pool.usage,
            )
            state = (seq.controller or c).update(seq.ctrl, s)
            if state.budget > seq.kv.budget:
                seq.kv.stats.expansions += 1
                expanded[i] = True
                row = res.captured.get(seq.seq_id)
                if row is not None:
                    q = torch.stack([layer_q[row] for layer_q in res.batch.captured_q])
                    lse = torch.stack([layer_lse[row] for layer_lse in res.batch.captured_lse])
                    seq.kv.budget = state.budget
                    if self.manager.recall(seq.kv, q, lse):
                        rerun.append(i)
                seq.kv.budget = state.budget
            seq.ctrl = state
        if rerun:
            # Recompute the uncertain step with the recalled blocks before choosing its token.
            self.num_reruns += len(rerun)
            again = []
            for i in rerun:
                seq = sampling[i].seq
                # only tokens of the protected recent window are sure to be resident
                n = min(self.policy.recompute_tokens, max(1, c.protected_recent), seq.num_computed)
                again.append(ScheduledChunk(seq, seq.num_computed - n, n))
            again.sort(key=lambda ch: ch.num_tokens != 1)
            order = {id(ch.seq): j for j, ch in enumerate(again)}
            res2 = self.runner.run(again, c, track=False)
            logits = logits.clone()
            logits[rerun] = res2.logits[[order[id(sampling[i].seq)] for i in rerun]]
            signals = confidence_signals(logits)
            host_signals = signals.stacked().tolist()
            for i in rerun:
                resident[i] = res2.resident[order[id(sampling[i].seq)]]
        tokens = sample(logits, signals, [ch.seq.params for ch in sampling], [ch.seq.generator for ch in sampling])
        token_list = tokens.tolist()
        now = time.perf_counter()
        outputs = []
        for i, ch in enumerate(sampling):
            seq = ch.seq
            tr = seq.trace
            tr.entropy.append(host_signals[0][i])
            tr.gap.append(host_signals[1][i])
            tr.top1_prob.append(host_signals[2][i])
            tr.resident.append(resident[i])
            tr.budget.append(seq.ctrl.budget if c.evicts else float(resident[i]))
            tr.expanded.append(expanded[i])
            seq.kv.stats.record_compute(resident[i], len(seq.kv.table.device_blocks()), generated=True)
            if seq.first_token_time is None:
                seq.first_token_time = now
            token = token_list[i]
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            out = StepOutput(seq.request_id, [token], finished=reason is not None)
            if reason is not None:
                self._finish(seq, reason)
                out.output = RequestOutput.from_sequence(seq, self.pool.bytes_per_block)
            outputs.append(out)
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.loaded.eos_token_ids):
            return "stop"
        if p.stop and self._stop_cut(seq) is not None:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _stop_cut(self, seq: Sequence, text: str | None = None) -> int | None:
        """Where the earliest stop string starts in the output text, if one occurs."""
        if text is None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
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
        self.manager.close(seq.kv)
        del self._seqs[seq.request_id]

    # ---------------------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, float | int]:
        """Engine-wide gauges and counters (the server's /metrics will read these)."""
        return {
            "pool_blocks": self.pool.num_blocks,
            "pool_used_blocks": self.pool.num_used,
            "pool_usage": self.pool.usage,
            "pool_used_bytes": self.pool.used_bytes,
            "host_used_bytes": self.host.used_bytes,
            "host_peak_bytes": self.host.peak_bytes,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "evicted_blocks": self.manager.evicted_blocks,
            "recalled_blocks": self.manager.recalled_blocks,
            "recall_hits": self.manager.recall_hits,
            "breaker_trips": self.manager.breaker_trips,
            "preemptions": self.scheduler.preemptions,
            "steps": self.num_steps,
            "reruns": self.num_reruns,
        }
