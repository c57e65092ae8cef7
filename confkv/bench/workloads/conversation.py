"""Workloads of running text and conversation, where quality is measured against the full cache's own output.

* ``prose``: real documentation text for teacher-forced perplexity and KL against the full cache.
* ``longgen``: chat requests for long answers (stories, reports, explanations, tutorials), where the cache grows
  during decoding rather than prefill.
* ``chat``: multi-turn conversations whose last turn refers back to facts given in the first one.

The requests, scenarios and small talk are data (``data/longgen.json``, ``data/chat.json``).
"""

from __future__ import annotations

from typing import Any

from confkv.bench.workloads.data import chat_material, longgen_material
from confkv.bench.workloads.items import (
    WorkloadItem,
    check_int,
    item_id,
    of_split,
    prose_ids,
    render_chat,
    rng_of,
    seed_of,
)

_MIN_PASTE_TOKENS = 16


def max_turns() -> int:
    """The most user turns a chat takes: the opening, every small-talk pair of a split, the final question."""
    return 2 + len(chat_material().small_talk) // 2


def prose(tokenizer: Any, split: str, n: int, seed: int, *, length: int, context: int) -> list[WorkloadItem]:
    """Raw text (no chat template): perplexity is measured on the text the model would read, nothing added."""
    length = check_int("prose", "length", length, 2, 1 << 16)
    context = check_int("prose", "context", context, 0, length - 1)
    return [
        WorkloadItem(
            workload="prose",
            item_id=item_id("prose", split, i),
            split=split,
            prompt_ids=prose_ids(tokenizer, length, seed_of("prose", split, seed, i), split),
            max_tokens=0,
            score_from=context,
            meta={"length": length, "context": context},
        )
        for i in range(n)
    ]


def longgen_prompts(split: str) -> list[tuple[str, str, str]]:
    """Every ``(kind, template, topic)`` of ``split``; the two splits share no template and no topic."""
    return [
        (kind, template, topic)
        for kind, (templates, topics) in longgen_material().items()
        for template in of_split(templates, split)
        for topic in of_split(topics, split)
    ]


def longgen(tokenizer: Any, split: str, n: int, seed: int, *, max_tokens: int) -> list[WorkloadItem]:
    """Requests drawn without replacement (a seeded shuffle of the split's pool), so items differ until it runs out.

    The prompt asks for about as many words as ``max_tokens`` allows, so the model's own sense of length and the
    generation budget agree instead of the answer ending early with EOS.
    """
    max_tokens = check_int("longgen", "max_tokens", max_tokens, 16, 4096)
    words = max(10, round(0.075 * max_tokens) * 10)
    pool = longgen_prompts(split)
    rng_of("longgen", split, seed).shuffle(pool)
    items = []
    for i in range(n):
        kind, template, topic = pool[i % len(pool)]
        text = template.format(topic=topic) + f" Aim for about {words} words."
        items.append(
            WorkloadItem(
                workload="longgen",
                item_id=item_id("longgen", split, i),
                split=split,
                prompt_ids=render_chat(tokenizer, [{"role": "user", "content": text}]),
                max_tokens=max_tokens,
                meta={"kind": kind, "topic": topic},
            )
        )
    return items


def _passage_text(tokenizer: Any, ids: tuple[int, ...]) -> str:
    """Decoded documentation ending at a line (or at least a word) boundary, so no turn ends mid-word."""
    text = tokenizer.decode(list(ids)).strip()
    cut = text.rfind("\n")
    if cut < len(text) // 2:
        cut = text.rfind(" ")
    return text[:cut].rstrip() if cut > 0 else text


def chat(
    tokenizer: Any, split: str, n: int, seed: int, *, turns: int, max_tokens: int, length: int
) -> list[WorkloadItem]:
    """``turns`` user turns: the facts, then small talk or pasted documentation, then a question about the facts.

    The turns in between sit between the facts and the question, so a cache that keeps only recent tokens loses
    what the last turn asks about; canned replies keep the history independent of any model. ``length`` 0 gives
    short chats whose middle turns are small-talk pairs; ``length > 0`` makes the conversation about that many
    tokens by pasting the split's documentation into the middle turns (each followed by a short reply), so a
    chat is long enough that every evicting policy must evict before the question.
    """
    turns = check_int("chat", "turns", turns, 2, max_turns())
    max_tokens = check_int("chat", "max_tokens", max_tokens, 1, 4096)
    length = check_int("chat", "length", length, 0, 1 << 16)
    if length and turns < 3:
        raise ValueError(f"a long chat (length {length}) needs turns >= 3: the facts, a pasted passage, the question")
    material = chat_material()
    scenarios = of_split(material.scenarios, split)
    small_talk = of_split(material.small_talk, split)
    leadins, replies = of_split(material.paste_leadins, split), of_split(material.paste_replies, split)
    # long chats take the split's scenarios in turn (from a seeded start), so a handful of them covers every one
    first = rng_of("chat-order", split, seed).randrange(len(scenarios))
    items = []
    for i in range(n):
        rng = rng_of("chat", split, seed, i)
        scenario = scenarios[rng.randrange(len(scenarios))]
        if length:
            scenario = scenarios[(first + i) % len(scenarios)]
        values = {slot: rng.choice(options) for slot, options in scenario.slots.items()}
        opening = [
            {"role": "user", "content": scenario.opening.format(**values)},
            {"role": "assistant", "content": scenario.ack.format(**values)},
        ]
        final = [{"role": "user", "content": scenario.final.format(**values)}]
        middle: list[dict[str, str]] = []
        if not length:
            for question, reply in rng.sample(small_talk, turns - 2):
                middle += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        else:
            pastes = [(rng.choice(leadins), rng.choice(replies), rng.getrandbits(64)) for _ in range(turns - 2)]
            skeleton = [m for lead, reply, _ in pastes for m in _paste_turn(lead, "", reply)]
            fixed = len(render_chat(tokenizer, opening + skeleton + final))
            per_turn = (length - fixed) // len(pastes)
            if per_turn < _MIN_PASTE_TOKENS:
                raise ValueError(
                    f"chat length {length} is too short for {turns} turns: the conversation without its pasted "
                    f"passages takes {fixed} tokens"
                )
            for lead, reply, passage_seed in pastes:
                passage = _passage_text(tokenizer, prose_ids(tokenizer, per_turn, passage_seed, split))
                middle += _paste_turn(lead, passage, reply)
        items.append(
            WorkloadItem(
                workload="chat",
                item_id=item_id("chat", split, i),
                split=split,
                prompt_ids=render_chat(tokenizer, opening + middle + final),
                max_tokens=max_tokens,
                meta={"turns": turns, "scenario": scenario.name, "length": length},
            )
        )
    return items


def _paste_turn(lead: str, passage: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{lead}\n\n{passage}"}, {"role": "assistant", "content": reply}]
