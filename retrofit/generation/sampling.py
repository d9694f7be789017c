"""Choosing the next token on the device, with no host synchronisation: greedy, or sampling at a temperature with
nucleus (top-p) truncation from a seeded generator.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d., which picks token ``i`` with
probability ``p_i``, as gpt-fast does) instead of ``torch.multinomial``: the same distribution, fixed shapes, and a
single random fill that a CUDA graph can capture with its generator registered.
"""
from __future__ import annotations

import torch

from retrofit.generation.inputs import SamplingOptions


class TokenChooser:
    """``choose(logits [B, V]) -> tokens [B]`` (long) by ``options``; the generator lives on the logits' device."""

    def __init__(self, options: SamplingOptions, device: torch.device):
        self.options = options
        self.generator: torch.Generator | None = None
        if options.do_sample:
            self.generator = torch.Generator(device=device)
            if options.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(options.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.options.do_sample:
            return logits.argmax(-1)
        probabilities = torch.softmax(logits.float() / self.options.temperature, dim=-1)
        if self.options.top_p < 1.0:
            probabilities = nucleus(probabilities, self.options.top_p)
        race = torch.empty_like(probabilities).exponential_(1.0, generator=self.generator)
        return (probabilities / race).argmax(-1)


def nucleus(probabilities: torch.Tensor, top_p: float) -> torch.Tensor:
    """probabilities ``[B, V]`` -> the same with every token outside the smallest set reaching ``top_p`` set to 0
    (the most likely token always stays). Not renormalised: the exponential race does not need it."""
    ordered, order = probabilities.sort(dim=-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each one
    ordered = ordered.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probabilities).scatter_(-1, order, ordered)
