"""Uncertainty of evaluation metrics: standard errors, paired deltas to dense, bootstrap and Wilson intervals.

The forms, chosen so that a reviewer can redo them by hand:

- a mean of per-item values (``acc``, ``acc_norm``, synthetic ``score`` / ``partial``): its standard error is the
  sample standard deviation over ``sqrt(n)``, as lm-evaluation-harness computes ``acc_stderr``; for 0/1 outcomes
  with mean ``p`` that is ``sqrt(p (1 - p) / (n - 1))``;
- the paired delta of a variant to dense on the same items: the mean of the per-item differences and, analytically,
  the standard error of that mean (sample SD of the differences over ``sqrt(n)``); its 95% interval is
  ``delta +- 1.96 stderr`` (normal approximation);
- perplexity ``exp(sum NLL / sum tokens)`` over windows (or items): a percentile bootstrap over windows with a fixed
  seed, the same resampled windows for dense and variant when the interval is of their paired difference;
- a rate of successes over items (synthetic ``score``): a Wilson score interval, which stays inside [0, 1] and is
  not empty at 0 or n successes.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

Z_95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 1234


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean: sample SD (``n - 1``) / sqrt(n); ``nan`` for fewer than two values."""
    n = len(values)
    if n < 2:
        return float("nan")
    center = mean(values)
    variance = sum((value - center) ** 2 for value in values) / (n - 1)
    return math.sqrt(variance / n)


def paired_delta(variant: Sequence[float], dense: Sequence[float]) -> tuple[float, float]:
    """``(mean of variant_i - dense_i, its standard error)`` over the same items (analytic paired form)."""
    if len(variant) != len(dense):
        raise ValueError(f"paired values need the same items: {len(variant)} vs {len(dense)}")
    differences = [v - d for v, d in zip(variant, dense)]
    return mean(differences), mean_stderr(differences)


def normal_interval(center: float, stderr: float) -> tuple[float, float]:
    """The 95% interval ``center +- 1.96 stderr``."""
    return center - Z_95 * stderr, center + Z_95 * stderr


def wilson_interval(successes: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial rate ``successes / n`` (fractions in [0, 1])."""
    if n <= 0:
        return float("nan"), float("nan")
    rate = successes / n
    denominator = 1 + Z_95 ** 2 / n
    center = (rate + Z_95 ** 2 / (2 * n)) / denominator
    half = Z_95 * math.sqrt(rate * (1 - rate) / n + Z_95 ** 2 / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def perplexity_of(nll: Sequence[float], tokens: Sequence[float]) -> float:
    """``exp(sum nll / sum tokens)``: ``nll`` in nats per window (or item), ``tokens`` predicted per window."""
    return math.exp(sum(nll) / sum(tokens))


def _resampled_perplexities(nll: torch.Tensor, tokens: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return torch.exp(nll[indices].sum(-1) / tokens[indices].sum(-1))


def _bootstrap_indices(n: int, resamples: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (resamples, n), generator=generator)


def _percentiles(samples: torch.Tensor) -> tuple[float, float, float]:
    """(2.5th percentile, 97.5th percentile, SD) of bootstrap samples."""
    low, high = torch.quantile(samples, torch.tensor([0.025, 0.975], dtype=samples.dtype)).tolist()
    return low, high, float(samples.std())


def bootstrap_perplexity(nll: Sequence[float], tokens: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                         seed: int = BOOTSTRAP_SEED) -> tuple[float, float, float]:
    """Percentile bootstrap over windows of ``exp(sum nll / sum tokens)``: ``(low, high, stderr)``, 95%, where
    stderr is the SD of the resampled perplexities. A single window has no spread: ``(nan, nan, nan)``."""
    if len(nll) < 2:
        return float("nan"), float("nan"), float("nan")
    nll_t, tokens_t = torch.tensor(nll, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64)
    indices = _bootstrap_indices(len(nll), resamples, seed)
    return _percentiles(_resampled_perplexities(nll_t, tokens_t, indices))


def paired_bootstrap_perplexity(variant_nll: Sequence[float], dense_nll: Sequence[float], tokens: Sequence[float],
                                resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
                                ) -> tuple[float, float, float]:
    """Paired bootstrap of ``ppl(variant) - ppl(dense)``: both perplexities on the SAME resampled windows in each
    resample; ``(low, high, stderr)`` of the difference, 95% percentile interval."""
    if len(variant_nll) != len(dense_nll) or len(dense_nll) != len(tokens):
        raise ValueError("paired perplexities need the same windows")
    if len(tokens) < 2:
        return float("nan"), float("nan"), float("nan")
    tokens_t = torch.tensor(tokens, dtype=torch.float64)
    indices = _bootstrap_indices(len(tokens), resamples, seed)
    difference = (_resampled_perplexities(torch.tensor(variant_nll, dtype=torch.float64), tokens_t, indices)
                  - _resampled_perplexities(torch.tensor(dense_nll, dtype=torch.float64), tokens_t, indices))
    return _percentiles(difference)


def excludes_zero(low: float, high: float) -> bool:
    """True when the interval [low, high] lies entirely on one side of 0 (nan bounds exclude nothing)."""
    return (low > 0 and high > 0) or (low < 0 and high < 0)
