"""Calibration text (files or folders) -> fixed-length token windows -> seeded, resumable, rank-sharded batches."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from retrofit.errors import RetrofitError
from retrofit.textfiles import read_text

TEXT_SUFFIXES = (".txt", ".raw", ".text", ".md")
# Evaluation sets that must never be used for calibration (distilling on the test set would inflate the scores).
FORBIDDEN_NAMES = ("wikitext2_test.raw",)
CHARS_PER_TOKEN = 6  # generous: English BPE averages ~4.5 characters per token, so a block rarely runs short


def calibration_files(paths: list[str] | tuple[str, ...]) -> list[Path]:
    """Expand files and folders (recursively: .txt/.raw/.text/.md) into a sorted list of non-empty text files."""
    if not paths:
        raise RetrofitError("no calibration data: pass --data FILE_OR_FOLDER (repeatable)")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise RetrofitError(f"calibration folder {path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise RetrofitError(f"calibration data {raw} does not exist")
    for path in files:
        if path.name in FORBIDDEN_NAMES:
            raise RetrofitError(f"{path} is an evaluation set: never calibrate on it (choose other --data)")
        read_text(path, "calibration file")  # empty, binary or non-UTF-8 files are refused before any model work
    return files


def token_windows(tokenizer, paths, num_windows: int, seq_len: int, seed: int = 0,
                  show_progress: bool = True) -> torch.Tensor:
    """Sample ``num_windows`` windows of ``seq_len`` tokens from the text files -> LongTensor ``[N, seq_len]``.

    Each file is cut into character blocks of ``seq_len * 6`` characters; blocks are drawn uniformly (seeded) from
    all files together, so every file contributes in proportion to its size; each drawn block is tokenized (no
    special tokens) and its first ``seq_len`` tokens kept. When fewer blocks exist than asked for, every block is
    used once (the batch sampler then repeats them over epochs).
    """
    if seq_len < 2:
        raise RetrofitError(f"--seq-len must be at least 2, got {seq_len}")
    files = calibration_files(paths)
    block_chars = seq_len * CHARS_PER_TOKEN
    texts = [read_text(f, "calibration file") for f in files]
    pool = [(fi, b) for fi, text in enumerate(texts) for b in range(max(1, len(text) // block_chars))]
    rng = random.Random(seed)
    rng.shuffle(pool)
    chosen = pool[: min(len(pool), max(1, math.ceil(num_windows * 1.1)))]  # a few spare blocks for short ones
    windows: list[list[int]] = []
    batch = 256
    iterator = range(0, len(chosen), batch)
    if show_progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="tokenizing calibration text", unit="batch", leave=False)
    for start in iterator:
        part = chosen[start:start + batch]
        blocks = [texts[fi][b * block_chars:(b + 1) * block_chars] for fi, b in part]
        for ids in tokenizer(blocks, add_special_tokens=False)["input_ids"]:
            if len(ids) >= seq_len:
                windows.append(ids[:seq_len])
        if len(windows) >= num_windows:
            break
    if not windows:
        raise RetrofitError(f"the calibration text is too short for one window of {seq_len} tokens "
                            f"(files: {', '.join(str(f) for f in files)})")
    return torch.tensor(windows[:num_windows], dtype=torch.long)


@dataclass
class BatchSampler:
    """Deterministic batches by step number: step ``s`` of a run always sees the same windows, whatever happened
    before (so a resumed run reads exactly what an uninterrupted one would). Under DDP each rank takes its slice
    of the global batch.

    windows: ``[N, L]``; each global batch holds ``batch_size * world_size`` windows drawn without replacement
    from a seeded permutation of all windows, reshuffled each epoch.
    """

    windows: torch.Tensor
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1

    def batch(self, step: int) -> torch.Tensor:
        """The ``[batch_size, L]`` token batch of this rank at ``step``."""
        n = self.windows.shape[0]
        global_batch = self.batch_size * self.world_size
        start = step * global_batch + self.rank * self.batch_size
        rows = []
        for position in range(start, start + self.batch_size):
            epoch, offset = divmod(position, n)
            rows.append(int(self._permutation(epoch)[offset]))
        return self.windows[rows]

    def _permutation(self, epoch: int) -> torch.Tensor:
        cache = self.__dict__.setdefault("_perms", {})
        if epoch not in cache:
            gen = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            cache.clear()
            cache[epoch] = torch.randperm(self.windows.shape[0], generator=gen)
        return cache[epoch]
