"""The kernel tests test the Triton kernels: every op runs its Triton path here (on the CPU under the interpreter,
which tests/conftest.py switches on), never the PyTorch path it is compared with."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def triton_backend():
    from retrofit.kernels import backend_for, use_backend

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "the kernel tests need TRITON_INTERPRET=1 on the CPU"
    with use_backend("triton"):
        assert backend_for("cpu") == "triton"
        yield
