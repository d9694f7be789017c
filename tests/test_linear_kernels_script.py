"""benchmarks/linear_kernels.py's alternating timer (--repeats). The timings themselves need a GPU (run there);
here the timer is swapped for a call log so that the order of the rounds and the handling of a refusing
implementation are checked on the CPU."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "linear_kernels.py"


@pytest.fixture()
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("linear_kernels_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)     # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_rounds_alternate_and_a_refusal_drops_only_that_implementation(script, monkeypatch):
    calls = []

    def timed_by_call_order(fn):
        fn()
        calls.append(fn.__name__)
        return float(len(calls))           # a distinct "time" per call: its position in the log

    def ours():
        pass

    def fla():
        pass

    def refuses():
        raise RuntimeError("incorrect results on this triton\nsecond line")

    monkeypatch.setattr(script, "bench", timed_by_call_order)
    times, notes = script.bench_alternating({"ours": ours, "fla": fla, "broken": refuses}, repeats=3)
    assert calls == ["ours", "fla"] * 3                 # alternating within each round, the refusal never timed
    assert times == {"ours": [1.0, 3.0, 5.0], "fla": [2.0, 4.0, 6.0], "broken": []}
    assert notes == {"broken": "refused: RuntimeError: incorrect results on this triton"}


def test_repeats_below_one_is_a_one_line_error(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
