"""Generation fidelity: how many of 128 greedy tokens after held-out prompts agree with the first column's (dense).

Prompts: the text file is tokenized once (no special tokens) and ``count`` prompts of ``PROMPT_TOKENS`` tokens are
cut from it at evenly spaced token offsets (non-overlapping; fewer when the text is short). Each variant continues
every prompt greedily for exactly ``NEW_TOKENS`` tokens (end-of-sequence tokens do not stop it, so all rows have the
same length). The first variant run (``dense``: the runner always runs the model as loaded first) is the reference.

Per prompt:

- ``agree_prefix``: the number of leading new tokens equal to the reference's (0-128; 128 = the same text);
- ``agree``: the fraction of the 128 positions whose token equals the reference's at the same position (past a
  first difference the two texts may realign or not, so this is the looser of the two).

Both are means over prompts with a standard error and, for a variant, the paired delta to dense on the same prompts.
The reference agrees with itself exactly: ``agree_prefix`` 128, ``agree`` 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrofit.errors import RetrofitError
from retrofit.eval.generation import greedy_token_ids
from retrofit.eval.loglikelihood import Throughput
from retrofit.eval.outcome import MeanMetric, TaskOutcome

PROMPT_TOKENS = 256
NEW_TOKENS = 128
DEFAULT_PROMPTS = 16


@dataclass(frozen=True)
class FidelityPrompt:
    """A prompt: its token offset in the text and its ``PROMPT_TOKENS`` token ids."""

    offset: int
    token_ids: tuple[int, ...]


def cut_prompts(tokenizer, text: str, count: int = DEFAULT_PROMPTS,
                prompt_tokens: int = PROMPT_TOKENS) -> list[FidelityPrompt]:
    """``count`` non-overlapping prompts of ``prompt_tokens`` tokens at evenly spaced offsets of the tokenized
    ``text`` (offset ``i * (T // count)`` for a text of T tokens); fewer when the text holds fewer whole prompts."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    fitting = min(count, len(ids) // prompt_tokens)
    if fitting == 0:
        raise RetrofitError(f"generation fidelity: the text has {len(ids)} tokens, fewer than one prompt of "
                            f"{prompt_tokens}")
    stride = len(ids) // fitting
    return [FidelityPrompt(index * stride, tuple(ids[index * stride:index * stride + prompt_tokens]))
            for index in range(fitting)]


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``tokens`` and ``reference`` (``[N, L]`` token ids): (leading positions equal, ``[N]`` int64;
    fraction of positions equal, ``[N]`` float64)."""
    equal = tokens == reference  # [N, L]
    leading = equal.long().cumprod(dim=1).sum(dim=1)
    return leading, equal.double().mean(dim=1)


class FidelityJob:
    """The ``run`` of a ``fidelity`` job: the first call generates the reference, every call (the first included)
    scores its own greedy tokens against it."""

    def __init__(self, prompts: list[FidelityPrompt], desc: str):
        self.prompts = prompts
        self.desc = desc
        self.reference: torch.Tensor | None = None  # [N, NEW_TOKENS] token ids of the first variant

    def __call__(self, model, tokenizer, batch_size: int, throughput: Throughput) -> TaskOutcome:
        generated = torch.tensor(greedy_token_ids(model, tokenizer, [list(p.token_ids) for p in self.prompts],
                                                  NEW_TOKENS, batch_size, self.desc, throughput, stop_at_eos=False))
        if self.reference is None:
            self.reference = generated
        leading, fraction = agreement(generated, self.reference)
        samples = [{"offset": prompt.offset, "prompt_tokens": len(prompt.token_ids),
                    "output": tokenizer.decode(row.tolist()), "agree_prefix": int(lead), "agree": float(share)}
                   for prompt, row, lead, share in zip(self.prompts, generated, leading, fraction)]
        return TaskOutcome({"agree_prefix": MeanMetric([float(value) for value in leading]),
                            "agree": MeanMetric(fraction.tolist())}, samples)
