"""Training checkpoints of a conversion run: trainable weights, optimizer, scheduler, RNG states, written atomically.

A run keeps one checkpoint file, ``<work_dir>/train_state.pt``; ``--resume`` reloads it and the run continues at the
saved (stage, step) and ends with the same weights as an uninterrupted run (the batch of a step depends only on the
step number, see :class:`retrofit.convert.data.BatchSampler`).
"""
from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import torch

from retrofit.errors import RetrofitError

STATE_FILE = "train_state.pt"


def work_dir_for(out: str | os.PathLike) -> Path:
    """Where a run's training checkpoint lives: beside the output directory (``<out>.train``)."""
    out = Path(out)
    return out.parent / f"{out.name}.train"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor (CPU copy) of every parameter that requires grad."""
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [name for name in state if name not in params]
    if missing:
        raise RetrofitError(f"the checkpoint does not fit this model (e.g. {missing[0]}); start again without --resume")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].device))


def save_train_state(work_dir: Path, state: dict) -> Path:
    """Write ``state`` to ``work_dir/train_state.pt`` through a temporary file renamed into place."""
    work_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".train_state.", suffix=".tmp", dir=work_dir)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, work_dir / STATE_FILE)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return work_dir / STATE_FILE


def load_train_state(work_dir: Path, fingerprint: dict) -> dict | None:
    """The saved state, or None when there is none; raises if it belongs to a different run configuration."""
    path = work_dir / STATE_FILE
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("fingerprint") != fingerprint:
        saved = state.get("fingerprint", {})
        diff = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
        raise RetrofitError(f"the checkpoint in {work_dir} was written by a run with other settings "
                            f"({', '.join(diff)}); rerun with the same settings or without --resume")
    return state
