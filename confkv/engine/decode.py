"""Choosing the next token of every generating sequence that reached its end this step.

From the last logits of each such sequence, for the whole batch at once: the confidence signals (entropy, top-1/
top-2 gap, top-1 probability), then each sequence's controller moves its budget. A rising budget is an expansion
(``confkv.engine.recall``): a sequence that got blocks back chooses no token now, its last tokens are computed
again next step with them. Every other row is sampled (greedy, or temperature/top-p/top-k with the request's
generator), its trace and log-probabilities recorded, and its stop conditions checked (``confkv.engine.stopping``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from confkv.cache.manager import CacheManager
from confkv.confidence import confidence_signals
from confkv.controllers import StepSignals
from confkv.engine.recall import Recaller, reselects
from confkv.engine.runner import ForwardResult
from confkv.engine.sampler import sample
from confkv.engine.scheduler import ScheduledChunk
from confkv.engine.sequence import RequestOutput, Sequence, StepOutput, TokenLogprobs
from confkv.engine.stopping import stop_reason
from confkv.kv.pool import BlockPool

Finish = Callable[[Sequence, str], None]
Fail = Callable[[Sequence, str, str], StepOutput]


class Decoder:
    """Signals -> budgets -> recalls -> sampled tokens -> stop checks, for one step's sampling rows."""

    def __init__(self, pool: BlockPool, manager: CacheManager, recall: Recaller, tokenizer: Any,
                 eos_token_ids: frozenset[int], max_model_len: int, finish: Finish, fail: Fail) -> None:  # fmt: skip
        self.pool = pool
        self.manager = manager
        self.recall = recall
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._finish = finish
        self._fail = fail

    def step(self, res: ForwardResult, chunks: list[ScheduledChunk]) -> list[StepOutput]:
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
            if seq.seq_id in res.captured and reselects(ch):
                if self.manager.reselect(seq.kv, seq.last_query[0], state.budget):
                    self.recall.defer(seq)
                    deferred.add(i)
            elif c.evicts and state.budget > seq.ctrl.budget:
                expanded[i] = True
                if self.recall.expand(seq, state.budget, res):
                    self.recall.defer(seq)
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
            reason = stop_reason(seq, token, self.eos_token_ids, self.max_model_len, self.tokenizer)
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
