"""Shared fixtures: the real reference model and the real data, loaded once per session.

Nothing here skips for a missing model or data file: CI must fail loudly if either cannot be found. The one skip is
for tests marked ``gpu`` on a machine without CUDA (they run in GPU sessions).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter; it must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (-n 2 on 2 cores) each worker and the processes it starts get one thread: two workers of
    # two threads each oversubscribe the cores, and OpenMP's barriers then cost far more than the second thread
    # gains (see one_cpu_thread).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _remember_interpreter_builtins() -> None:
    """Make the Triton interpreter's re-patching of ``triton.language`` cheap; the kernels it runs are unchanged.

    The interpreter swaps every builtin of ``triton.language`` (and of its tensor class and math module) for an
    interpreted version at each kernel launch, and again at each ``@triton.jit`` helper call inside a kernel; each
    time it finds them with ``inspect.getmembers``, a ``dir`` and a sort of a few hundred attributes. A helper
    called per block makes that a quarter of the interpreter's time in the chunk kernels' tests. The builtins of a
    module or class do not change, so this lists them once and then patches exactly what ``getmembers`` would have
    found: each listed attribute that still holds its builtin (one already swapped is skipped, as before). Where
    the interpreter's internals differ from the ones this was written against, it leaves them alone.
    """
    import inspect

    try:
        from triton.language.core import is_builtin
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or \
            list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"] or \
            list(inspect.signature(patch_attr).parameters) != ["obj", "name", "member", "builder", "scope"]:
        return
    builtins_of: dict[object, list[tuple[str, object]]] = {}   # module or class -> its (name, builtin) pairs

    def patch_builtin(pkg, builder, scope):
        if pkg not in builtins_of:
            members = [(name, member) for name, member in inspect.getmembers(pkg) if is_builtin(member)]
            if not members:  # already swapped by an enclosing launch: nothing to patch, nothing to remember
                return
            builtins_of[pkg] = members
        for name, member in builtins_of[pkg]:
            if getattr(pkg, name, None) is member:
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


if os.environ.get("TRITON_INTERPRET") == "1":
    _remember_interpreter_builtins()

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("RETROFIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    needs_gpu = pytest.mark.skip(reason="needs CUDA: run in a GPU session (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_gpu)


def _required_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        pytest.fail(f"{what} not found at {path} (set RETROFIT_SHARED_DATA to the folder holding eval/ and calib/)",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def eval_data_dir() -> Path:
    """../shared/data/eval: the public evaluation files (read-only)."""
    return _required_dir(SHARED_DATA / "eval", "evaluation data")


@pytest.fixture(scope="session")
def calib_data_dir() -> Path:
    """../shared/data/calib: 21 public-domain books for distillation (read-only)."""
    return _required_dir(SHARED_DATA / "calib", "calibration data")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): the real SmolLM2-135M-Instruct in float32, eval mode, on the CPU (fails if unobtainable)."""
    import retrofit

    model, tokenizer = retrofit.load("smollm2-135m", dtype="float32", device="cpu")
    return model, tokenizer


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Run a module's small tensor ops on one thread: on a busy 2-core machine OpenMP's barriers make two
    threads ~10x slower than one for these shapes (measured: a tiny conversion took 91 s with 2 threads, 6 s with 1)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
