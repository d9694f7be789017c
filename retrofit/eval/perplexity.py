"""Perplexity over non-overlapping windows of a text file (protocol: design/evaluation.md).

The whole file is tokenized once without special tokens and cut into ``len // seq_len`` windows of exactly
``seq_len`` tokens (the remainder is dropped); each window is scored on its own, and
``ppl = exp(sum of NLL / number of predicted tokens)`` with ``seq_len - 1`` predicted tokens per window.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from retrofit import textfiles
from retrofit.errors import RetrofitError
from retrofit.eval.loglikelihood import Throughput
from retrofit.eval.outcome import PerplexityMetric, TaskOutcome
from retrofit.eval.progress import progress_bar
from retrofit.model_info import model_device


def token_windows(tokenizer, text: str, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Tokenize ``text`` once (no special tokens) and return the first ``limit`` windows, ``[N, seq_len]`` int64."""
    if seq_len < 2:
        raise RetrofitError(f"--seq-len must be at least 2, got {seq_len}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    count = len(ids) // seq_len
    if limit is not None:
        count = min(count, limit)
    if count == 0:
        raise RetrofitError(f"the text has {len(ids)} tokens, fewer than one window of --seq-len {seq_len}")
    return torch.tensor(ids[:count * seq_len], dtype=torch.long).view(count, seq_len)


def read_text(path: Path) -> str:
    """The file's text; a missing, empty, binary or non-UTF-8 file is a user error naming it."""
    return textfiles.read_text(path, "evaluation text")


@torch.no_grad()
def window_nlls(model, windows: torch.Tensor, batch_size: int = 4, desc: str = "perplexity",
                throughput: Throughput | None = None) -> list[float]:
    """Summed NLL (nats) of tokens 1..T-1 of each window of ``windows [N, T]``, in window order."""
    device = model_device(model)
    nlls: list[float] = []
    progress = progress_bar(len(windows), desc, "window")
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size].to(device)
        began = time.perf_counter()
        logits = model(input_ids=batch, use_cache=False).logits
        for row in range(len(batch)):
            nlls.append(float(F.cross_entropy(logits[row, :-1].float(), batch[row, 1:], reduction="sum")))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if throughput is not None:
            throughput.add(Throughput(batch.numel(), time.perf_counter() - began))
        progress.update(len(batch))
    progress.close()
    return nlls


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, desc: str = "perplexity",
               throughput: Throughput | None = None) -> dict[str, float]:
    """Perplexity of ``windows [N, T]``: ``exp(mean NLL of tokens 1..T-1 of every window)``.

    Returns ``{"ppl": ..., "nll": mean NLL in nats, "tokens": number of predicted tokens}``.
    """
    nlls = window_nlls(model, windows, batch_size, desc, throughput)
    total_tokens = len(nlls) * (windows.shape[1] - 1)
    mean_nll = sum(nlls) / total_tokens
    return {"ppl": math.exp(mean_nll), "nll": mean_nll, "tokens": float(total_tokens)}


def perplexity_outcome(nlls: list[float], seq_len: int) -> TaskOutcome:
    """``ppl`` over windows (for the bootstrap interval) and one record per window."""
    tokens = [float(seq_len - 1)] * len(nlls)
    return TaskOutcome({"ppl": PerplexityMetric(list(nlls), tokens)},
                       [{"window": index, "nll": nll, "tokens": seq_len - 1} for index, nll in enumerate(nlls)])
