"""Pass-key retrieval prompts: a random key hidden at a chosen depth in filler text, asked for at the end.

The filler is the classic repeated pass-key haystack (Mohtashami and Jaggi, 2023): it carries no information, so
the only way to answer is to attend back to the key.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from confkv.bench.corpus import prose_passage, split_passage

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyItem:
    prompt: str
    key: str
    depth: float
    num_tokens: int

    def correct(self, answer: str) -> bool:
        return self.key in answer


def _boundary(text: str, at: int) -> int:
    """Where to put the key at or before ``at``: after the last sentence, else after the last line or word (a
    passage with no ". " before ``at`` put it after its first character, splitting a word, at any depth)."""
    for sep in (". ", "\n", " "):
        if (i := text.rfind(sep, 0, at)) >= 0:
            return i + len(sep)
    return 0


def passkey_item(
    tokenizer: PreTrainedTokenizerBase,
    num_tokens: int,
    depth: float,
    seed: int,
    digits: int = 5,
    filler: str = "repeat",
    split: str | None = None,
) -> PasskeyItem:
    """A prompt of about ``num_tokens`` tokens with the key after ``depth`` (0 = start, 1 = end) of the filler.

    ``filler="repeat"`` is the classic repeated haystack; ``"prose"`` is real documentation text, where the key
    does not stand out during prefill the way it does among identical sentences. ``split`` draws the prose from
    that split's documentation topics only (``corpus.split_passage``), so a policy tuned on ``train`` items never
    reads a ``heldout`` haystack; without it the prose comes from every topic.
    """
    rng = random.Random(seed)
    key = str(rng.randrange(10 ** (digits - 1), 10**digits))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
    fixed = len(tokenizer(INTRO + needle + QUESTION)["input_ids"])
    if filler == "repeat":
        per_filler = len(tokenizer(FILLER * 8)["input_ids"]) / 8
        repeats = max(1, round((num_tokens - fixed) / per_filler))
        before = round(repeats * depth)
        haystack_before, haystack_after = FILLER * before, FILLER * (repeats - before)
    elif filler == "prose":
        chars = 8 * num_tokens
        passage = split_passage(chars, seed, split) if split is not None else prose_passage(chars, seed)
        ids = tokenizer(passage)["input_ids"][: max(1, num_tokens - fixed)]
        text = tokenizer.decode(ids)
        cut = _boundary(text, round(len(text) * depth)) if depth > 0 else 0
        haystack_before, haystack_after = text[:cut], text[cut:]
        if haystack_before and not haystack_before.endswith("\n"):
            haystack_before += "\n"
    else:
        raise ValueError(f"filler must be 'repeat' or 'prose' (got {filler!r})")
    prompt = INTRO + haystack_before + needle + haystack_after + QUESTION
    return PasskeyItem(prompt=prompt, key=key, depth=depth, num_tokens=len(tokenizer(prompt)["input_ids"]))
