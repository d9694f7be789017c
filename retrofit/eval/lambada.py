"""LAMBADA (last-word prediction): correct when every token of ``" " + continuation`` is the greedy argmax.

File format: jsonl with ``{"context": str, "continuation": str}`` per line. Reports ``acc`` (fraction correct)
and ``ppl`` = exp(mean over items of the continuation's negative log-likelihood), as lm-evaluation-harness does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from retrofit.eval.loglikelihood import Score, Throughput, encode_pair, score_requests
from retrofit.eval.outcome import MeanMetric, PerplexityMetric, TaskOutcome
from retrofit.eval.records import read_jsonl


@dataclass(frozen=True)
class LambadaItem:
    context: str
    continuation: str


def load_lambada(path: Path, limit: int | None = None) -> list[LambadaItem]:
    """Items of a LAMBADA-format jsonl file."""
    return read_jsonl(path, lambda record: LambadaItem(record["context"], record["continuation"]),
                      "LAMBADA", '{"context", "continuation"}', limit)


def score_lambada(model, tokenizer, items: list[LambadaItem], batch_size: int = 8, desc: str = "lambada",
                  throughput: Throughput | None = None) -> list[Score]:
    """The score of ``" " + continuation`` after each item's context."""
    requests = [encode_pair(tokenizer, item.context, " " + item.continuation) for item in items]
    return score_requests(model, requests, batch_size, desc, throughput)


def evaluate_lambada(model, tokenizer, items: list[LambadaItem], batch_size: int = 8, desc: str = "lambada",
                     throughput: Throughput | None = None) -> dict[str, float]:
    """``{"acc": fraction of items predicted greedily in full, "ppl": exp(mean continuation NLL)}``."""
    scores = score_lambada(model, tokenizer, items, batch_size, desc, throughput)
    return {"acc": sum(score.is_greedy for score in scores) / len(scores),
            "ppl": math.exp(-sum(score.logprob for score in scores) / len(scores))}


def lambada_outcome(items: list[LambadaItem], scores: list[Score]) -> TaskOutcome:
    """``acc`` per item (0/1) and ``ppl`` over items (one unit per item, as lm-evaluation-harness aggregates it)."""
    records = [{"context": item.context, "continuation": item.continuation, "loglikelihood": score.logprob,
                "acc": float(score.is_greedy)} for item, score in zip(items, scores)]
    return TaskOutcome({"acc": MeanMetric([record["acc"] for record in records]),
                        "ppl": PerplexityMetric([-score.logprob for score in scores], [1.0] * len(scores))}, records)
