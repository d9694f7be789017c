"""Stage-2 windows that repeat spans of their own text further on, so the distillation loss covers long-range copying.

Book text rarely repeats a passage thousands of tokens later, yet that is what passkey and needle retrieval ask of a
model: find an earlier span by its first tokens and continue it. The dense teacher does this through its induction
heads; a hybrid whose converted layers drift during stage 2 can lose it while its loss on plain book text still falls.
A window that carries a copy of one of its own earlier spans puts the teacher's confident continuation of the copy
into the KL loss, so the student is trained to keep the skill. The copies are cut from the same window (calibration
text only); nothing of the judged tasks' text or format is used.
"""
from __future__ import annotations

import torch

TOKENS_PER_COPY = 1024  # one planted copy per this many tokens of window: 1 in a 1K window, 8 in an 8K one


def check_copy_settings(share: float, span: int) -> None:
    """Refuse a copy share outside [0, 1] or a mean copy span under 2 tokens (ValueError naming the setting)."""
    if not 0 <= float(share) <= 1:
        raise ValueError(f"copy_share must be in [0, 1], got {share}")
    if int(span) < 2:
        raise ValueError(f"copy_span must be >= 2 tokens, got {span}")


def copy_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """The generator that decides the copies of one micro-batch: fixed by the run's seed and the batch's place, so a
    resumed run plants exactly what an uninterrupted one would."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + micro) * 257 + rank)


def with_copied_spans(windows: torch.Tensor, share: float, span: int, generator: torch.Generator) -> torch.Tensor:
    """Repeat spans of some windows' own text later in the same window.

    Args:
        windows: ``[B, L]`` token ids (left unchanged).
        share: chance that a window gets copies (0 = none, 1 = every window).
        span: mean copy length in tokens; each copy is ``span // 2`` to ``span + span // 2`` tokens long.
        generator: the CPU generator that draws which windows, where and how long (see :func:`copy_generator`).

    Returns:
        ``[B, L]`` token ids. A chosen window gets ``max(1, L // 1024)`` copies, one after another; each copy takes
        ``s`` tokens starting at ``a`` and inserts them at ``b >= a + s`` (after the source ends), pushing the text
        from ``b`` on to the right and dropping the window's last ``s`` tokens, so the length stays ``L``. Windows
        shorter than ``4 * span`` tokens are left as they are.
    """
    check_copy_settings(share, span)
    out = windows.clone()
    length = windows.shape[1]
    if share == 0 or length < 4 * span:
        return out
    copies = max(1, length // TOKENS_PER_COPY)
    for row in range(windows.shape[0]):
        if torch.rand((), generator=generator).item() >= share:
            continue
        tokens = out[row]
        for _ in range(copies):
            size = _randint(span // 2, span + span // 2, generator)
            source = _randint(0, length - 2 * size, generator)
            target = _randint(source + size, length - size, generator)
            tokens = torch.cat([tokens[:target], tokens[source:source + size], tokens[target:length - size]])
        out[row] = tokens
    return out


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """A uniform integer in ``[low, high]`` (both ends included)."""
    return int(torch.randint(low, high + 1, (), generator=generator).item())
