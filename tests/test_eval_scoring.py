"""Log-likelihood scoring (multiple choice, LAMBADA) against an independent, plainly written scorer on the real
SmolLM2 and the real data files, and batch-size invariance of the batched, right-padded scorer."""
from __future__ import annotations

import math

import pytest
import torch

from retrofit.errors import RetrofitError
from retrofit.eval.lambada import evaluate_lambada, load_lambada
from retrofit.eval.loglikelihood import encode_pair, score_requests
from retrofit.eval.multiple_choice import (build_requests, evaluate_multiple_choice, load_hellaswag, load_jsonl)

# Scores are sums of ~10-60 float32 log-probabilities; batching changes the matmul shapes (padding), which moves
# each logit by ~1e-6 relative. 1e-4 absolute on the sum is far above that and far below any score gap that
# matters (the issue asks for identical scores within 1e-4).
SCORE_TOLERANCE = 1e-4


@torch.no_grad()
def reference_logprob(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """The protocol written out plainly for ONE pair: trailing whitespace of the context belongs to the continuation
    (lm-evaluation-harness); encode context and context+continuation without special tokens, the continuation
    tokens are the whole encoding past the context's length; run the whole sequence unpadded; sum the log-softmax
    at the positions predicting the continuation."""
    trailing = len(context) - len(context.rstrip())
    if trailing:
        context, continuation = context[:-trailing], context[-trailing:] + continuation
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole_ids = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n_continuation = len(whole_ids) - len(context_ids)
    logits = model(torch.tensor([whole_ids])).logits[0].float()
    total, greedy = 0.0, True
    for position in range(len(whole_ids) - n_continuation, len(whole_ids)):
        distribution = torch.log_softmax(logits[position - 1], dim=-1)
        total += distribution[whole_ids[position]].item()
        greedy = greedy and int(distribution.argmax()) == whole_ids[position]
    return total, greedy


def reference_accuracy(model, tokenizer, items) -> tuple[float, float, list[float]]:
    """acc and acc_norm (by len(choice), as lm-evaluation-harness) one item and one choice at a time."""
    correct = correct_norm = 0
    all_scores = []
    for item in items:
        scores = [reference_logprob(model, tokenizer, item.query, " " + choice)[0] for choice in item.choices]
        all_scores += scores
        correct += scores.index(max(scores)) == item.gold
        normalized = [score / len(choice) for score, choice in zip(scores, item.choices)]
        correct_norm += normalized.index(max(normalized)) == item.gold
    return correct / len(items), correct_norm / len(items), all_scores


# PIQA choices are long (up to ~100 tokens), so 16 items cost about what 20 ARC items cost
@pytest.mark.parametrize("file_name, count", [("piqa.jsonl", 16), ("arc_easy.jsonl", 20)])
def test_multiple_choice_matches_independent_scorer(smollm2, eval_data_dir, file_name, count):
    model, tokenizer = smollm2
    items = load_jsonl(eval_data_dir / file_name, limit=count)
    assert len(items) == count
    metrics, scores = evaluate_multiple_choice(model, tokenizer, items, batch_size=8)
    reference_acc, reference_acc_norm, reference_scores = reference_accuracy(model, tokenizer, items)
    assert metrics["acc"] == reference_acc
    assert metrics["acc_norm"] == reference_acc_norm
    assert len(scores) == len(reference_scores)
    for score, reference in zip(scores, reference_scores):
        assert abs(score.logprob - reference) < SCORE_TOLERANCE
    # sums of log-probabilities of real tokens: strictly negative (a zero would mean nothing was scored)
    assert all(score.logprob < 0 for score in scores)


def test_batched_scores_equal_batch_size_one(smollm2, eval_data_dir):
    """Right padding must not leak: hellaswag rows differ in length by up to ~2x within a batch."""
    model, tokenizer = smollm2
    items = load_hellaswag(eval_data_dir / "hellaswag_val.txt.bz2", limit=4)
    requests = build_requests(tokenizer, items)
    lengths = {len(r.context_ids) + len(r.continuation_ids) for r in requests}
    assert max(lengths) - min(lengths) >= 5, "the batch must actually contain padding"
    one_by_one = score_requests(model, requests, batch_size=1)
    batched = score_requests(model, requests, batch_size=16)
    for single, many in zip(one_by_one, batched):
        assert abs(single.logprob - many.logprob) < SCORE_TOLERANCE
        assert single.is_greedy == many.is_greedy


def test_lambada_matches_independent_greedy_check(smollm2, eval_data_dir):
    model, tokenizer = smollm2
    items = load_lambada(eval_data_dir / "lambada_openai.jsonl", limit=4)
    metrics = evaluate_lambada(model, tokenizer, items, batch_size=4)
    reference = [reference_logprob(model, tokenizer, item.context, " " + item.continuation) for item in items]
    assert metrics["acc"] == sum(greedy for _, greedy in reference) / len(items)
    expected_ppl = math.exp(-sum(score for score, _ in reference) / len(items))
    assert metrics["ppl"] == pytest.approx(expected_ppl, rel=1e-4)  # rel 1e-4: same sums as SCORE_TOLERANCE


def test_continuation_tokens_split_at_context_length(smollm2):
    """PIQA's queries end in a newline: as in lm-evaluation-harness it is scored with the continuation."""
    _, tokenizer = smollm2
    request = encode_pair(tokenizer, "Question: dresser\n", " replace drawer with bobby pin")
    whole = tokenizer.encode("Question: dresser\n replace drawer with bobby pin", add_special_tokens=False)
    assert list(request.context_ids) + list(request.continuation_ids) == whole
    assert tokenizer.decode(list(request.context_ids)) == "Question: dresser"
    assert tokenizer.decode(list(request.continuation_ids)) == "\n replace drawer with bobby pin"
    plain = encode_pair(tokenizer, "Question: dresser", " pin")  # nothing to move
    assert tokenizer.decode(list(plain.continuation_ids)) == " pin"


def test_hellaswag_loader_reads_six_line_items(eval_data_dir):
    items = load_hellaswag(eval_data_dir / "hellaswag_val.txt.bz2")
    assert len(items) == 10042
    first = items[0]
    assert first.query == "Roof shingle removal: A man is sitting on a roof. he"
    assert first.gold == 3 and first.choices[3] == "starts pulling up roofing on a roof."
    assert len(load_hellaswag(eval_data_dir / "hellaswag_val.txt.bz2", limit=7)) == 7


def test_loaders_reject_bad_files(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"query": "q", "choices": ["a", "b"], "gold": 5}\n')
    with pytest.raises(RetrofitError, match="gold"):
        load_jsonl(broken)
    not_json = tmp_path / "not.jsonl"
    not_json.write_text("hello\n")
    with pytest.raises(RetrofitError, match="not a multiple-choice record"):
        load_jsonl(not_json)
    with pytest.raises(RetrofitError, match="not found"):
        load_jsonl(tmp_path / "missing.jsonl")
    five_lines = tmp_path / "hs.txt"
    five_lines.write_text("a: b\n0\nx\ny\nz\n")
    with pytest.raises(RetrofitError, match="6 lines per item"):
        load_hellaswag(five_lines)
