"""Long-context synthetic tasks in the manner of NVIDIA's RULER: generated offline from a seed, scored by match.

Each item is a prompt of token ids that fits ``context_length`` (the prompt takes at most
``context_length - max_new_tokens`` tokens, so prompt + answer fit the window, and at least 90% of the window
for lengths >= 1024) and the answer string(s) that the greedy continuation must contain. The amount of
haystack is binary-searched on the real tokenizer. Prompts go through the tokenizer's chat template when it
has one, followed by an answer prefix (as RULER does), so a few greedy tokens suffice.

Tasks: ``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``vt``, ``cwe``, ``fwe``, ``passkey``.
Scoring: ``score`` = fraction of items whose answer strings ALL appear (case-insensitive) in the output;
multi-answer tasks also report ``partial`` = mean fraction of the answer strings found (RULER's
``string_match_all``). ``passkey`` compares the first integer of the output with the key. Fractions in [0, 1], as
``acc`` (the table shows percent).
"""
from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from retrofit.errors import RetrofitError
from retrofit.registry import Registry
from retrofit.textfiles import read_text

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_ADJECTIVES = ("ancient brave calm clever curious daring eager fancy gentle glossy happy hollow humble icy jolly "
               "keen lively lucky mellow merry misty noble odd plain proud quiet rapid rustic shiny silent sleepy "
               "smooth snowy solid spicy steady sturdy sunny swift tall tidy tiny vivid warm wild wise witty young "
               "zesty amber bold crisp dusty fierce golden grumpy hasty loyal polite").split()
_NOUNS = ("apple badger banjo beacon canyon castle cherry comet cookie cricket dragon falcon forest garden glacier "
          "harbor helmet island jacket kettle ladder lantern lemon meadow mirror monkey needle ocean orchard otter "
          "palace pepper pillow pirate planet puzzle rabbit river rocket saddle salmon shadow spider statue sunset "
          "teapot thunder tiger tulip valley violin walrus willow window wizard zebra anchor barrel candle "
          "dolphin").split()
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class SyntheticItem:
    """One generated prompt and the strings the output must contain."""

    task: str
    context_length: int
    seed: int
    index: int
    prompt_ids: tuple[int, ...]
    answers: tuple[str, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class PromptParts:
    """The user message (instructions + haystack + question), the answer prefix, and the answers."""

    user: str
    answer_prefix: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class SyntheticTask:
    """A generator ``build(rng, size, haystack, depth) -> PromptParts`` (``size`` = haystack units, the amount
    that is binary-searched) plus how many tokens to decode and how to score."""

    name: str
    build: Callable[[random.Random, int, "Haystack", float], PromptParts]
    max_new_tokens: int
    first_integer: bool = False

    @property
    def multi_answer(self) -> bool:
        return self.name in {"niah_multivalue", "vt", "cwe", "fwe"}


SYNTHETIC_TASKS: Registry[SyntheticTask] = Registry("synthetic task")


class Haystack:
    """Filler text as a sequence of units: repetitions of the noise paragraph, or sentences of a file."""

    def __init__(self, path: Path | None = None):
        self.path = path
        if path is None:
            self.sentences = [NOISE]
        else:
            if not path.is_file():
                raise RetrofitError(f"haystack file not found: {path}")
            text = " ".join(read_text(path, "haystack file").split())
            self.sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
            if not self.sentences:
                raise RetrofitError(f"haystack file is empty: {path}")

    def units(self, rng: random.Random, count: int) -> list[str]:
        """``count`` consecutive units from a seeded start (cycling through the file)."""
        start = rng.randrange(len(self.sentences))
        return [self.sentences[(start + offset) % len(self.sentences)] for offset in range(count)]


def insert_at_depths(units: list[str], needles: list[tuple[float, str]]) -> str:
    """Join ``units`` with spaces, placing each needle at ``round(depth * len(units))`` (depth in [0, 1])."""
    pieces = list(units)
    for depth, needle in sorted(needles, key=lambda pair: -pair[0]):
        pieces.insert(round(min(max(depth, 0.0), 1.0) * len(units)), needle)
    return " ".join(pieces)


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _pseudo_words(rng: random.Random, count: int, syllables: int = 3) -> list[str]:
    words: set[str] = set()
    ordered = []
    while len(ordered) < count:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if word not in words:
            words.add(word)
            ordered.append(word)
    return ordered


_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _single_answer_prompt(text: str, key: str, value: str) -> PromptParts:
    return PromptParts(f"{_NIAH_INTRO}{text}\nWhat is the special magic number for {key} mentioned in the "
                       "provided text?", f"The special magic number for {key} mentioned in the provided text is",
                       (value,))


def _niah_single(rng, size, haystack, depth):
    key, value = _key(rng), _number(rng)
    text = insert_at_depths(haystack.units(rng, size), [(depth, _needle(key, value))])
    return _single_answer_prompt(text, key, value)


def _niah_multikey(rng, size, haystack, depth):
    keys = set()
    while len(keys) < 4:
        keys.add(_key(rng))
    key, *distractors = sorted(keys)
    value = _number(rng)
    needles = [(depth, _needle(key, value))] + [(rng.random(), _needle(other, _number(rng))) for other in distractors]
    text = insert_at_depths(haystack.units(rng, size), needles)
    return _single_answer_prompt(text, key, value)


def _niah_multivalue(rng, size, haystack, depth):
    key = _key(rng)
    values = []
    while len(values) < 4:
        value = _number(rng)
        if value not in values:
            values.append(value)
    needles = [(depth, _needle(key, values[0]))] + [(rng.random(), _needle(key, value)) for value in values[1:]]
    text = insert_at_depths(haystack.units(rng, size), needles)
    return PromptParts(f"{_NIAH_INTRO}{text}\nWhat are all the special magic numbers for {key} mentioned in the "
                       "provided text?",
                       f"The special magic numbers for {key} mentioned in the provided text are", tuple(values))


def _variable_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def _vt(rng, size, haystack, depth):
    hops = 4
    names = _variable_names(rng, 2 * (hops + 1))
    value, decoy = rng.sample(range(10_000, 100_000), 2)
    needles = []
    for chain, chain_value in ((names[:hops + 1], value), (names[hops + 1:], decoy)):
        statements = [f"VAR {chain[0]} = {chain_value}."] + [
            f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain))]
        depths = sorted(rng.random() for _ in statements)
        needles += list(zip(depths, statements))
    text = insert_at_depths(haystack.units(rng, size), needles)
    return PromptParts("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                       f"{text}\nQuestion: Find all variables that are assigned the value {value} in the text above.",
                       f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
                       f"variables are assigned the value {value}, they are:", tuple(names[:hops + 1]))


def _cwe(rng, size, haystack, depth):
    """A numbered list of ``size`` entries: 10 common words, each ``freq_common`` times, and rare words each
    ``freq_rare`` times. RULER uses 30 and 3; shorter lists scale both down (``freq_common = size // 25`` within
    2..30, ``freq_rare = freq_common // 10`` within 1..3), so common words always appear >= 2x as often."""
    num_common = 10
    freq_common = max(2, min(30, size // 25))
    freq_rare = max(1, min(3, freq_common // 10))
    num_rare = max(1, (size - num_common * freq_common) // freq_rare)
    words = _pseudo_words(rng, num_common + num_rare)
    listing = [w for w in words[:num_common] for _ in range(freq_common)]
    listing += [w for w in words[num_common:] for _ in range(freq_rare)]
    rng.shuffle(listing)
    numbered = "\n".join(f"{number}. {word}" for number, word in enumerate(listing, 1))
    return PromptParts("Below is a numbered list of words. In these words, some appear more often than others. "
                       f"Memorize the ones that appear most often.\n{numbered}\nQuestion: What are the "
                       f"{num_common} most common words in the above list?",
                       f"Answer: The top {num_common} words that appear most often in the list are:",
                       tuple(words[:num_common]))


def _fwe(rng, size, haystack, depth):
    """``size`` coded words drawn with Zipf weights (alpha 2) from a pseudo-word vocabulary; answer: the top 3."""
    vocabulary = _pseudo_words(rng, max(20, size // 10), syllables=2)
    weights = [1.0 / (rank + 1) ** 2.0 for rank in range(len(vocabulary))]
    text_words = rng.choices(vocabulary, weights=weights, k=max(size, 8))
    counts = Counter(text_words)
    ranked = [word for word, _ in counts.most_common()]
    while len(ranked) > 3 and counts[ranked[2]] <= counts[ranked[3]]:
        position = text_words.index(ranked[3])
        text_words[position] = ranked[2]
        counts = Counter(text_words)
        ranked = [word for word, _ in counts.most_common()]
    return PromptParts("Read the following coded text and track the frequency of each coded word. Find the three "
                       f"most frequently appeared coded words. {' '.join(text_words)}\nQuestion: Do not provide any "
                       "explanation. What are the three most frequently appeared words in the above coded text?",
                       "Answer: According to the coded text above, the three most frequently appeared words are:",
                       tuple(ranked[:3]))


def _passkey(rng, size, haystack, depth):
    key = str(rng.randint(10_000, 99_999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    text = insert_at_depths(haystack.units(rng, size), [(depth, needle)])
    return PromptParts("There is a pass key hidden in the text below. Find it and memorize it. I will quiz you "
                       f"about the pass key.\n\n{text}\n\nWhat is the pass key?", "The pass key is", (key,))


for _task in (SyntheticTask("niah_single", _niah_single, 12), SyntheticTask("niah_multikey", _niah_multikey, 12),
              SyntheticTask("niah_multivalue", _niah_multivalue, 40), SyntheticTask("vt", _vt, 32),
              SyntheticTask("cwe", _cwe, 64), SyntheticTask("fwe", _fwe, 24),
              SyntheticTask("passkey", _passkey, 10, first_integer=True)):
    SYNTHETIC_TASKS.register(_task.name)(_task)


def render_prompt(tokenizer, parts: PromptParts) -> list[int]:
    """Token ids of the prompt: chat template (user turn, generation prompt) + answer prefix when the tokenizer
    has a template, else ``user + "\\n" + answer_prefix`` with the tokenizer's default special tokens."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": parts.user}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text + parts.answer_prefix, add_special_tokens=False)
    return tokenizer.encode(parts.user + "\n" + parts.answer_prefix)


def _item_rng(task: str, context_length: int, seed: int, index: int) -> random.Random:
    return random.Random(f"{task}:{context_length}:{seed}:{index}")


ITEMS_PER_SEED = 20
"""A long-context task's items per seed: one sweep of the needle over the depths 0, 1/19, ..., 1 of its haystack."""


def _farthest_first(count: int) -> tuple[int, ...]:
    """``0..count-1`` ordered so that each next one is the farthest from those before it (ties: the smaller):
    0, 19, 9, 14, 4, ... for 20, so that the first N of a sweep spread over every depth."""
    order = [0]
    while len(order) < count:
        order.append(max((slot for slot in range(count) if slot not in order),
                         key=lambda slot: (min(abs(slot - taken) for taken in order), -slot)))
    return tuple(order)


DEPTH_ORDER = _farthest_first(ITEMS_PER_SEED)


def sweep_slot(position: int) -> tuple[int, float]:
    """The item at ``position`` (0, 1, ...) of a seed's items -> ``(index, depth)``: its identity (what seeds its
    needle, key and haystack) and its needle depth in [0, 1]. Positions walk :data:`DEPTH_ORDER`, one sweep of
    :data:`ITEMS_PER_SEED` after another, so the first N items of a task are the same whatever N is asked, and every
    prefix spreads over the depths; the 20 items of one sweep are those of index 0..19 at depth index / 19."""
    sweep, place = divmod(position, ITEMS_PER_SEED)
    slot = DEPTH_ORDER[place]
    return sweep * ITEMS_PER_SEED + slot, slot / (ITEMS_PER_SEED - 1)


def generate_item(task: SyntheticTask, tokenizer, context_length: int, seed: int, position: int,
                  haystack: Haystack) -> SyntheticItem:
    """The item at ``position`` of a seed's items (:func:`sweep_slot`), with the most haystack whose prompt fits
    ``context_length - task.max_new_tokens`` tokens. Deterministic for (task, length, seed, position)."""
    budget = context_length - task.max_new_tokens
    index, depth = sweep_slot(position)

    def render(size: int) -> tuple[list[int], PromptParts]:
        parts = task.build(_item_rng(task.name, context_length, seed, index), size, haystack, depth)
        return render_prompt(tokenizer, parts), parts

    fits: dict[int, tuple[list[int], PromptParts]] = {}

    def fits_budget(size: int) -> bool:
        ids, parts = render(size)
        if len(ids) <= budget:
            fits[size] = (ids, parts)
            return True
        return False

    if not fits_budget(1):
        raise RetrofitError(f"--context-length {context_length} is too short for {task.name}: its prompt takes "
                            f"{len(render(1)[0])} tokens before any haystack (plus {task.max_new_tokens} to generate)")
    # Tokens grow about linearly with the haystack size: guess from two sizes, gallop to a bracket, then bisect
    # (a handful of tokenizations even at 128K tokens).
    probe = 64
    base = len(fits[1][0])
    probe_length = len(render(probe)[0])
    per_unit = max((probe_length - base) / (probe - 1), 1e-3)
    guess = max(1, int(1 + (budget - base) / per_unit))
    step = max(1, guess // 50)
    if fits_budget(guess):
        low = guess
        while fits_budget(low + step):
            low, step = low + step, step * 2
        high = low + step
    else:
        high = guess
        while high - step > 1 and not fits_budget(high - step):
            high, step = high - step, step * 2
        low = max(1, high - step)
    while high - low > 1:
        middle = (low + high) // 2
        if fits_budget(middle):
            low = middle
        else:
            high = middle
    ids, parts = fits[low]
    return SyntheticItem(task.name, context_length, seed, index, tuple(ids), parts.answers, task.max_new_tokens)


def generate_items(task_name: str, tokenizer, context_length: int, seeds: list[int], num_items: int,
                   haystack: Haystack | None = None) -> list[SyntheticItem]:
    """The first ``num_items`` items of each seed (seed by seed) for one task and context length: a run asking for
    fewer items gets the first ones of a run asking for more."""
    task = SYNTHETIC_TASKS.get(task_name)
    haystack = haystack or Haystack()
    return [generate_item(task, tokenizer, context_length, seed, position, haystack)
            for seed in seeds for position in range(num_items)]


def answer_fraction(output: str, answers: tuple[str, ...]) -> float:
    """Fraction of ``answers`` that occur in ``output`` (case-insensitive substring)."""
    lowered = output.lower()
    return sum(answer.lower() in lowered for answer in answers) / len(answers)


def first_integer_matches(output: str, answers: tuple[str, ...]) -> bool:
    """True when the first integer in ``output`` equals the (single) answer."""
    match = re.search(r"\d+", output)
    return match is not None and match.group(0) == answers[0]


def item_scores(task_name: str, items: list[SyntheticItem], outputs: list[str]) -> dict[str, list[float]]:
    """Per item: ``score`` 1.0 when every answer is found (passkey: the first integer is the key), else 0.0; for
    multi-answer tasks also ``partial``, the fraction of the item's answers found."""
    task = SYNTHETIC_TASKS.get(task_name)
    if task.first_integer:
        return {"score": [float(first_integer_matches(o, i.answers)) for i, o in zip(items, outputs)]}
    fractions = [answer_fraction(output, item.answers) for item, output in zip(items, outputs)]
    scores = {"score": [float(fraction == 1.0) for fraction in fractions]}
    if task.multi_answer:
        scores["partial"] = fractions
    return scores


def score_outputs(task_name: str, items: list[SyntheticItem], outputs: list[str]) -> dict[str, float]:
    """``{"score": fraction of items fully answered}`` (+ ``"partial"`` for multi-answer tasks), in [0, 1]."""
    return {metric: sum(values) / len(values) for metric, values in item_scores(task_name, items, outputs).items()}


def seed_spread(task_name: str, items: list[SyntheticItem], outputs: list[str]) -> float:
    """Sample standard deviation (n - 1) of the per-seed ``score`` (a fraction, as ``score``); needs >= 2 seeds."""
    seeds = sorted({item.seed for item in items})
    if len(seeds) < 2:
        raise ValueError("seed_spread needs items of at least two seeds")
    per_seed = [score_outputs(task_name, [i for i in items if i.seed == seed],
                              [o for i, o in zip(items, outputs) if i.seed == seed])["score"] for seed in seeds]
    mean = sum(per_seed) / len(per_seed)
    return (sum((value - mean) ** 2 for value in per_seed) / (len(per_seed) - 1)) ** 0.5
