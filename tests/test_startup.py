"""Start-up: `retrofit --help`, `retrofit --version` and `import retrofit` import no model library.

torch, transformers and the rest take seconds to import (about 5 s on an idle 2-core machine, 16-21 s on a busy one,
2026-12-06); a command imports them when it first needs them. Measured by which modules a fresh interpreter holds
afterwards, not by a clock, so the test does not depend on the machine's load.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "triton", "peft", "faiss", "safetensors", "numpy", "datasets", "accelerate")


def _heavy_modules_after(code: str) -> tuple[list[str], str, str]:
    """Run ``code`` in a fresh interpreter from the checkout's root -> (heavy modules it imported, stdout, stderr)."""
    probe = (f"import sys\n{code}\n"
             f"print('MODULES', __import__('json').dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    completed = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    output, _, modules = completed.stdout.rpartition("MODULES ")
    return json.loads(modules), output, completed.stderr


def _cli(*args: str) -> str:
    return ("import runpy\nsys.argv = ['retrofit', " + ", ".join(map(repr, args)) + "]\n"
            "try:\n    runpy.run_module('retrofit', run_name='__main__')\nexcept SystemExit as exit:\n"
            "    assert exit.code in (0, None), exit.code\n")


def test_import_retrofit_imports_no_model_library():
    heavy, _, stderr = _heavy_modules_after("import retrofit")
    assert heavy == []
    assert stderr == ""


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("generate", "--help"), ("inspect", "--help")],
                         ids=" ".join)
def test_help_and_version_import_no_model_library_and_print_no_warning(args):
    heavy, output, stderr = _heavy_modules_after(_cli(*args))
    assert heavy == []
    assert stderr == ""
    assert ("version 0.1.0" in output) if args == ("--version",) else output.startswith("Usage: ")


def test_the_help_lists_every_command_with_its_line():
    _, output, _ = _heavy_modules_after(_cli("--help"))
    listed = output.split("Commands:\n", 1)[1]
    for name in ("bench", "convert", "eval", "gates", "generate", "inspect", "lm-eval", "lm-eval-task", "select"):
        assert f"\n  {name} " in "\n" + listed, listed


def test_each_lazily_imported_command_is_the_command_it_names():
    from retrofit._entry import cli_module

    cli = cli_module()
    for name, (_, _, short_help) in cli.COMMANDS.items():
        command = cli.main.get_command(None, name)
        assert command.name == name and command.short_help == short_help


@pytest.mark.parametrize("order", ["retrofit first", "transformers first", "AutoConfig alone"])
def test_hybrid_checkpoints_load_through_the_auto_classes_whatever_was_imported_first(order):
    """`import retrofit` registers the hybrid classes when transformers imports its Auto classes, before or after."""
    fixture = ROOT / "tests" / "fixtures" / "hybrid_v1_gdn"
    code = {
        "retrofit first": "import retrofit\nfrom transformers import AutoModelForCausalLM\n"
                          f"print(type(AutoModelForCausalLM.from_pretrained({str(fixture)!r})).__name__)",
        "transformers first": "from transformers import AutoModelForCausalLM\nimport retrofit\n"
                              f"print(type(AutoModelForCausalLM.from_pretrained({str(fixture)!r})).__name__)",
        "AutoConfig alone": "import retrofit\nfrom transformers import AutoConfig\n"
                            f"print(type(AutoConfig.from_pretrained({str(fixture)!r})).__name__)",
    }[order]
    _, output, _ = _heavy_modules_after(code)
    expected = "RetrofitLlamaConfig" if order == "AutoConfig alone" else "RetrofitLlamaForCausalLM"
    assert output.strip().splitlines()[-1] == expected
