"""benchmarks/plot_eval_json.py: saved eval results joined into one report for ``--plot``'s drawing (the pictures of
docs/), read from the results the guides show."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from retrofit.errors import RetrofitError

ROOT = Path(__file__).resolve().parents[1]
SPARSE = ROOT / "benchmarks" / "results" / "2026-11-30" / "quest-page4-seer-long-gates"
REPORTS = [ROOT / "benchmarks" / "results" / "2026-12-04" / "h200_convert_report_kda-8of30-50m-b16.json",
           ROOT / "benchmarks" / "results" / "2026-12-06" / "h100_convert_report_kda-15of30-copyrank.json"]


@pytest.fixture(scope="module")
def plot_script():
    spec = importlib.util.spec_from_file_location("plot_eval_json", ROOT / "benchmarks" / "plot_eval_json.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reports_of_two_days_sit_side_by_side(plot_script):
    report = plot_script.joined_report(REPORTS, tasks=["wikitext2", "passkey"])
    assert report.variants == ["dense", "hybrid:kda-8of30-50m-b16", "hybrid:kda-15of30-copyrank"]
    assert list(report.results["dense"]) == ["wikitext2", "passkey@2048", "passkey@4096", "passkey@8192"]
    ratios = [report.results[name]["wikitext2"]["ppl"] / report.results["dense"]["wikitext2"]["ppl"]
              for name in report.variants[1:]]
    assert ratios == pytest.approx([1.093, 1.196], abs=5e-4)  # BENCHMARKS.md, Conversion
    assert [report.results["hybrid:kda-15of30-copyrank"][f"passkey@{n}"]["score"] for n in (2048, 4096, 8192)] == \
        pytest.approx([1.00, 0.50, 0.05])


def test_one_evaluation_run_a_length_at_a_time_joins_and_reads_percent_as_fractions(plot_script):
    files = [SPARSE / f"h200_sparse_eval_{length}_main.json" for length in (2048, 4096, 8000)]
    report = plot_script.joined_report(files, tasks=["niah_single"], variants=["quest@1024,page_size=4"])
    assert report.variants == ["dense", "quest@1024,page_size=4"]
    scores = [report.results["quest@1024,page_size=4"][f"niah_single@{n}"]["score"] for n in (2048, 4096, 8000)]
    assert scores == pytest.approx([0.95, 1.00, 1.00])  # saved in percent before 2026-12-02, drawn as fractions


def test_a_variant_twice_or_a_different_dense_is_refused(plot_script, tmp_path):
    with pytest.raises(RetrofitError, match="already comes from an earlier file"):
        plot_script.joined_report([REPORTS[0], REPORTS[0]])
    other = json.loads(REPORTS[0].read_text())
    other["results"]["dense"]["wikitext2"]["ppl"] *= 1.01
    (tmp_path / "other.json").write_text(json.dumps({**other, "results": {"dense": other["results"]["dense"]}}))
    with pytest.raises(RetrofitError, match="dense wikitext2 ppl .* differs"):
        plot_script.joined_report([REPORTS[0], tmp_path / "other.json"])
    with pytest.raises(RetrofitError, match="--variants: quest@9 not in the results"):
        plot_script.joined_report(REPORTS, variants=["quest@9"])
