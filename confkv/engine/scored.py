"""Teacher-forced rows: a scored text's chunk, each row's distribution scoring the next token of the text.

The controller sees every token's signals in order; an expansion recalls with the chunk's last query, contraction
waits for the compaction tick, exactly as between decode steps. In a chunk of one token (as ``compact_interval: 1``
gives) a recall is applied to that token as decode applies it: the row is computed again with the recalled blocks
and scored from the second pass, so scoring is decoding with the text forced. In a longer chunk it takes effect from
the next chunk (a decision at a chunk's end governs the next chunk, as an RL environment's action does). A
reselection at the prompt's end (``reselect_after_prompt``) takes effect from the next chunk: the text's first token
is scored as the prompt left the cache.
"""

from __future__ import annotations

from collections.abc import Callable

from confkv.cache.manager import CacheManager
from confkv.confidence import Signals, confidence_signals
from confkv.controllers import StepSignals
from confkv.engine.recall import Recaller, reselects
from confkv.engine.runner import ForwardResult
from confkv.engine.scheduler import ScheduledChunk
from confkv.engine.sequence import Sequence, StepOutput
from confkv.kv.pool import BlockPool


class ScoredRows:
    """Hands a scored sequence's rows to its recorder, moving its budget on the way."""

    def __init__(self, pool: BlockPool, manager: CacheManager, recall: Recaller,
                 finish: Callable[[Sequence, str], None]) -> None:  # fmt: skip
        self.pool = pool
        self.manager = manager
        self.recall = recall
        self._finish = finish

    def step(self, ch: ScheduledChunk, res: ForwardResult, index: int) -> StepOutput:
        seq, kv = ch.seq, ch.seq.kv
        row0, count = res.spans[index]
        resident = res.resident[index]
        if ch.rerun:  # the last row again, after the recall its first pass set off: its signals were counted then
            seq.rerun = 0
            last = confidence_signals(res.logits[row0 + count - 1 : row0 + count])
            return self._record(seq, ch.start + ch.num_tokens - 1, last, resident, [seq.ctrl.budget])
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
        if seq.seq_id in res.captured and reselects(ch):
            self.manager.reselect(kv, seq.last_query[0], state.budget)
        elif c.evicts and state.budget > kv.budget and seq.prompt_done:
            if ch.num_tokens > 1 and kv.prompt_trimmed:
                # the chunk's tokens leave first, as the budget in force says (what ``after_step`` would do next and
                # decoding did token by token), so the expansion recalls into the whole room the new budget gives,
                # as ``LLMEngine.resize`` does between segments; recalled first, they would take that room and be
                # the lowest-scored blocks the trim evicts
                self.manager.evict_to(kv, kv.budget)
            if self.recall.expand(seq, state.budget, res) and ch.num_tokens == 1:
                self.recall.defer(seq)  # the row waits for its second pass
                return StepOutput(seq.request_id, [], finished=False)
        return self._record(seq, first, signals, resident, budgets)

    def _record(self, seq: Sequence, first: int, signals: Signals, resident: int, budgets: list[float]) -> StepOutput:
        """Hand scored rows (predicting tokens ``first + 1 ...``, the last over ``resident`` keys) to the recorder."""
        count = len(budgets)
        seq.kv.stats.resident_sum += sum(resident - count + 1 + i for i in range(count))
        seq.kv.stats.resident_count += count
        seq.recorder.record(first, signals, resident, budgets)
        done = first + count >= len(seq.forced) - 1
        if done:
            self._finish(seq, "length")
        return StepOutput(seq.request_id, [], finished=done)
