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


def _remember_numpy_dtypes() -> None:
    """Make the Triton interpreter's dtype lookup a dictionary read; the arrays it makes are unchanged.

    The interpreter maps a Triton dtype to the numpy dtype of its arrays at almost every operation, and each time
    builds its table of 18 numpy dtypes anew: about 300,000 times (7% of the run) in one KDA forward and backward at
    T = 75. The mapping of a dtype never changes, so this builds each entry once: a block type maps as its element
    type, a pointer as uint64, a scalar type (equal and hashed by name) as the interpreter's own table says. Where
    the interpreter's internals differ from the ones this was written against, it leaves them alone.
    """
    import inspect

    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or list(inspect.signature(original).parameters) != ["tt_dtype"]:
        return
    pointer = np.dtype(np.uint64)
    by_name: dict[str, object] = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = by_name.get(tt_dtype.name)
        if found is None:
            found = by_name[tt_dtype.name] = original(tt_dtype)
        return found

    interpreter._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _remember_interpreter_builtins()
    _remember_numpy_dtypes()


def _frame_runway():
    """A function that calls ``call(*args)`` from a frame of 65,538 local slots (512 KiB), so that the frames below it
    share one 1 MiB chunk of CPython's frame stack instead of allocating and freeing chunks as they come and go.

    CPython 3.11 keeps a thread's Python frames in 16 KiB chunks and frees a chunk as soon as its first frame returns
    (``_PyThreadState_PopFrame``): a hot call chain that straddles a chunk's end maps and unmaps 16 KiB on every
    call. The Triton interpreter's per-operation calls and eager decoding below pytest's own frames do, depending on
    the depth they start at: 128,000 ``mmap``/``munmap`` pairs in one fused-decode test (strace), whose CPU time was
    then more than half system time. A chunk is sized to its first frame (16 KiB doubled until it fits), so a frame
    this large gets a 1 MiB chunk with about 500 KiB left for the frames called from it; measured on 2 CPU cores, 3
    fused-decode and generation tests: 43 -> 35 s, system time 7.4 -> 0.9 s. The tests run the same code. CPython
    releases of 3.13 and 3.14 made since March 2026 keep one spare chunk instead (python/cpython gh-142183); there
    the runway changes nothing.
    """
    slots = "=".join(f"_{index}" for index in range(65536))
    source = f"def runway(call, *args):\n    if call is None:\n        {slots} = None\n    return call(*args)\n"
    namespace: dict = {}
    exec(compile(source, "<frame runway>", "exec"), namespace)
    return namespace["runway"]


_runway = _frame_runway()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest's own protocol for the item (setup, call, teardown, reports), called from the runway above."""
    from _pytest import runner

    return _runway(runner.pytest_runtest_protocol, item, nextitem)


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
