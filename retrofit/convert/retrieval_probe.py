"""Retrieval-head scores: how much each layer's softmax-attention heads read a planted needle back at long context.

A probe is a passkey prompt (as in RULER's ``niah_single``) built from the *calibration* text: an instruction, a
haystack of calibration tokens with a needle sentence ``The special magic number is 4729183.`` planted at a seeded
random depth (snapped to the end of a sentence), the question, and the answer (the number again), all ``context``
tokens long. The dense model reads the whole prompt once, answer included (teacher forcing), and for the *answer
rows*, the query positions whose next token is a token of the number, every layer's attention weights over all
positions are computed from the post-RoPE queries and keys that the model's attention function receives
(:mod:`retrofit.attention_functions`), so nothing of the model's attention is re-implemented except the softmax of
those few rows. Memory: ``heads x answer rows x context`` floats per layer at a time, never the ``T x T`` matrix.
Two per-head statistics come out (Wu et al., "Retrieval Head Mechanistically Explains Long-Context Factuality", 2024):

- *needle mass*: the attention weight the answer rows put on the needle's number tokens, summed over those tokens
  and averaged over rows and probes (a uniform spread over the causal prefix would give ``digits / position``,
  reported as ``uniform_mass``);
- *copy rate*: the share of answer rows whose arg-max attention lands on the needle token that the row produces
  (Wu et al.'s retrieval score).

A layer's retrieval score is the largest needle mass among its query heads: one strong retrieval head is enough
for the layer to be needed, and a linear-attention replacement of the layer loses all of its heads' exact recall.
Cost: one forward of the dense model per probe (not one per layer); scores are a pure function of the seed, the
calibration text and the model.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from retrofit import architecture
from retrofit.attention_functions import attention_function, dense_attention, implementation_of
from retrofit.errors import RetrofitError

NUMBER_DIGITS = 7  # RULER's passkeys: 7-digit numbers
INTRO = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
         "about the number afterwards.\n")
NEEDLE_START, NEEDLE_END = " The special magic number is", "."  # the number goes between them
MIN_HAYSTACK = 16  # tokens
QUESTION = "\nWhat is the special magic number mentioned in the text above? The special magic number is"
SENTENCE_ENDS = (".", "!", "?", '."', ".'", '!"', '?"')


@dataclass(frozen=True)
class NeedleProbe:
    """One teacher-forced needle prompt of ``context`` tokens.

    ``input_ids [T]``; ``needle_positions [D]``: positions of the number's tokens inside the needle (bare
    whitespace tokens left out); ``answer_rows [D]``: the query positions whose next token is the same token of the
    number in the answer (both places hold the same token ids); ``depth``: where the needle sits, as a fraction of
    the haystack.
    """

    input_ids: torch.Tensor
    needle_positions: torch.Tensor
    answer_rows: torch.Tensor
    depth: float

    @property
    def context(self) -> int:
        return int(self.input_ids.shape[0])

    def produced(self) -> torch.Tensor:
        """``[R]`` the token each answer row produces (its next token)."""
        return self.input_ids[self.answer_rows + 1]


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _number_ids(tokenizer, value: str) -> tuple[list[int], list[int]]:
    """The tokens of ``" " + value`` and the indices among them that carry the number (not bare whitespace)."""
    ids = _ids(tokenizer, " " + value)
    carrying = [i for i, token in enumerate(ids) if tokenizer.decode([token]).strip()]
    return ids, carrying


def _sentence_end_at_or_after(tokenizer, haystack: list[int], position: int) -> int:
    """The first position >= ``position`` that follows a sentence-ending token (``position`` itself if none)."""
    pieces = tokenizer.convert_ids_to_tokens(haystack)
    for p in range(max(1, position), len(haystack)):
        if str(pieces[p - 1]).rstrip().endswith(SENTENCE_ENDS):
            return p
    return position


def needle_probes(tokenizer, paths: list[str], context: int, count: int, seed: int = 0) -> list[NeedleProbe]:
    """``count`` needle probes of exactly ``context`` tokens, haystacks drawn (seeded) from the calibration ``paths``.

    Each probe gets its own haystack window, number and depth (uniform in [0.05, 0.95] of the haystack). The parts
    are tokenized separately and concatenated, so the positions of the number are exact whatever the tokenizer
    does at word boundaries. Raises RetrofitError when ``context`` leaves no room for a haystack.
    """
    from retrofit.convert.data import token_windows

    rng = random.Random(f"retrieval-probe:{seed}:{context}")
    values = [str(rng.randint(10 ** (NUMBER_DIGITS - 1), 10 ** NUMBER_DIGITS - 1)) for _ in range(count)]
    depths = [rng.uniform(0.05, 0.95) for _ in range(count)]
    intro, question = _ids(tokenizer, INTRO, special=True), _ids(tokenizer, QUESTION)
    needle_start, needle_end = _ids(tokenizer, NEEDLE_START), _ids(tokenizer, NEEDLE_END)
    numbers = [_number_ids(tokenizer, value) for value in values]
    fixed = [len(intro) + len(needle_start) + 2 * len(ids) + len(needle_end) + len(question) for ids, _ in numbers]
    if context - max(fixed) < MIN_HAYSTACK:
        raise RetrofitError(f"retrieval probe context {context} is too short: the instruction, needle, question and "
                            f"answer take {max(fixed)} tokens (use at least {max(fixed) + MIN_HAYSTACK})")
    windows = token_windows(tokenizer, paths, count, context - min(fixed), seed=seed, show_progress=False)
    if windows.shape[0] < count:
        raise RetrofitError(f"the calibration text holds only {windows.shape[0]} windows of {context - min(fixed)} "
                            f"tokens for {count} retrieval probes at context {context}")
    probes = []
    for (number, carrying), depth, length, window in zip(numbers, depths, fixed, windows.tolist()):
        haystack = window[:context - length]
        cut = _sentence_end_at_or_after(tokenizer, haystack, round(depth * len(haystack)))
        head = intro + haystack[:cut] + needle_start
        ids = head + number + needle_end + haystack[cut:] + question + number
        answer_start = len(ids) - len(number)
        probes.append(NeedleProbe(
            input_ids=torch.tensor(ids, dtype=torch.long),
            needle_positions=torch.tensor([len(head) + i for i in carrying], dtype=torch.long),
            answer_rows=torch.tensor([answer_start + i - 1 for i in carrying], dtype=torch.long),
            depth=cut / len(haystack)))
    return probes


def answer_row_attention(query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, scaling: float,
                         window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal softmax attention weights of the query ``rows`` only.

    query ``[B, Hq, T, d]`` and key ``[B, Hkv, T, d]`` as transformers' attention interface passes them (post-RoPE;
    Hq a multiple of Hkv, grouped heads share a key head), rows ``[R]`` -> weights ``[B, Hq, R, T]`` (float32; keys
    after a row's position, or ``window`` or more before it, get weight 0; ``softcap`` caps the logits as the
    layer does, ``softcap * tanh(logit / softcap)``).
    """
    B, hq, T, d = query.shape
    hkv = key.shape[1]
    q = query[:, :, rows].float().reshape(B, hkv, (hq // hkv) * rows.numel(), d)
    scores = (q @ key.float().transpose(-1, -2)).reshape(B, hq, rows.numel(), T) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    positions, rows = torch.arange(T, device=query.device)[None, :], rows.to(query.device)[:, None]
    hidden = positions > rows
    if window is not None:
        hidden |= positions <= rows - window
    return scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)


@dataclass
class RetrievalScores:
    """Per layer and query head: ``needle_mass [L, Hq]`` and ``copy_rate [L, Hq]`` (see the module docstring), means
    over all answer rows of all probes; ``uniform_mass``: the needle mass a uniform spread would give (same mean);
    ``answer_accuracy``: share of answer tokens the dense model predicts (arg-max) under teacher forcing, a check
    that the probe asks something the model can do; ``contexts``: the probe lengths."""

    needle_mass: torch.Tensor
    copy_rate: torch.Tensor
    uniform_mass: float
    answer_accuracy: float
    contexts: tuple[int, ...]

    def layer_scores(self) -> list[float]:
        """``[L]`` retrieval score of each layer: the largest needle mass among its heads."""
        return self.needle_mass.max(dim=1).values.tolist()

    def layer_copy_rates(self) -> list[float]:
        """``[L]`` the largest copy rate among each layer's heads."""
        return self.copy_rate.max(dim=1).values.tolist()


class _AnswerRowStatistics:
    """Attention function for one probe: runs the model's own attention unchanged and accumulates, per layer, the
    needle mass and copy hits of every query head over the probe's answer rows."""

    def __init__(self, implementation: str, probe: NeedleProbe, sums: dict[str, torch.Tensor], layers):
        self.implementation, self.probe, self.sums, self.layers = implementation, probe, sums, layers

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        output = dense_attention(self.implementation, module, query, key, value, attention_mask, **kwargs)
        probe = self.probe
        facts = self.layers[module.layer_idx]  # the layer's window and softcap, as its architecture record says
        weights = answer_row_attention(query, key, probe.answer_rows, facts.scaling, facts.window,
                                       facts.softcap)[0]  # [Hq, R, T]
        needle = probe.needle_positions.to(weights.device)
        layer = module.layer_idx
        self.sums["mass"][layer] += weights[:, :, needle].sum(dim=-1).sum(dim=-1).cpu()
        target = probe.input_ids.to(weights.device)
        top = weights.argmax(dim=-1)  # [Hq, R]
        on_needle = torch.isin(top, needle)
        copies = on_needle & (target[top] == probe.produced().to(weights.device)[None, :])
        self.sums["copy"][layer] += copies.sum(dim=-1).cpu().to(torch.float64)
        return output


@torch.no_grad()
def retrieval_head_scores(model, probes: list[NeedleProbe], show_progress: bool = False) -> RetrievalScores:
    """Run the dense ``model`` once over each probe (teacher forcing) -> :class:`RetrievalScores`.

    Only the answer rows' logits are computed (``logits_to_keep``), so no ``[T, vocab]`` tensor is allocated.
    """
    if not probes:
        raise RetrofitError("no retrieval probes to score")
    config = model.config.get_text_config(decoder=True)
    arch = architecture.of(config)
    layers = arch.layers(config)
    num_layers, heads = config.num_hidden_layers, arch.num_heads(config)
    sums = {"mass": torch.zeros(num_layers, heads, dtype=torch.float64),
            "copy": torch.zeros(num_layers, heads, dtype=torch.float64)}
    device = next(model.parameters()).device
    implementation = implementation_of(model)
    rows = correct = 0
    uniform = 0.0
    iterator = probes
    if show_progress:
        from tqdm import tqdm

        iterator = tqdm(probes, desc="scoring: retrieval probes", unit="probe")
    for probe in iterator:
        statistics = _AnswerRowStatistics(implementation, probe, sums, layers)
        with attention_function(model, statistics, "retrieval_probe"):
            logits = model(input_ids=probe.input_ids[None].to(device), use_cache=False,
                           logits_to_keep=probe.answer_rows.to(device)).logits[0]  # [R, vocab]
        correct += int((logits.argmax(dim=-1).cpu() == probe.produced()).sum())
        rows += probe.answer_rows.numel()
        uniform += float((probe.needle_positions.numel() / (probe.answer_rows + 1).double()).sum())
    return RetrievalScores(needle_mass=(sums["mass"] / rows).float(), copy_rate=(sums["copy"] / rows).float(),
                           uniform_mass=uniform / rows, answer_accuracy=correct / rows,
                           contexts=tuple(sorted({p.context for p in probes})))
