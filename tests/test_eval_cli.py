"""`retrofit eval` end to end and its one-line errors (exit code 2), through click's CliRunner on the real group."""
from __future__ import annotations

import json
import re

import pytest
from _cli_runner import assert_one_line_error, run

from retrofit.errors import RetrofitError
from retrofit.eval.runner import EvalReport
from retrofit.eval.table import markdown_table
from retrofit.variants import parse_variant_spec, variants_from_options


def test_unknown_task_suggests_the_closest(eval_data_dir):
    result = run("eval", "smollm2-135m", "--tasks", "piqa,arc_eazy", "--data-dir", str(eval_data_dir))
    assert_one_line_error(result, "unknown task 'arc_eazy'", "did you mean 'arc_easy'")


def test_missing_data_file(tmp_path):
    result = run("eval", "smollm2-135m", "--tasks", "piqa", "--data-dir", str(tmp_path))
    assert_one_line_error(result, "data file not found", "piqa.jsonl")
    result = run("eval", "smollm2-135m", "--tasks", f"ppl:{tmp_path / 'nothing.txt'}")
    assert_one_line_error(result, "data file not found", "nothing.txt")


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_non_positive_limit(eval_data_dir, limit):
    result = run("eval", "smollm2-135m", "--tasks", "piqa", "--data-dir", str(eval_data_dir), "--limit", limit)
    assert_one_line_error(result, "--limit must be a positive number", limit)


def test_context_length_over_the_model_limit():
    # SmolLM2 has max_position_embeddings = 8192; the check runs after the model is loaded
    result = run("eval", "smollm2-135m", "--tasks", "passkey", "--context-length", "16k", "--limit", "1")
    assert_one_line_error(result, "--context-length 16384 is over the model's limit of 8192")


def test_variant_options_need_their_partner():
    result = run("eval", "smollm2-135m", "--tasks", "passkey", "--budget", "256")
    assert_one_line_error(result, "--budget needs --sparse")


def test_eval_writes_json_and_prints_the_table(eval_data_dir, tmp_path):
    out = tmp_path / "nested" / "eval.json"
    result = run("eval", "smollm2-135m", "--tasks", "arc_easy,mine", "--data-dir", str(eval_data_dir),
                 "--task-file", f"mine={eval_data_dir / 'piqa.jsonl'}", "--limit", "3", "--device", "cpu",
                 "--json", str(out))
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert list(payload["results"]) == ["dense"]
    assert list(payload["results"]["dense"]) == ["arc_easy", "mine"]  # a --task-file name is a task like any other
    for metrics in payload["results"]["dense"].values():
        assert set(metrics) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n"} and metrics["n"] == 3
        assert metrics["acc"] in (0, 1 / 3, 2 / 3, 1) and metrics["acc_norm"] in (0, 1 / 3, 2 / 3, 1)
        # stderr of 3 outcomes of 0/1: sqrt(p (1 - p) / (n - 1)), 0 when all agree
        p = metrics["acc"]
        assert metrics["acc_stderr"] == pytest.approx((p * (1 - p) / 2) ** 0.5, rel=1e-12, abs=1e-15)
    assert payload["units"]["fraction"] == ["acc", "acc_norm", "agree", "partial", "score", "score_sd"]
    assert payload["config"]["limit"] == 3 and payload["config"]["dtype"] == "float32"
    assert payload["throughput"]["dense"]["tokens_per_s"] > 0
    assert not list(out.parent.glob(".*.tmp"))  # the temporary file was renamed, not left behind
    table = result.stdout.strip().splitlines()
    assert table[0].startswith("value ± stderr")  # the legend, then the table
    assert table[2] == "| task / metric | dense |"
    assert table[4].startswith("| arc_easy acc (%), n=3 |") and table[-2].startswith("| tokens/s |")
    # --batch-size auto (the default): each task ran at a batch of at most its rows (3 items x 4 or 2 choices), and
    # the table's last row says which
    sizes = payload["config"]["batch_sizes"]["dense"]
    assert set(sizes) == {"arc_easy", "mine"} and 1 <= sizes["arc_easy"] <= 12 and 1 <= sizes["mine"] <= 6
    shown = str(sizes["arc_easy"]) if sizes["arc_easy"] == sizes["mine"] else \
        f"arc_easy {sizes['arc_easy']}, mine {sizes['mine']}"
    assert table[-1] == f"| batch size (auto) | {shown} |"


def test_variant_spec_strings_and_names():
    assert parse_variant_spec("quest:budget=256,page_size=16").name == "quest@256,page_size=16"
    assert parse_variant_spec("dense").name == "dense"
    names = [v.name for v in variants_from_options(["quest", "streaming"], [256, 1024], [], [], [])]
    assert names == ["quest@256", "quest@1024", "streaming@256", "streaming@1024"]
    with pytest.raises(RetrofitError, match="integer budget"):
        parse_variant_spec("quest:page_size=16")
    with pytest.raises(RetrofitError, match="given twice"):
        variants_from_options(["quest"], [256], [], [], ["quest:budget=256"])
    with pytest.raises(RetrofitError, match="no such directory"):
        variants_from_options([], [], [], ["/no/such/hybrid"], [])


def test_table_shows_uncertainty_paired_deltas_and_speed_ratio():
    report = EvalReport(
        results={"dense": {"piqa": {"acc": 0.625, "acc_stderr": 0.0343, "n": 200},
                           "wikitext2": {"ppl": 23.94, "ppl_ci95_low": 22.1, "ppl_ci95_high": 25.9, "n": 32},
                           "fidelity": {"kl": 0.0}},
                 "quest@256": {"piqa": {"acc": 0.6, "acc_stderr": 0.0347, "n": 200, "acc_delta": -0.025,
                                        "acc_delta_stderr": 0.01, "acc_delta_ci95_low": -0.0446,
                                        "acc_delta_ci95_high": -0.0054},
                               "wikitext2": {"ppl": 24.5, "ppl_ci95_low": 22.6, "ppl_ci95_high": 26.5, "n": 32,
                                             "ppl_delta": 0.56, "ppl_delta_ci95_low": -0.1,
                                             "ppl_delta_ci95_high": 1.2},
                               "fidelity": {"kl": 0.1, "kl_delta": 0.1}}},
        throughput={"dense": {"tokens_per_s": 100.0}, "quest@256": {"tokens_per_s": 250.0}})
    lines = markdown_table(report).splitlines()
    assert lines[2] == "| task / metric | dense | quest@256 |"
    # * marks a delta whose 95% interval excludes 0
    assert lines[4] == "| piqa acc (%), n=200 | 62.50 ± 3.43 | 60.00 ± 3.47 (Δ -2.50 [-4.46, -0.54] *) |"
    assert lines[5] == ("| wikitext2 ppl, n=32 | 23.940 [22.100, 25.900] | "
                        "24.500 [22.600, 26.500] (Δ +0.560 [-0.100, +1.200]) |")
    assert lines[6] == "| fidelity kl | 0.000 | 0.100 (Δ +0.100) |"  # a plain {metric: value} job: a bare delta
    assert lines[7] == "| tokens/s | 100.0 | 250.0 (2.50x) |"


def test_table_says_dense_by_construction_and_shows_a_broken_one():
    entries = {"acc": 0.5, "acc_stderr": 0.1, "n": 20, "acc_delta": 0.0, "acc_delta_stderr": 0.0,
               "acc_delta_ci95_low": 0.0, "acc_delta_ci95_high": 0.0}
    report = EvalReport(results={"dense": {"piqa": dict(entries)}, "streaming@64": {"piqa": dict(entries)}},
                        throughput={"dense": {"tokens_per_s": 1.0}, "streaming@64": {"tokens_per_s": 1.0}},
                        dense_by_construction={"streaming@64": ["piqa"]})
    assert markdown_table(report).splitlines()[4] == "| piqa acc (%), n=20 | 50.00 ± 10.00 | = dense (by construction) |"
    report.results["streaming@64"]["piqa"].update(acc=0.45, acc_delta=-0.05, acc_delta_ci95_low=-0.1,
                                                  acc_delta_ci95_high=0.0)
    assert markdown_table(report).splitlines()[4].endswith("(Δ -5.00 [-10.00, +0.00]) ≠ dense! |")


def test_sparse_variant_plugs_in_and_leaves_prefill_scores_alone(eval_data_dir, tmp_path):
    """Sparse decoding changes decode steps only; multiple choice is scored by prefill, so the variant takes dense's
    numbers without running again (tests/test_sparse_decoding.py holds each method to bit-identical forward passes):
    a delta of 0 with stderr 0, listed as dense by construction, and the table says so instead of printing the 0; its
    tokens/s says it ran nothing of its own. --log-samples writes one line per variant and item."""
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    result = run("eval", "smollm2-135m", "--tasks", "piqa", "--data-dir", str(eval_data_dir), "--limit", "3",
                 "--device", "cpu", "--sparse", "streaming", "--budget", "64", "--json", str(out),
                 "--log-samples", str(samples))
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert list(payload["results"]) == ["dense", "streaming@64"]
    dense_piqa, sparse_piqa = payload["results"]["dense"]["piqa"], payload["results"]["streaming@64"]["piqa"]
    assert {k: v for k, v in sparse_piqa.items() if "_delta" not in k} == dense_piqa  # to the last digit
    assert sparse_piqa["acc_delta"] == 0.0 and sparse_piqa["acc_delta_stderr"] == 0.0
    assert payload["dense_by_construction"] == {"streaming@64": ["piqa"]}
    assert "| piqa acc (%), n=3 |" in result.stdout and "= dense (by construction)" in result.stdout
    speed = next(line for line in result.stdout.splitlines() if line.startswith("| tokens/s |"))
    assert speed.endswith(" | - (no task of its own: = dense) |"), speed
    assert re.fullmatch(r"\| batch size \(auto\) \| \d+ \| - \|", result.stdout.splitlines()[-1])  # ran none
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["variant"], r["item"]) for r in records] == [("dense", 0), ("dense", 1), ("dense", 2),
                                                           ("streaming@64", 0), ("streaming@64", 1),
                                                           ("streaming@64", 2)]
    first = records[0]
    assert first["task"] == "piqa" and first["gold"] == 0 and len(first["loglikelihoods"]) == 2
    assert first["acc"] == float(first["pred"] == first["gold"])
    assert sum(r["acc"] for r in records[:3]) / 3 == dense_piqa["acc"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_is_written_atomically_as_png(tmp_path):
    from retrofit.eval.plot import save_plot

    report = EvalReport(
        results={name: {"passkey@1024": {"score": s1}, "passkey@2048": {"score": s2},
                        "piqa": {"acc": 0.6, "acc_stderr": 0.03, "n": 200}}
                 for name, s1, s2 in (("dense", 1.0, 0.75), ("streaming@64", 0.5, 0.25))},
        throughput={"dense": {"tokens_per_s": 1.0}, "streaming@64": {"tokens_per_s": 2.0}})
    out = tmp_path / "plot.png"
    save_plot(report, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_hybrid_variant_loads_a_saved_checkpoint(smollm2, eval_data_dir, tmp_path):
    """--hybrid DIR evaluates the checkpoint beside dense: one layer converted to GDN (initialised from the
    attention weights, not distilled) must change the perplexity, and the numbers must stay finite."""
    from retrofit.convert.build import to_hybrid
    from retrofit.hybrid import HybridSection, save_hybrid

    dense_model, tokenizer = smollm2
    hybrid = to_hybrid(dense_model, HybridSection(layers=[15], layer_type="gdn", base_model_type="llama"))
    save_hybrid(hybrid, tokenizer, tmp_path / "gdn15")
    out = tmp_path / "eval.json"
    text = eval_data_dir / "tinyshakespeare.txt"
    result = run("eval", "smollm2-135m", "--tasks", f"ppl:{text}", "--seq-len", "64", "--limit", "2",
                 "--device", "cpu", "--hybrid", str(tmp_path / "gdn15"), "--json", str(out))
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["dense", "hybrid:gdn15"]
    dense_ppl, hybrid_ppl = (results[name][f"ppl:{text}"]["ppl"] for name in results)
    assert 1 < dense_ppl < 1000 and 1 < hybrid_ppl < 1e6
    assert abs(hybrid_ppl - dense_ppl) / dense_ppl > 1e-3  # an untrained GDN layer is not the attention it replaced


def test_progress_bars_name_the_variant_they_run():
    """Each task's bar is named VARIANT: TASK, dense's and each variant's apart."""
    result = run("eval", "smollm2-135m", "--tasks", "passkey", "--context-length", "512", "--limit", "1",
                 "--device", "cpu", "--sparse", "streaming", "--budget", "64")
    assert result.exit_code == 0, result.output
    names = set(re.findall(r"([\w@.-]+: passkey@512): +\d+%", result.stderr))
    assert names == {"dense: passkey@512", "streaming@64: passkey@512"}, result.stderr
