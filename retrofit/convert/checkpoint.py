"""Training checkpoints of a conversion run: trainable weights, optimizer, scheduler, RNG states, written atomically.

A run keeps one checkpoint file, ``<work_dir>/train_state.pt``; ``--resume`` reloads it and the run continues at the
saved (stage, step) and ends with the same weights as an uninterrupted run (the batch of a step depends only on the
step number, see :class:`retrofit.convert.data.BatchSampler`). A run whose layers were scored (``fraction:F``) also
keeps ``<work_dir>/selection.json``, the layers it chose and what they were chosen from, so that a resumed run skips
the scoring (40-75 s on an H200 for SmolLM2's 30 layers).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from retrofit.atomic import torch_load, torch_save, write_json
from retrofit.errors import RetrofitError

STATE_FILE = "train_state.pt"
SELECTION_FILE = "selection.json"


def work_dir_for(out: str | os.PathLike) -> Path:
    """Where a run's training checkpoint lives: beside the output directory (``<out>.train``)."""
    out = Path(out)
    return out.parent / f"{out.name}.train"


def rng_state() -> dict:
    """Every random generator's state as tensors and plain values (what ``torch.load(weights_only=True)`` reads)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss),
                          float(cached_gaussian))
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))


def _as_tuples(value):
    """``random.setstate`` wants the nested tuples ``getstate`` gave (a checkpoint may hold them as lists)."""
    return tuple(_as_tuples(item) for item in value) if isinstance(value, (list, tuple)) else value


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: FSDP's sharded DTensors are all-gathered (a collective: every rank must call this)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor (CPU copy) of every parameter that requires grad; FSDP-sharded parameters come back full, so
    the state is the same for any world size (then every rank must call this)."""
    return {name: _full(p.detach()).cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with FSDP-sharded state tensors (AdamW moments) all-gathered to full CPU tensors:
    the layout a one-process run saves. A collective under FSDP: every rank must call this."""
    state = optimizer.state_dict()
    return {**state, "state": {index: {key: _full(value).cpu().clone() if torch.is_tensor(value) else value
                                       for key, value in entry.items()}
                               for index, entry in state["state"].items()}}


def load_sharded_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a :func:`full_optimizer_state` into an optimizer over FSDP-sharded parameters: each full state tensor
    shaped like its parameter is sharded like that parameter (a collective: every rank must call this)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in state["param_groups"] for i in group["params"]]
    if len(params) != len(indices):
        raise RetrofitError("the checkpoint's optimizer state does not fit this run; start again without --resume")
    by_index = dict(zip(indices, params))
    sharded = {}
    for index, entry in state["state"].items():
        param = by_index[index]
        sharded[index] = {}
        for key, value in entry.items():
            if isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape:
                value = distribute_tensor(value.detach().to(param.device), param.device_mesh, param.placements)
            sharded[index][key] = value
    optimizer.load_state_dict({**state, "state": sharded})


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
    return torch_save(state, work_dir / STATE_FILE)


def load_train_state(work_dir: Path, fingerprint: dict) -> dict | None:
    """The saved state, or None when there is none; raises if it belongs to a different run configuration."""
    path = work_dir / STATE_FILE
    if not path.is_file():
        return None
    state = torch_load(path, "a training checkpoint", advice="start again without --resume")
    if not isinstance(state, dict):
        raise RetrofitError(f"{path}: not a retrofit training checkpoint; start again without --resume")
    if state.get("fingerprint") != fingerprint:
        saved = state.get("fingerprint", {})
        diff = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
        raise RetrofitError(f"the checkpoint in {work_dir} was written by a run with other settings "
                            f"({', '.join(diff)}); rerun with the same settings or without --resume")
    return state


def saved_position(work_dir: Path) -> tuple[int, int] | None:
    """(stage, step the run continues at) of the training checkpoint in ``work_dir``, read without reading its
    tensors (the file memory-mapped); None when there is none or it cannot be read."""
    path = work_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(state["stage"]), int(state["step"])
    except Exception:  # noqa: BLE001 - any unreadable file is "no usable checkpoint" here
        return None


def _plain(value):
    """``value`` as JSON gives it back (tuples become lists), so a key read from disk compares equal to a fresh one."""
    return json.loads(json.dumps(value))


def save_selection(work_dir: Path, scored_from: dict, layers: list[int]) -> Path:
    """Remember the scored choice ``layers`` of this run and ``scored_from`` (model, data, settings: what the scores
    depend on), atomically, for :func:`selection_of_earlier_run`."""
    return write_json(work_dir / SELECTION_FILE, {"scored_from": _plain(scored_from), "layers": list(layers)})


def selection_of_earlier_run(work_dir: Path, scored_from: dict) -> list[int] | None:
    """The layers an earlier part of this run chose from the same ``scored_from``; None when there is no record, it
    is unreadable or it was scored from something else (then the caller scores again)."""
    path = work_dir / SELECTION_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("scored_from") != _plain(scored_from):
        return None
    layers = saved.get("layers")
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        return None
    return layers
