"""The workloads' literal material, read once from the JSON files shipped beside this module in ``data/``.

The chat scenarios, small talk, paste lead-ins and replies, long-generation templates and topics, and multi-key
names are text a reader reviews and extends as text, so they live in data files rather than in the code that draws
from them. Their order matters: the train split takes the even-positioned entries of each list and heldout the odd
ones (``items.of_split``), so an entry inserted in the middle moves the rest across the split, and every seed's
items change. Append instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Scenario:
    """Facts given in the first turn, a short acknowledgement, and a last turn that needs those facts."""

    name: str
    opening: str
    ack: str
    final: str
    slots: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class ChatMaterial:
    """Everything a chat is assembled from: its scenarios, the small talk between the facts and the question, and
    the lead-ins and canned replies around a pasted passage of a long chat."""

    scenarios: tuple[Scenario, ...]
    small_talk: tuple[tuple[str, str], ...]
    paste_leadins: tuple[str, ...]
    paste_replies: tuple[str, ...]


def _read(name: str) -> dict[str, Any]:
    text = resources.files(__package__).joinpath("data", name).read_text(encoding="utf-8")
    return json.loads(text)


def _strings(values: Any, where: str) -> tuple[str, ...]:
    """A non-empty list of strings as a tuple: a malformed data file fails here, by name, not as a draw later."""
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise ValueError(f"workload data {where} must be a non-empty list of strings")
    return tuple(values)


@functools.cache
def chat_material() -> ChatMaterial:
    """``data/chat.json``; a slot given as ``"@NAME"`` takes the shared list ``NAME`` (names, weekdays)."""
    doc = _read("chat.json")
    shared = {k: _strings(v, f"chat.json shared.{k}") for k, v in doc["shared"].items()}

    def slot(where: str, values: Any) -> tuple[str, ...]:
        if isinstance(values, str) and values.startswith("@"):
            return shared[values[1:]]
        return _strings(values, where)

    scenarios = tuple(
        Scenario(
            s["name"],
            s["opening"],
            s["ack"],
            s["final"],
            {k: slot(f"chat.json {s['name']}.{k}", v) for k, v in s["slots"].items()},
        )
        for s in doc["scenarios"]
    )
    small_talk = tuple((str(q), str(a)) for q, a in doc["small_talk"])
    return ChatMaterial(
        scenarios,
        small_talk,
        _strings(doc["paste_leadins"], "chat.json paste_leadins"),
        _strings(doc["paste_replies"], "chat.json paste_replies"),
    )


@functools.cache
def longgen_material() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """``data/longgen.json``: per kind of request (story, report, ...), its templates (``{topic}`` filled in)
    and its topics, in file order."""
    kinds = _read("longgen.json")["kinds"]
    return {
        kind: (_strings(v["templates"], f"longgen.json {kind}.templates"), _strings(v["topics"], f"{kind}.topics"))
        for kind, v in kinds.items()
    }


@functools.cache
def multikey_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``data/multikey.json``: the adjectives and nouns that make the records' key names (``amber-anchor``)."""
    doc = _read("multikey.json")
    return _strings(doc["key_adjectives"], "multikey.json key_adjectives"), _strings(
        doc["key_nouns"], "multikey.json key_nouns"
    )
