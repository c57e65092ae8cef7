"""Evaluation workloads for comparing KV-cache policies, built offline and deterministically.

Five workloads stress different ways a smaller cache can fail:

* ``passkey``: one key hidden at a chosen depth of a haystack (``confkv.bench.passkey``), over a grid of lengths
  and depths; the classic test that evicted context is really gone.
* ``multikey``: several key-value records scattered through real prose, one of them asked for; the model cannot
  know during prefill which record will matter, so a cache that keeps "the" important block is not enough.
* ``prose``: real documentation text for teacher-forced perplexity and KL against the full cache.
* ``longgen``: chat requests for long answers (stories, reports, explanations, tutorials), where the cache grows
  during decoding rather than prefill.
* ``chat``: multi-turn conversations whose last turn refers back to facts given in the first one.

Nothing is downloaded: the text is CPython's own ``pydoc_data`` topics (``confkv.bench.corpus``) and the
templates below. Every random choice comes from ``random.Random`` seeded by a SHA-256 of a string naming the
workload, split, seed and item (Python's ``hash()`` is salted per process), so a seed gives the same items on
every machine with the same Python and tokenizer.

How train and heldout are kept apart (a policy tuned on ``train`` must never have seen a ``heldout`` item):

* passkey, multikey: the random streams are seeded with the split's name, and the numbers asked for are
  disjoint by parity: train keys and values are even, heldout ones odd. Multikey's key names use disjoint noun
  lists, and its filler and passkey's ``prose`` filler come from disjoint documentation topics
  (``corpus.split_passage``).
* prose: passages come from disjoint sets of documentation topics (``corpus.topic_splits``; topics that quote
  each other are kept in the same split).
* longgen: each kind of request has its own templates and topics; train uses the even-numbered ones of both,
  heldout the odd-numbered ones, so the splits share neither a template nor a topic.
* chat: the scenarios (the facts given and the question that refers back to them) and the small-talk
  question-answer pairs between them are split the same way, by even and odd position; so are the lead-ins and
  replies of long chats, whose pasted passages come from the split's own documentation topics.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confkv.bench.corpus import split_passage, split_text
from confkv.bench.passkey import passkey_item

WORKLOADS: tuple[str, ...] = ("passkey", "multikey", "prose", "longgen", "chat")
SPLITS: tuple[str, ...] = ("train", "heldout")
RETRIEVAL_MAX_TOKENS = 8  # "The pass key is" is followed by the number at once: a few tokens say whether it is right

_DEFAULTS: dict[str, dict[str, Any]] = {
    "passkey": {"lengths": (1000, 2000), "depths": (0.1, 0.5, 0.9), "filler": "repeat"},
    "multikey": {"length": 1500, "num_pairs": 8},
    "prose": {"length": 1024, "context": 0},
    "longgen": {"max_tokens": 512},
    "chat": {"turns": 3, "max_tokens": 128, "length": 0},
}
PASSKEY_FILLERS: tuple[str, ...] = ("repeat", "prose")


@dataclass(frozen=True)
class WorkloadItem:
    """One request of a workload, already tokenized, so every policy is given exactly the same ids."""

    workload: str
    item_id: str
    split: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    answer: str | None = None
    score_from: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def correct(self, text: str) -> bool | None:
        """Whether ``text`` contains the answer; ``None`` for items that have none (prose, longgen, chat).

        A numeric answer must not be part of a longer number, so "123456" does not count as finding "23456".
        """
        if self.answer is None:
            return None
        if self.answer.isdigit():
            return re.search(rf"(?<!\d){re.escape(self.answer)}(?!\d)", text) is not None
        return self.answer in text


def make_workload(
    name: str, tokenizer: Any, split: str = "heldout", n: int = 4, seed: int = 0, **sizes: Any
) -> list[WorkloadItem]:
    """``n`` items of workload ``name`` (passkey: ``n`` repetitions of its length x depth grid).

    ``sizes`` overrides the workload's defaults (``_DEFAULTS``); a keyword the workload does not take is an error
    rather than silently ignored, since a misspelt size would otherwise benchmark the wrong thing.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose from {', '.join(SPLITS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer (got {n!r})")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer (got {seed!r})")
    unknown = sorted(set(sizes) - set(_DEFAULTS[name]))
    if unknown:
        allowed = ", ".join(_DEFAULTS[name])
        raise ValueError(f"unknown size keyword(s) for workload {name!r}: {', '.join(unknown)} (allowed: {allowed})")
    builder: Callable[..., list[WorkloadItem]] = _BUILDERS[name]
    return builder(tokenizer, split, n, seed, **{**_DEFAULTS[name], **sizes})


# --- helpers -------------------------------------------------------------------------------------------------


def _seed(*parts: object) -> int:
    """A 64-bit seed from a description of the draw: stable across processes, unlike ``hash()``."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


def _rng(*parts: object) -> random.Random:
    return random.Random(_seed(*parts))


def _item_id(name: str, split: str, i: int) -> str:
    return f"{name}-{split}-{i:04d}"


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer(text)["input_ids"])


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, ...]:
    """The chat template's ids; transformers returns a list or (newer versions) a BatchEncoding."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return tuple(int(t) for t in out)


def _split_parity(split: str) -> int:
    """Train numbers are even, heldout numbers odd: the splits can never ask for the same key."""
    return SPLITS.index(split)


def _of_split(pool: Sequence[Any], split: str) -> list[Any]:
    """The even-positioned entries of ``pool`` for train, the odd-positioned ones for heldout."""
    return list(pool[_split_parity(split) :: 2])


def _check_int(workload: str, key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{workload} {key} must be an integer in [{lo}, {hi}] (got {value!r})")
    return value


def _prose_ids(tokenizer: Any, num_tokens: int, seed: int, split: str) -> tuple[int, ...]:
    """At least ``num_tokens`` tokens of ``split``'s documentation (cut to exactly that many)."""
    if num_tokens <= 0:
        return ()
    chars = 6 * num_tokens + 200  # above any real tokenizer's characters per token, so one try is the rule
    limit = len(split_text(split))
    while True:
        if chars >= limit:
            raise ValueError(f"{num_tokens} tokens of prose is more than the {split} documentation holds")
        ids = _encode(tokenizer, split_passage(chars, seed, split))
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        chars *= 2


# --- passkey -------------------------------------------------------------------------------------------------


def _passkey(
    tokenizer: Any,
    split: str,
    n: int,
    seed: int,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    filler: str | Sequence[str],
) -> list[WorkloadItem]:
    """A key per cell of fillers x lengths x depths, ``n`` times; the cell (not the item's index) seeds it, so
    adding a depth or a filler to the grid leaves the other cells' keys as they were.

    ``filler`` is one of ``PASSKEY_FILLERS`` or a sequence of them: repeated filler shows whether a policy keeps a
    key that stands out, prose whether it keeps one that reads like the text around it.
    """
    if isinstance(lengths, (int, str)) or not lengths:
        raise ValueError(f"passkey lengths must be a non-empty sequence of integers (got {lengths!r})")
    if isinstance(depths, (int, float, str)) or not depths:
        raise ValueError(f"passkey depths must be a non-empty sequence of numbers in [0, 1] (got {depths!r})")
    lengths = tuple(_check_int("passkey", "length", length, 16, 1 << 20) for length in lengths)
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
            raise ValueError(f"passkey depths must be numbers in [0, 1] (got {d!r})")
    fillers = (filler,) if isinstance(filler, str) else tuple(filler)
    if not fillers or any(f not in PASSKEY_FILLERS for f in fillers) or len(set(fillers)) != len(fillers):
        raise ValueError(f"passkey filler must be 'repeat', 'prose' or a sequence of both (got {filler!r})")
    parity = _split_parity(split)
    items: list[WorkloadItem] = []
    for rep in range(n):
        for kind in fillers:
            # the repeated filler's cells keep the seeds they had before fillers could be combined
            cell_tag: tuple[str, ...] = () if kind == "repeat" else (kind,)
            for length in lengths:
                for depth in depths:
                    attempt = 0
                    while True:  # passkey_item draws the key itself: redraw until it has the split's parity
                        item = passkey_item(
                            tokenizer,
                            length,
                            depth,
                            _seed("passkey", split, seed, rep, length, depth, *cell_tag, attempt),
                            filler=kind,
                            split=split,
                        )
                        if int(item.key) % 2 == parity:
                            break
                        attempt += 1
                    items.append(
                        WorkloadItem(
                            workload="passkey",
                            item_id=_item_id("passkey", split, len(items)),
                            split=split,
                            prompt_ids=_encode(tokenizer, item.prompt),
                            max_tokens=RETRIEVAL_MAX_TOKENS,
                            answer=item.key,
                            meta={"length": length, "depth": float(depth), "filler": kind, "repeat": rep},
                        )
                    )
    return items


# --- multikey ------------------------------------------------------------------------------------------------

_KEY_ADJECTIVES = (
    "amber", "brisk", "copper", "dusty", "eager", "frosty", "gentle", "hollow",
    "ivory", "jolly", "lunar", "misty", "noble", "quiet", "rusty", "silver",
)  # fmt: skip
_KEY_NOUNS = (
    "anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor",
    "island", "jaguar", "kettle", "lantern", "meadow", "nectar", "orchard", "pebble",
    "quartz", "raven", "saddle", "thistle", "tunnel", "urchin", "violet", "walrus",
    "willow", "yarrow", "zephyr", "beacon", "cobalt", "ferret", "garnet", "heron",
)  # fmt: skip
MULTIKEY_INTRO = (
    "Several key-value records are hidden inside a long text that is otherwise irrelevant. "
    "Read it carefully and remember every record.\n"
)
MAX_PAIRS = 64


def _record(key: str, value: int) -> str:
    return f"The value for key {key} is {value}.\n"


def _multikey_question(key: str) -> str:
    return f"\nWhat is the value for key {key}? The value for key {key} is"


def _sentence_line_starts(text: str) -> list[int]:
    """Offsets where a line starts after a finished sentence or paragraph: a record there does not cut a
    sentence in two (the documentation is hard-wrapped, so most line starts are mid-sentence)."""
    return [0] + [m.end() for m in re.finditer(r"(?<=[.:\n]) *\n", text)]


def _multikey(tokenizer: Any, split: str, n: int, seed: int, *, length: int, num_pairs: int) -> list[WorkloadItem]:
    """Records inserted between sentences of real prose, so they read as part of the document, not as a list."""
    length = _check_int("multikey", "length", length, 16, 1 << 20)
    num_pairs = _check_int("multikey", "num_pairs", num_pairs, 1, MAX_PAIRS)
    names = [f"{a}-{b}" for a in _KEY_ADJECTIVES for b in _of_split(_KEY_NOUNS, split)]
    parity = _split_parity(split)
    items: list[WorkloadItem] = []
    for i in range(n):
        rng = _rng("multikey", split, seed, i)
        keys = rng.sample(names, num_pairs)
        values = [2 * v + parity for v in rng.sample(range(5000, 50000), num_pairs)]  # distinct 5-digit numbers
        records = [_record(k, v) for k, v in zip(keys, values, strict=True)]
        target = rng.randrange(num_pairs)
        question = _multikey_question(keys[target])
        fixed = len(_encode(tokenizer, MULTIKEY_INTRO + "".join(records) + question))
        if fixed > length:
            raise ValueError(
                f"multikey length {length} is too short for {num_pairs} pairs: they and the question alone take "
                f"{fixed} tokens"
            )
        filler_ids = _prose_ids(tokenizer, length - fixed, rng.getrandbits(64), split)
        filler = tokenizer.decode(list(filler_ids)) if filler_ids else ""
        if filler and not filler.endswith("\n"):
            filler = filler[: filler.rfind(" ")] if " " in filler else filler  # no half word before the question
            filler += "\n"
        positions = sorted(rng.choice(_sentence_line_starts(filler)) for _ in range(num_pairs))
        order = list(range(num_pairs))
        rng.shuffle(order)
        parts, last, target_at = [MULTIKEY_INTRO], 0, 0
        offset = len(MULTIKEY_INTRO)
        for pos, k in zip(positions, order, strict=True):
            parts.append(filler[last:pos])
            offset += pos - last
            if k == target:
                target_at = offset
            parts.append(records[k])
            offset += len(records[k])
            last = pos
        parts += [filler[last:], question]
        prompt = "".join(parts)
        items.append(
            WorkloadItem(
                workload="multikey",
                item_id=_item_id("multikey", split, i),
                split=split,
                prompt_ids=_encode(tokenizer, prompt),
                max_tokens=RETRIEVAL_MAX_TOKENS,
                answer=str(values[target]),
                meta={
                    "length": length,
                    "num_pairs": num_pairs,
                    "key": keys[target],
                    "depth": round(target_at / len(prompt), 3),
                },
            )
        )
    return items


# --- prose ---------------------------------------------------------------------------------------------------


def _prose(tokenizer: Any, split: str, n: int, seed: int, *, length: int, context: int) -> list[WorkloadItem]:
    """Raw text (no chat template): perplexity is measured on the text the model would read, nothing added."""
    length = _check_int("prose", "length", length, 2, 1 << 16)
    context = _check_int("prose", "context", context, 0, length - 1)
    return [
        WorkloadItem(
            workload="prose",
            item_id=_item_id("prose", split, i),
            split=split,
            prompt_ids=_prose_ids(tokenizer, length, _seed("prose", split, seed, i), split),
            max_tokens=0,
            score_from=context,
            meta={"length": length, "context": context},
        )
        for i in range(n)
    ]


# --- longgen -------------------------------------------------------------------------------------------------

_LONGGEN: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "story": (
        (
            "Write a long short story about {topic}. Give the characters names, describe the setting in detail, "
            "and build to a clear ending.",
            "Tell me a story about {topic}. Use dialogue, describe what the characters feel, and let the story "
            "unfold over several scenes.",
            "Write the first chapter of a novel about {topic}. Introduce the main characters, the world they live "
            "in, and the problem they face.",
            "Write a fairy tale for children about {topic}, with a beginning, a middle and an end, and a lesson at "
            "the close.",
        ),
        (
            "a lighthouse keeper who finds a message in a bottle",
            "a robot that learns to paint",
            "two rival bakers in a small mountain town",
            "a child who discovers a hidden door in the back of a library",
            "an astronaut stranded on a quiet moon",
            "a detective who can only work at night",
            "a family that moves to a farm after years in a big city",
            "a musician who slowly loses her hearing",
            "a dragon that is afraid of heights",
            "a postal worker delivering letters after a flood",
        ),
    ),
    "report": (
        (
            "Write a detailed report on {topic}. Include an introduction, several sections with headings, and a "
            "conclusion with recommendations.",
            "Prepare a briefing document for a city council about {topic}. Cover the background, the key facts, "
            "the options, and your recommendation.",
            "Write an essay analysing {topic}. Present the main arguments on each side and support them with examples.",
            "Write a magazine feature article about {topic}, with background, a few invented interviews, and a look "
            "at the future.",
        ),
        (
            "the causes and effects of urban air pollution",
            "the history of the printing press",
            "renewable energy adoption in small countries",
            "the economics of public transport",
            "how remote work changed office buildings",
            "the decline of bee populations",
            "water scarcity in agriculture",
            "the growth of online education",
            "the effect of smartphones on sleep",
            "food waste in supermarkets",
        ),
    ),
    "explanation": (
        (
            "Explain {topic} in depth, step by step, as if to a curious high-school student. Use analogies and "
            "examples.",
            "Give a thorough explanation of {topic}. Start with the basic ideas, then go into the details, and "
            "finish with common misconceptions.",
            "I am preparing a lecture. Write out a full explanation of {topic}: an outline first, then each part "
            "explained in detail.",
            "Write a long question-and-answer explainer about {topic}, covering at least ten questions a beginner "
            "would ask.",
        ),
        (
            "how vaccines train the immune system",
            "how a compiler turns source code into machine code",
            "why the sky is blue and sunsets are red",
            "how public-key cryptography works",
            "how the heart pumps blood through the body",
            "how plate tectonics shapes the continents",
            "how a neural network learns from data",
            "how inflation affects savings and wages",
            "how GPS works out your position",
            "how photosynthesis stores the energy of sunlight",
        ),
    ),
    "tutorial": (
        (
            "Write a complete step-by-step tutorial on {topic}. List what is needed, then explain each step in "
            "detail with tips.",
            "Create a beginner's guide to {topic}, with numbered steps, common mistakes to avoid, and a checklist "
            "at the end.",
            "Write a detailed how-to article on {topic}, organised into sections, with an example for each step.",
            "Walk me through {topic} in detail, from the very first step to the finished result, explaining the "
            "reason behind each step.",
        ),
        (
            "setting up a vegetable garden on a balcony",
            "writing a command-line tool in Python",
            "baking sourdough bread at home",
            "building a simple website with HTML and CSS",
            "training for a first half marathon",
            "using Git for version control",
            "planning a monthly household budget",
            "making a podcast, from recording to publishing",
            "repairing a flat bicycle tire",
            "learning to play chess as an adult",
        ),
    ),
}


def longgen_prompts(split: str) -> list[tuple[str, str, str]]:
    """Every ``(kind, template, topic)`` of ``split``; the two splits share no template and no topic."""
    return [
        (kind, template, topic)
        for kind, (templates, topics) in _LONGGEN.items()
        for template in _of_split(templates, split)
        for topic in _of_split(topics, split)
    ]


def _longgen(tokenizer: Any, split: str, n: int, seed: int, *, max_tokens: int) -> list[WorkloadItem]:
    """Requests drawn without replacement (a seeded shuffle of the split's pool), so items differ until it runs out.

    The prompt asks for about as many words as ``max_tokens`` allows, so the model's own sense of length and the
    generation budget agree instead of the answer ending early with EOS.
    """
    max_tokens = _check_int("longgen", "max_tokens", max_tokens, 16, 4096)
    words = max(10, round(0.075 * max_tokens) * 10)
    pool = longgen_prompts(split)
    _rng("longgen", split, seed).shuffle(pool)
    items = []
    for i in range(n):
        kind, template, topic = pool[i % len(pool)]
        text = template.format(topic=topic) + f" Aim for about {words} words."
        items.append(
            WorkloadItem(
                workload="longgen",
                item_id=_item_id("longgen", split, i),
                split=split,
                prompt_ids=render_chat(tokenizer, [{"role": "user", "content": text}]),
                max_tokens=max_tokens,
                meta={"kind": kind, "topic": topic},
            )
        )
    return items


# --- chat ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Scenario:
    """Facts given in the first turn, a short acknowledgement, and a last turn that needs those facts."""

    name: str
    opening: str
    ack: str
    final: str
    slots: dict[str, tuple[str, ...]]


_NAMES = ("Maya", "Tom", "Aisha", "Lukas", "Priya", "Diego", "Hannah", "Kenji", "Olga", "Samuel")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

_SCENARIOS: tuple[_Scenario, ...] = (
    _Scenario(
        "trip",
        "Hi! My name is {name}. I'm planning a {days}-day trip to {city} in {month}, and I'm travelling with my "
        "{companion}.",
        "Nice to meet you, {name}! A trip to {city} sounds great, and I'd be glad to help you plan it.",
        "Thanks. Back to my trip: can you suggest a day-by-day plan that fits the number of days I mentioned, "
        "including something the person I'm travelling with would enjoy?",
        {
            "name": _NAMES,
            "days": ("3", "4", "5", "7", "10"),
            "city": ("Lisbon", "Kyoto", "Montreal", "Edinburgh", "Buenos Aires", "Cape Town", "Vienna", "Hanoi"),
            "month": ("March", "May", "July", "October", "December"),
            "companion": ("sister", "elderly father", "two young kids", "best friend", "partner"),
        },
    ),
    _Scenario(
        "dinner",
        "I'm cooking dinner for {guests} friends on {weekday}. One of them is allergic to {allergen}, and I "
        "already have {ingredient} in the fridge.",
        "That sounds like a fun evening. I'll keep the allergy and your ingredients in mind.",
        "OK, back to the dinner: what main course would you suggest, given the allergy and the ingredient I told "
        "you about? And how much should I make for the number of guests?",
        {
            "guests": ("three", "four", "five", "six", "eight"),
            "weekday": _WEEKDAYS,
            "allergen": ("peanuts", "shellfish", "gluten", "eggs", "dairy", "sesame"),
            "ingredient": ("a whole chicken", "a bag of lentils", "fresh salmon", "a lot of mushrooms", "tofu"),
        },
    ),
    _Scenario(
        "code",
        "I'm writing a {language} program that reads {fmt} files from a folder called {folder} and counts how "
        "many {thing} each file contains.",
        "Got it: a {language} program that reads {fmt} files from {folder}. Happy to help when you're ready.",
        "Now please write the program I described at the start, in the language I mentioned, with comments.",
        {
            "language": ("Python", "Go", "Rust", "JavaScript", "Java"),
            "fmt": ("CSV", "JSON", "Markdown", "log", "XML"),
            "folder": ("data", "inbox", "reports", "archive", "input"),
            "thing": ("lines", "words", "unique email addresses", "dates", "error messages"),
        },
    ),
    _Scenario(
        "pet",
        "My {pet} {petname} is {age} years old and has stopped eating {food} over the last few days.",
        "I'm sorry to hear about {petname}. A change in appetite is worth watching closely.",
        "Going back to my pet: what questions should I ask the vet, and can you remind me of its name and age?",
        {
            "pet": ("dog", "cat", "rabbit", "parrot", "guinea pig"),
            "petname": ("Biscuit", "Luna", "Pepper", "Oscar", "Mochi", "Ziggy"),
            "age": ("two", "four", "seven", "nine", "twelve"),
            "food": ("its dry food", "treats", "vegetables", "its usual breakfast"),
        },
    ),
    _Scenario(
        "budget",
        "I earn {income} dollars a month after tax, my rent is {rent} dollars, and I want to save for a {goal}.",
        "Thanks for sharing that. Saving for a {goal} is a good plan; let's see what is realistic.",
        "Using the numbers I gave you at the beginning, how much could I put aside each month, and how long "
        "until I can afford what I'm saving for?",
        {
            "income": ("2,400", "3,100", "3,800", "4,500", "5,200"),
            "rent": ("850", "1,100", "1,350", "1,600"),
            "goal": ("used car", "trip to Japan", "new laptop", "house deposit", "wedding"),
        },
    ),
    _Scenario(
        "bookclub",
        "I run a book club that meets every other {weekday}. We're reading {book} this month, and we have "
        "{members} members.",
        "What a lovely club! {book} should give you plenty to talk about.",
        "Could you remind me which day we meet, and suggest five discussion questions about the book we are reading?",
        {
            "weekday": _WEEKDAYS,
            "book": ("Pride and Prejudice", "The Old Man and the Sea", "Frankenstein", "Jane Eyre", "Moby-Dick"),
            "members": ("six", "eight", "ten", "twelve"),
        },
    ),
    _Scenario(
        "garden",
        "I have a small garden in {place} that gets {sun} of sun a day, and I'd like to grow {plant}.",
        "Growing {plant} can work well with the right care. Let's make a plan.",
        "Coming back to my garden: given where I live and the sunlight I mentioned, when should I plant, and what "
        "should I watch out for?",
        {
            "place": ("northern Scotland", "southern Spain", "Minnesota", "coastal Oregon", "central Texas"),
            "sun": ("about three hours", "about five hours", "six to eight hours", "nearly ten hours"),
            "plant": ("tomatoes", "strawberries", "lavender", "potatoes", "peppers"),
        },
    ),
    _Scenario(
        "interview",
        "I have a job interview next {weekday} for a {role} position at a {company} company. I have {years} "
        "years of experience in {field}.",
        "Good luck! Preparing well will make a big difference.",
        "Back to my interview: what questions might they ask for the role I described, and how should I talk "
        "about my experience?",
        {
            "weekday": _WEEKDAYS,
            "role": ("project manager", "data analyst", "nurse", "teacher", "software engineer", "accountant"),
            "company": ("small family-run", "fast-growing startup", "large international", "non-profit"),
            "years": ("two", "five", "eight", "fifteen"),
            "field": ("retail", "healthcare", "logistics", "education", "banking"),
        },
    ),
)

_SMALL_TALK: tuple[tuple[str, str], ...] = (
    ("What is the boiling point of water at sea level?", "100 degrees Celsius, or 212 degrees Fahrenheit."),
    ("How many continents are there?", "Seven: Africa, Antarctica, Asia, Australia, Europe and the two Americas."),
    ("Who wrote Pride and Prejudice?", "Jane Austen; it was published in 1813."),
    ("What is the largest planet in the solar system?", "Jupiter."),
    ("Can you give me a synonym for 'happy'?", "Sure: 'cheerful', 'content' or 'joyful'."),
    ("How many minutes are in a day?", "1,440 minutes."),
    ("What's the chemical symbol for gold?", "Au, from the Latin 'aurum'."),
    ("What is the capital of Canada?", "Ottawa."),
    ("How do I convert Celsius to Fahrenheit?", "Multiply by 9/5, then add 32."),
    ("What does 'CPU' stand for?", "Central processing unit."),
    ("Is a tomato a fruit or a vegetable?", "Botanically a fruit, though it is usually cooked as a vegetable."),
    ("How far is the Moon from Earth?", "About 384,400 kilometres on average."),
    ("What's a good way to remember a new word?", "Use it in a sentence of your own a few times over the next days."),
    ("How many legs does a spider have?", "Eight."),
    ("What language is spoken in Brazil?", "Portuguese."),
    ("What is the square root of 144?", "12."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci."),
    ("How long should I steep green tea?", "Two to three minutes, in water at about 80 degrees Celsius."),
    ("What's the difference between weather and climate?", "Weather is day to day; climate is the long-term average."),
    ("How many bones are in the adult human body?", "206."),
    ("In what year did people first walk on the Moon?", "1969, during Apollo 11."),
    ("What's the longest river in the world?", "The Nile, though some measurements favour the Amazon."),
    ("Can you suggest a quick stretch for my back?", "Try a gentle cat-cow stretch on your hands and knees."),
    ("What's the freezing point of water in Fahrenheit?", "32 degrees Fahrenheit."),
    ("How many players does a football team have on the field?", "Eleven per side."),
    ("What does a thesaurus do?", "It lists words with similar and opposite meanings."),
    ("How fast does light travel?", "About 300,000 kilometres per second."),
    ("What's the plural of 'cactus'?", "'Cacti', though 'cactuses' is also accepted."),
    ("How much sleep do adults need?", "Most adults need seven to nine hours a night."),
    (
        "What is photosynthesis, in one sentence?",
        "Plants turning light, water and carbon dioxide into sugar and oxygen.",
    ),
    ("Which ocean is the largest?", "The Pacific."),
    ("What's a haiku?", "A three-line poem of five, seven and five syllables."),
)
MAX_TURNS = 2 + len(_SMALL_TALK) // 2  # opening + every small-talk pair of a split + the final question

#: Long chats: the user pastes documentation between the facts and the question (people do paste documents into
#: a chat), which makes a conversation thousands of tokens long with text the model cannot predict from the rest.
_PASTE_LEADINS: tuple[str, ...] = (
    "While we're at it, here is a section of the Python documentation I'm reading:",
    "I'm also learning Python. This is the part of the reference I read today:",
    "Unrelated, but I copied this from the Python reference to read later:",
    "Here's another bit of the Python docs I'm working through:",
    "Can you keep this section of the Python reference in mind for later?",
    "I'm preparing a talk on Python. This is the passage I'm building it on:",
    "Here is some documentation I have to review for work:",
    "A colleague sent me this excerpt from the Python language reference:",
)
_PASTE_REPLIES: tuple[str, ...] = (
    "Thanks, I've read that section. Let me know what you'd like to do with it.",
    "Got it. That part of the reference is quite detailed; happy to go through it whenever you like.",
    "I've taken a look. Feel free to ask about anything in it.",
    "Noted. It states the rules precisely, so it's worth reading slowly.",
    "Thanks for sharing. I can summarise or explain any part of it.",
    "All right, I have that passage in front of me now.",
    "Okay. If anything in it is unclear, just ask.",
    "Understood. We can come back to it later.",
)
_MIN_PASTE_TOKENS = 16


def _passage_text(tokenizer: Any, ids: tuple[int, ...]) -> str:
    """Decoded documentation ending at a line (or at least a word) boundary, so no turn ends mid-word."""
    text = tokenizer.decode(list(ids)).strip()
    cut = text.rfind("\n")
    if cut < len(text) // 2:
        cut = text.rfind(" ")
    return text[:cut].rstrip() if cut > 0 else text


def _chat(
    tokenizer: Any, split: str, n: int, seed: int, *, turns: int, max_tokens: int, length: int
) -> list[WorkloadItem]:
    """``turns`` user turns: the facts, then small talk or pasted documentation, then a question about the facts.

    The turns in between sit between the facts and the question, so a cache that keeps only recent tokens loses
    what the last turn asks about; canned replies keep the history independent of any model. ``length`` 0 gives
    short chats whose middle turns are small-talk pairs; ``length > 0`` makes the conversation about that many
    tokens by pasting the split's documentation into the middle turns (each followed by a short reply), so a
    chat is long enough that every evicting policy must evict before the question.
    """
    turns = _check_int("chat", "turns", turns, 2, MAX_TURNS)
    max_tokens = _check_int("chat", "max_tokens", max_tokens, 1, 4096)
    length = _check_int("chat", "length", length, 0, 1 << 16)
    if length and turns < 3:
        raise ValueError(f"a long chat (length {length}) needs turns >= 3: the facts, a pasted passage, the question")
    scenarios = _of_split(_SCENARIOS, split)
    small_talk = _of_split(_SMALL_TALK, split)
    leadins, replies = _of_split(_PASTE_LEADINS, split), _of_split(_PASTE_REPLIES, split)
    # long chats take the split's scenarios in turn (from a seeded start), so a handful of them covers every one
    first = _rng("chat-order", split, seed).randrange(len(scenarios))
    items = []
    for i in range(n):
        rng = _rng("chat", split, seed, i)
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
                passage = _passage_text(tokenizer, _prose_ids(tokenizer, per_turn, passage_seed, split))
                middle += _paste_turn(lead, passage, reply)
        items.append(
            WorkloadItem(
                workload="chat",
                item_id=_item_id("chat", split, i),
                split=split,
                prompt_ids=render_chat(tokenizer, opening + middle + final),
                max_tokens=max_tokens,
                meta={"turns": turns, "scenario": scenario.name, "length": length},
            )
        )
    return items


def _paste_turn(lead: str, passage: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{lead}\n\n{passage}"}, {"role": "assistant", "content": reply}]


_BUILDERS: dict[str, Callable[..., list[WorkloadItem]]] = {
    "passkey": _passkey,
    "multikey": _multikey,
    "prose": _prose,
    "longgen": _longgen,
    "chat": _chat,
}
