"""Multiple-choice tasks (PIQA, ARC, HellaSwag, any file of the same format) scored by log-likelihood.

Protocol (design/evaluation.md, lm-evaluation-harness definitions): context = the query exactly as stored;
continuation = ``" " + choice``; score = sum of log-probabilities of the continuation tokens (tokenized as in
``retrofit.eval.loglikelihood``); ``acc`` = argmax of score is the gold index; ``acc_norm`` = argmax of
score / character length of the choice (``len(choice)``, as lm-evaluation-harness divides by the length of each
``doc_to_choice`` string). Ties go to the lowest index (``argmax``, as ``numpy.argmax``).
"""
from __future__ import annotations

import bz2
from dataclasses import dataclass
from pathlib import Path

from retrofit.errors import RetrofitError
from retrofit.eval.records import read_jsonl
from retrofit.eval.loglikelihood import Request, Score, Throughput, encode_pair, score_requests
from retrofit.eval.outcome import MeanMetric, TaskOutcome


@dataclass(frozen=True)
class MultipleChoiceItem:
    """One question: the context, its candidate answers, and the index of the right one."""

    query: str
    choices: tuple[str, ...]
    gold: int


def _checked(item: MultipleChoiceItem) -> MultipleChoiceItem:
    if len(item.choices) < 2 or not 0 <= item.gold < len(item.choices):
        raise ValueError("need >= 2 choices and 0 <= gold < number of choices")
    return item


def _item_from_record(record: dict) -> MultipleChoiceItem:
    return _checked(MultipleChoiceItem(record["query"], tuple(record["choices"]), int(record["gold"])))


def load_jsonl(path: Path, limit: int | None = None) -> list[MultipleChoiceItem]:
    """Items of a jsonl file with one ``{"query": str, "choices": [str, ...], "gold": int}`` per line."""
    return read_jsonl(path, _item_from_record, "multiple-choice", '{"query", "choices", "gold"}', limit)


def load_hellaswag(path: Path, limit: int | None = None) -> list[MultipleChoiceItem]:
    """Items of the llama.cpp HellaSwag text layout (bz2 or plain): 6 lines per item —
    ``label: context``, the gold index (0-3), then the 4 endings."""
    if not path.is_file():
        raise RetrofitError(f"data file not found: {path}")
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise RetrofitError(f"{path}: expected 6 lines per item, got {len(lines)} lines")
    items = []
    for start in range(0, len(lines), 6):
        if limit is not None and len(items) >= limit:
            break
        try:
            gold = int(lines[start + 1])
        except ValueError:
            raise RetrofitError(f"{path}:{start + 2}: expected the gold index, got {lines[start + 1]!r}") from None
        try:
            items.append(_checked(MultipleChoiceItem(lines[start], tuple(lines[start + 2:start + 6]), gold)))
        except ValueError as error:
            raise RetrofitError(f"{path}:{start + 1}: {error}") from None
    return items


def continuation(choice: str) -> str:
    return " " + choice


def build_requests(tokenizer, items: list[MultipleChoiceItem]) -> list[Request]:
    """One request per (item, choice), item-major."""
    return [encode_pair(tokenizer, item.query, continuation(choice)) for item in items for choice in item.choices]


def item_outcomes(items: list[MultipleChoiceItem], scores: list[Score]) -> list[dict]:
    """One record per item from the item-major scores of ``build_requests``: the choice log-likelihoods, the
    predictions and whether each is right (``acc``, ``acc_norm`` as 0/1)."""
    records = []
    position = 0
    for item in items:
        item_scores = [score.logprob for score in scores[position:position + len(item.choices)]]
        position += len(item.choices)
        normalized = [value / max(len(choice), 1) for value, choice in zip(item_scores, item.choices)]
        pred, pred_norm = _argmax(item_scores), _argmax(normalized)
        records.append({"query": item.query, "choices": list(item.choices), "gold": item.gold,
                        "loglikelihoods": item_scores, "pred": pred, "pred_norm": pred_norm,
                        "acc": float(pred == item.gold), "acc_norm": float(pred_norm == item.gold)})
    return records


def metrics_from_scores(items: list[MultipleChoiceItem], scores: list[Score]) -> dict[str, float]:
    """``acc`` and ``acc_norm`` (fractions in [0, 1]) from the item-major scores of ``build_requests``."""
    records = item_outcomes(items, scores)
    return {metric: sum(record[metric] for record in records) / len(records) for metric in ("acc", "acc_norm")}


def outcome_from_scores(items: list[MultipleChoiceItem], scores: list[Score]) -> TaskOutcome:
    """``acc`` and ``acc_norm`` as per-item 0/1 values (for stderr and paired deltas) and the per-item records."""
    records = item_outcomes(items, scores)
    return TaskOutcome({metric: MeanMetric([record[metric] for record in records]) for metric in ("acc", "acc_norm")},
                       records)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda index: (values[index], -index))


def evaluate_multiple_choice(model, tokenizer, items: list[MultipleChoiceItem], batch_size: int = 8,
                             desc: str = "multiple choice", throughput: Throughput | None = None
                             ) -> tuple[dict[str, float], list[Score]]:
    """Score every choice of every item; returns (``{"acc", "acc_norm"}``, the per-choice scores)."""
    scores = score_requests(model, build_requests(tokenizer, items), batch_size, desc, throughput)
    return metrics_from_scores(items, scores), scores
