"""LAMBADA (last-word prediction): correct when every token of ``" " + continuation`` is the greedy argmax.

File format: jsonl with ``{"context": str, "continuation": str}`` per line. Reports ``acc`` (fraction correct)
and ``ppl`` = exp(mean over items of the continuation's negative log-likelihood), as lm-evaluation-harness does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from retrofit.eval.loglikelihood import Throughput, encode_pair, score_requests
from retrofit.eval.records import read_jsonl


@dataclass(frozen=True)
class LambadaItem:
    context: str
    continuation: str


def load_lambada(path: Path, limit: int | None = None) -> list[LambadaItem]:
    """Items of a LAMBADA-format jsonl file."""
    return read_jsonl(path, lambda record: LambadaItem(record["context"], record["continuation"]),
                      "LAMBADA", '{"context", "continuation"}', limit)


def evaluate_lambada(model, tokenizer, items: list[LambadaItem], batch_size: int = 8, desc: str = "lambada",
                     throughput: Throughput | None = None) -> dict[str, float]:
    """``{"acc": fraction of items predicted greedily in full, "ppl": exp(mean continuation NLL)}``."""
    requests = [encode_pair(tokenizer, item.context, " " + item.continuation) for item in items]
    scores = score_requests(model, requests, batch_size, desc, throughput)
    return {"acc": sum(score.is_greedy for score in scores) / len(scores),
            "ppl": math.exp(-sum(score.logprob for score in scores) / len(scores))}
