"""Teacher-forced scoring that reports each finished item, for the progress of long evaluations.

``confkv.scoring.Scorer.score`` runs a batch of items to the end and only draws a terminal bar; an evaluation of
ten episodes, or the references of a workload, is then one silent block of a minute or more in a log file. This
is the same loop (one session, every item added, ``step`` until finished, results in item order), calling
``on_done`` as each item finishes, so a ``confkv.progress`` stage can count items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from confkv.scoring import ScoreItem, Scorer, ScoreResult

if TYPE_CHECKING:
    from confkv.controllers import Controller
    from confkv.engine.engine import LLMEngine


def score_items(
    engine: LLMEngine,
    items: list[ScoreItem],
    *,
    keep_topk: int = 0,
    on_done: Callable[[ScoreItem], None] | None = None,
    controller: Controller | None = None,
) -> list[ScoreResult]:
    """Score every item on ``engine`` (idle), as ``Scorer(engine).score`` does; ``on_done(item)`` per finished one.
    ``controller``: one controller instance for every item instead of the engine's own (as the engine shares its
    own), e.g. one whose network records its decisions."""
    with Scorer(engine).session(keep_topk) as session:
        indices = [session.add(item, controller) for item in items]
        while not session.finished:
            for st in session.step():
                if st.done and on_done is not None:
                    on_done(st.item)
        return [session.result(i) for i in indices]
