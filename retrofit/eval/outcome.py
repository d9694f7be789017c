"""What one task gives back for one variant: per-item (or per-window) values, so that every reported number can carry
its uncertainty and every variant its paired delta to dense on the same items.

JSON names (``results[variant][task]``), lm-evaluation-harness style:

- ``M``, ``M_stderr`` for each metric M; ``n`` = number of items (windows for perplexity);
- ``M_ci95_low``, ``M_ci95_high`` where the interval is not ``M +- 1.96 stderr``: perplexity (bootstrap over
  windows) and synthetic ``score`` (Wilson);
- for every variant but the first: ``M_delta`` (variant - dense), ``M_delta_stderr``, ``M_delta_ci95_low``,
  ``M_delta_ci95_high`` (paired on the same items; forms in :mod:`retrofit.eval.stats`).

Units, one per kind: ``acc``, ``acc_norm``, ``score``, ``partial``, ``score_sd``, ``agree`` are fractions in [0, 1]
(the table shows percent); ``ppl`` is a perplexity; ``agree_prefix`` is a number of tokens; deltas are in the
metric's unit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from retrofit.eval import stats

FRACTION_METRICS = frozenset({"acc", "acc_norm", "score", "partial", "score_sd", "agree"})
TOKEN_METRICS = frozenset({"agree_prefix"})
UNITS = {"fraction": sorted(FRACTION_METRICS), "perplexity": ["ppl"], "tokens": sorted(TOKEN_METRICS)}
_DERIVED_SUFFIXES = ("_stderr", "_ci95_low", "_ci95_high", "_delta", "_delta_stderr", "_delta_ci95_low",
                     "_delta_ci95_high")


@dataclass
class MeanMetric:
    """A metric that is the mean of per-item values (0/1 outcomes, or fractions of answers found).

    ``wilson``: the values are 0/1 successes and the interval is the Wilson interval (synthetic tasks)."""

    values: list[float]
    wilson: bool = False


@dataclass
class PerplexityMetric:
    """``exp(sum nll / sum tokens)`` over units (windows of a text, or items): NLL in nats and predicted tokens."""

    nll: list[float]
    tokens: list[float]


Metric = Union[MeanMetric, PerplexityMetric, float]


@dataclass
class TaskOutcome:
    """The metrics of one task on one variant, and one record per item for ``--log-samples``."""

    metrics: dict[str, Metric]
    samples: list[dict] = field(default_factory=list)

    @property
    def n(self) -> int | None:
        for metric in self.metrics.values():
            if isinstance(metric, MeanMetric):
                return len(metric.values)
            if isinstance(metric, PerplexityMetric):
                return len(metric.nll)
        return None


def as_outcome(result: TaskOutcome | dict[str, float]) -> TaskOutcome:
    """A job may return a plain ``{metric: value}`` (no per-item values: no stderr, a bare delta) or a TaskOutcome."""
    return result if isinstance(result, TaskOutcome) else TaskOutcome(dict(result))


def is_primary(name: str) -> bool:
    """True for a metric's own name (``acc``), False for ``n`` and derived names (``acc_stderr``, ``acc_delta``)."""
    return name != "n" and not name.endswith(_DERIVED_SUFFIXES)


def value_of(metric: Metric) -> float:
    if isinstance(metric, MeanMetric):
        return stats.mean(metric.values)
    if isinstance(metric, PerplexityMetric):
        return stats.perplexity_of(metric.nll, metric.tokens)
    return float(metric)


def _fractions(values: list[float]) -> bool:
    return all(0.0 <= value <= 1.0 for value in values)


def summarize(outcome: TaskOutcome) -> dict[str, float]:
    """The JSON entries of one task on the first column (the model as loaded): values, stderr, intervals, n."""
    entries: dict[str, float] = {}
    for name, metric in outcome.metrics.items():
        entries[name] = value_of(metric)
        if isinstance(metric, MeanMetric):
            entries[f"{name}_stderr"] = stats.mean_stderr(metric.values)
            if metric.wilson:
                entries[f"{name}_ci95_low"], entries[f"{name}_ci95_high"] = stats.wilson_interval(
                    sum(metric.values), len(metric.values))
        elif isinstance(metric, PerplexityMetric):
            low, high, spread = stats.bootstrap_perplexity(metric.nll, metric.tokens)
            entries[f"{name}_stderr"], entries[f"{name}_ci95_low"], entries[f"{name}_ci95_high"] = spread, low, high
    if outcome.n is not None:
        entries["n"] = outcome.n
    return entries


def summarize_against(outcome: TaskOutcome, dense: TaskOutcome) -> dict[str, float]:
    """:func:`summarize` plus, per metric, the paired delta to ``dense`` (same items) with stderr and 95% interval."""
    entries = summarize(outcome)
    for name, metric in outcome.metrics.items():
        reference = dense.metrics.get(name)
        if reference is None:
            continue
        if isinstance(metric, MeanMetric) and isinstance(reference, MeanMetric):
            delta, stderr = stats.paired_delta(metric.values, reference.values)
            low, high = stats.normal_interval(delta, stderr)
            if _fractions(metric.values) and _fractions(reference.values):  # a difference of fractions is in [-1, 1]
                low, high = max(low, -1.0), min(high, 1.0)
        elif isinstance(metric, PerplexityMetric) and isinstance(reference, PerplexityMetric):
            if metric.tokens != reference.tokens:
                raise ValueError(f"{name}: the variant was scored on other windows than dense")
            delta = value_of(metric) - value_of(reference)
            low, high, stderr = stats.paired_bootstrap_perplexity(metric.nll, reference.nll, metric.tokens)
        else:
            entries[f"{name}_delta"] = value_of(metric) - value_of(reference)
            continue
        entries[f"{name}_delta"], entries[f"{name}_delta_stderr"] = delta, stderr
        entries[f"{name}_delta_ci95_low"], entries[f"{name}_delta_ci95_high"] = low, high
    return entries
