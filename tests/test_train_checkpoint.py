"""Training checkpoints (`<out>.train/train_state.pt`) hold tensors and plain values only and load with
``torch.load(weights_only=True)``: a resumed run restores every random generator exactly, and a checkpoint that
would run code when unpickled (a tampered work directory) is refused in one line without running it."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from retrofit.convert.checkpoint import STATE_FILE, load_train_state, rng_state, save_train_state, set_rng_state
from retrofit.errors import RetrofitError

FINGERPRINT = {"model": "smollm2-135m", "layers": [3, 7], "config": {"lr": 1e-3, "stages": [(1024, 0.5)]}}


def draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_generators_resume_exactly_from_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    save_train_state(tmp_path, {"fingerprint": FINGERPRINT, "stage": 2, "step": 7, "rng": rng_state(),
                                "model": {"w": torch.arange(4.0)}})
    expected = draws()
    draws()  # the generators move on; the checkpoint brings them back
    state = load_train_state(tmp_path, FINGERPRINT)
    set_rng_state(state["rng"])
    assert draws() == expected
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(4.0))


class _RunsCodeWhenLoaded:
    """What a tampered checkpoint could hold: unpickling it calls a function of the attacker's choice."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_that_would_run_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"fingerprint": FINGERPRINT, "payload": _RunsCodeWhenLoaded(marker)}, tmp_path / STATE_FILE)
    with pytest.raises(RetrofitError, match="refusing to load a training checkpoint"):
        load_train_state(tmp_path, FINGERPRINT)
    assert not marker.exists()


def test_a_damaged_checkpoint_is_named(tmp_path):
    # random bytes fail inside the unpickler in many ways (UnpicklingError, IndexError, EOFError, ...): 64 seeded
    # damaged files, each one must be refused naming the file (an unseeded one failed 1 run in several)
    for seed in range(64):
        (tmp_path / STATE_FILE).write_bytes(random.Random(seed).randbytes(1000))
        with pytest.raises(RetrofitError, match=STATE_FILE):
            load_train_state(tmp_path, FINGERPRINT)
    (tmp_path / STATE_FILE).write_bytes(torch_bytes_cut_short())
    with pytest.raises(RetrofitError, match=STATE_FILE):
        load_train_state(tmp_path, FINGERPRINT)


def torch_bytes_cut_short() -> bytes:
    """A real training checkpoint's bytes, cut in the middle (a write interrupted without the atomic rename)."""
    import io
    buffer = io.BytesIO()
    torch.save({"fingerprint": FINGERPRINT, "weights": torch.arange(1000.0)}, buffer)
    data = buffer.getvalue()
    return data[: len(data) // 2]
