"""LAMBADA (last-word prediction): correct when every token of ``" " + continuation`` is the greedy argmax.

File format: jsonl with ``{"context": str, "continuation": str}`` per line. Reports ``acc`` (fraction correct)
and ``ppl`` = exp(mean over items of the continuation's negative log-likelihood), as lm-evaluation-harness does.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from retrofit.errors import RetrofitError
from retrofit.eval.loglikelihood import Throughput, encode_pair, score_requests


@dataclass(frozen=True)
class LambadaItem:
    context: str
    continuation: str


def load_lambada(path: Path, limit: int | None = None) -> list[LambadaItem]:
    """Items of a LAMBADA-format jsonl file."""
    if not path.is_file():
        raise RetrofitError(f"data file not found: {path}")
    items = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                items.append(LambadaItem(record["context"], record["continuation"]))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise RetrofitError(f'{path}:{number}: not a {{"context", "continuation"}} record ({error})') from None
    return items


def evaluate_lambada(model, tokenizer, items: list[LambadaItem], batch_size: int = 8, desc: str = "lambada",
                     throughput: Throughput | None = None) -> dict[str, float]:
    """``{"acc": fraction of items predicted greedily in full, "ppl": exp(mean continuation NLL)}``."""
    requests = [encode_pair(tokenizer, item.context, " " + item.continuation) for item in items]
    scores = score_requests(model, requests, batch_size, desc, throughput)
    return {"acc": sum(score.is_greedy for score in scores) / len(scores),
            "ppl": math.exp(-sum(score.logprob for score in scores) / len(scores))}
