"""The conversion report: generation fidelity, the held-out check, `retrofit eval --report`, and `retrofit convert`
ending with dense beside the hybrid in report.json (the real model, the real data, the real command)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _cli_runner import run

from retrofit._entry import cli_module
from retrofit.errors import RetrofitError
from retrofit.eval import EvalSettings, build_jobs, run_eval
from retrofit.eval.conversion_report import DEFAULT_CONTEXT_LENGTHS, DEFAULT_SEEDS, ReportSettings
from retrofit.eval.command import report_options
from retrofit.eval.fidelity import NEW_TOKENS, PROMPT_TOKENS, agreement, cut_prompts
from retrofit.eval.held_out import check_held_out, sampled_passages
from retrofit.variants import Variant, dense, parse_variant_spec

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_agreement_counts_the_leading_run_and_the_matching_positions():
    reference = torch.tensor([[1, 2, 3, 4]] * 3)
    tokens = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [5, 2, 3, 8]])
    leading, fraction = agreement(tokens, reference)
    assert leading.tolist() == [4, 1, 0]
    assert fraction.tolist() == [1.0, 0.75, 0.5]


def test_prompts_are_evenly_spaced_and_whole(smollm2, eval_data_dir):
    _, tokenizer = smollm2
    text = (eval_data_dir / "wikitext2_test.raw").read_text()[:200_000]
    total = len(tokenizer.encode(text, add_special_tokens=False))
    prompts = cut_prompts(tokenizer, text, count=5)
    assert [prompt.offset for prompt in prompts] == [index * (total // 5) for index in range(5)]
    assert all(len(prompt.token_ids) == PROMPT_TOKENS for prompt in prompts)
    assert len(cut_prompts(tokenizer, text[:3000], count=16)) == len(tokenizer.encode(text[:3000])) // PROMPT_TOKENS
    with pytest.raises(RetrofitError, match="fewer than one prompt of 256"):
        cut_prompts(tokenizer, "A short text.", count=16)


def test_fidelity_is_exact_for_dense_against_itself_and_low_for_a_converted_layer(smollm2, eval_data_dir):
    """Greedy decoding on the CPU in float32 is deterministic, so dense run twice agrees on all 128 tokens of every
    prompt; an undistilled GDN layer in place of layer 13's attention changes the text within a few tokens."""
    model, tokenizer = smollm2
    jobs = build_jobs(["fidelity"], EvalSettings(data_dir=eval_data_dir, limit=2))
    again = Variant("dense-again", dense().opener)
    report = run_eval(model, tokenizer, jobs, [again, parse_variant_spec("convert:gdn:13")], batch_size=2)
    for name in ("dense", "dense-again"):
        entries = report.results[name]["fidelity"]
        assert (entries["agree_prefix"], entries["agree"], entries["n"]) == (NEW_TOKENS, 1.0, 2)
        assert entries["agree_prefix_stderr"] == 0.0
    assert report.results["dense-again"]["fidelity"]["agree_prefix_delta"] == 0.0
    assert [s["output"] for s in report.samples["dense"]["fidelity"]] == \
        [s["output"] for s in report.samples["dense-again"]["fidelity"]]
    converted = report.results["convert:gdn:13"]["fidelity"]
    # seen: 0.5 leading tokens of 128 and 1.2% of the positions; half of them would already be a broken comparison
    assert converted["agree_prefix"] < NEW_TOKENS / 2 and converted["agree"] < 0.5
    assert converted["agree_prefix_delta"] == converted["agree_prefix"] - NEW_TOKENS
    samples = report.samples["convert:gdn:13"]["fidelity"]
    assert [sample["prompt_tokens"] for sample in samples] == [PROMPT_TOKENS] * 2 and samples[0]["offset"] == 0


def test_held_out_check_finds_copies_and_contained_text(tmp_path, eval_data_dir, calib_data_dir):
    test_text = eval_data_dir / "wikitext2_test.raw"
    book = calib_data_dir / "walden.txt"
    check_held_out([test_text], [test_text], [book])  # unrelated texts pass
    copy = tmp_path / "renamed.md"
    copy.write_bytes(test_text.read_bytes())
    with pytest.raises(RetrofitError, match="has the same content as the calibration file .*renamed.md"):
        check_held_out([test_text], [test_text], [book, copy])
    # the text re-wrapped at 70 characters inside a larger file: other bytes, the same passages
    text = test_text.read_text()
    inside = tmp_path / "corpus.txt"
    inside.write_text(book.read_text() + "\n" + textwrap.fill(text, 70) + "\n" + book.read_text())
    sampled = len(sampled_passages(text))
    with pytest.raises(RetrofitError, match=f"corpus.txt .* contains the evaluation text .* \\({sampled} of {sampled}"):
        check_held_out([test_text], [test_text], [book, inside])


def test_eval_report_expands_to_the_reports_tasks_lengths_and_seeds(eval_data_dir):
    command = cli_module().main.get_command(None, "eval")

    def expanded(*args):
        context = command.make_context("eval", ["smollm2-135m", "--report", "--data-dir", str(eval_data_dir), *args])
        values = context.params
        return report_options(context, values["data_dir"], values["seq_len"], values["context_length"],
                              values["num_seeds"])

    tasks = ",".join(ReportSettings(data_dir=eval_data_dir).task_names())
    assert tasks == "wikitext2,piqa,arc_easy,passkey,niah_single,fidelity"
    assert expanded() == (tasks, ",".join(map(str, DEFAULT_CONTEXT_LENGTHS)), DEFAULT_SEEDS)
    assert expanded("--context-length", "1k", "--num-seeds", "2") == (tasks, "1k", 2)
    with pytest.raises(RetrofitError, match="--report chooses the tasks"):
        expanded("--tasks", "piqa")


def test_python_dash_m_retrofit_runs_the_whole_command_line(tmp_path):
    """``python -m retrofit convert`` (what ``torchrun -m retrofit`` starts) has the report's options; the
    conversion's own module keeps its options as they were."""
    def help_of(*module):
        result = subprocess.run([sys.executable, "-m", *module, "convert", "--help"], capture_output=True, text=True,
                                cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    whole = help_of("retrofit")
    assert "--report-data-dir" in whole and "--resume" in whole
    assert "--report" not in help_of("retrofit.convert.command")


@pytest.fixture(scope="module")
def converted(one_cpu_thread, tmp_path_factory, calib_data_dir, eval_data_dir):
    """`retrofit convert` of the cpu-small recipe at a 2K-token budget, with a small report (2 items per task, windows
    and long contexts of 512 tokens): (out, CLI result)."""
    out = tmp_path_factory.mktemp("report") / "hybrid"
    result = run("convert", "smollm2-135m", "--recipe", "smollm2-135m/cpu-small", "--data", str(calib_data_dir),
                 "--out", str(out), "--tokens", "2048", "--seq-len", "64", "--batch-size", "4", "--stage1-fraction",
                 "0.5", "--checkpoint-every", "0", "--device", "cpu", "--quiet", "--report-data-dir",
                 str(eval_data_dir), "--report-limit", "2", "--report-context", "512", "--report-seq-len", "512",
                 "--report-seeds", "1")
    return out, result


@pytest.mark.slow
def test_convert_ends_with_the_report(converted, calib_data_dir):
    out, result = converted
    assert result.exit_code == 0, (result.output[-3000:], result.stderr[-3000:])
    payload = json.loads((out / "report.json").read_text())
    tasks = ["wikitext2", "piqa", "arc_easy", "passkey@512", "niah_single@512", "fidelity"]
    assert list(payload["results"]) == ["dense", "hybrid:hybrid"]
    dense_results, hybrid_results = payload["results"]["dense"], payload["results"]["hybrid:hybrid"]
    assert list(dense_results) == tasks and list(hybrid_results) == tasks
    for task in tasks:
        metrics = [name for name in dense_results[task] if not name.endswith("_stderr") and name != "n"
                   and "_ci95_" not in name]
        assert metrics and all(f"{name}_delta" in hybrid_results[task] for name in metrics), task
        assert dense_results[task]["n"] == hybrid_results[task]["n"] == 2
    # the first 2 windows of 512 tokens of wikitext2_test.raw (float32, CPU): seen 26.684
    assert dense_results["wikitext2"]["ppl"] == pytest.approx(26.684, abs=0.005)
    assert dense_results["fidelity"]["agree_prefix"] == 128 and dense_results["fidelity"]["agree"] == 1.0
    # 2 layers distilled on 2K tokens: the text departs from dense's within a few tokens (seen 4 of 128)
    assert hybrid_results["fidelity"]["agree_prefix"] < 128
    config = payload["config"]
    assert config["tasks"] == ["wikitext2", "piqa", "arc_easy", "passkey", "niah_single", "fidelity"]
    assert (config["limit"], config["context_lengths"], config["seeds"]) == (2, [512], [0])
    conversion = config["conversion"]
    assert (conversion["layer_type"], conversion["layers"], conversion["recipe"]) == ("gdn", [13, 22],
                                                                                        "smollm2-135m/cpu-small")
    assert conversion["tokens"] == 2048 == conversion["token_budget"]  # 4 + 4 steps of 4 windows of 64 tokens
    assert len(conversion["calibration_files"]) == len(list(calib_data_dir.glob("*.txt")))
    assert 0 < conversion["seconds_this_part"] == conversion["seconds"]  # one part: nothing paused
    assert conversion["peak_memory_bytes_this_part"] == conversion["peak_memory_bytes"]
    # max RSS holds the float32 dense model (0.54 GB, shared by teacher and student) at least, and fits this machine
    assert 1.0e9 < conversion["peak_memory_bytes"] < 24 * 2 ** 30
    assert conversion["peak_memory_measure"] == "max RSS of the process"
    lines = result.stdout.splitlines()
    assert "| task / metric | dense | hybrid:hybrid |" in lines
    assert any(line.startswith("| fidelity agree_prefix (tokens), n=2 | 128.0 ± 0.0 | ") for line in lines)
    assert any(line.startswith("conversion: 2 gdn layers (13,22), 2,048 tokens in ") for line in lines)
    assert lines[-1] == f"report: {out / 'report.json'}"
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_eval_report_on_the_saved_hybrid_gives_the_same_numbers(converted, eval_data_dir, tmp_path):
    """`retrofit eval MODEL --hybrid DIR --report` with the same limits reproduces the conversion's report."""
    out, _ = converted
    again = tmp_path / "again.json"
    result = run("eval", "smollm2-135m", "--hybrid", str(out), "--report", "--data-dir", str(eval_data_dir),
                 "--limit", "2", "--context-length", "512", "--seq-len", "512", "--num-seeds", "1", "--device", "cpu",
                 "--json", str(again))
    assert result.exit_code == 0, (result.output[-3000:], result.stderr[-3000:])
    assert json.loads(again.read_text())["results"] == json.loads((out / "report.json").read_text())["results"]
