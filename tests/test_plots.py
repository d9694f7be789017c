"""The pictures of docs/: bench's decode tokens/s against context and a conversion's loss curve, drawn from the
saved results the guides show, with the numbers drawn equal to the numbers saved."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from retrofit.bench.plot import bench_series, chart_title, save_bench_plot
from retrofit.convert.plot import save_loss_plot
from retrofit.errors import RetrofitError
from retrofit.plotting import PNG_SIGNATURE

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCH = RESULTS / "2026-12-04" / "h200_bench_gdn_quest_streaming.json"
CONVERT_LOG = RESULTS / "2026-12-02" / "kda_mended" / "h200_convert_long_kda-8of30.log"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_plot_draws_the_saved_decode_tokens_per_s(tmp_path):
    saved = json.loads(BENCH.read_text())
    out = tmp_path / "bench.png"
    series = save_bench_plot(saved["results"], out, title=chart_title(saved["config"]))
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]
    assert list(series) == [f"{variant}, batch {batch}" for variant in saved["config"]["variants"] for batch in (1, 8)]
    assert series["dense, batch 1"] == {"context": [4096, 32768],
                                        "decode_tokens_per_s": [202.75691684549872, 165.97239290941292],
                                        "prefill_s": [0.6029747495000031, 2.5426448264999983]}
    for point in saved["results"]:
        line = series[f"{point['variant']}, batch {point['batch']}"]
        at = line["context"].index(point["context"])
        assert (line["decode_tokens_per_s"][at], line["prefill_s"][at]) == (point["decode_tokens_per_s"],
                                                                            point["prefill_s"])
    assert chart_title(saved["config"]) == "config llama3-8b (random weights), NVIDIA H200, bfloat16"


def test_bench_plot_names_the_engine_when_a_run_has_several():
    saved = json.loads((RESULTS / "2026-12-02" / "h200_bench_fused_quest.json").read_text())
    series = bench_series(saved["results"])
    assert "dense, retrofit, batch 1" in series and "quest@2048, retrofit-fused, batch 8" in series
    assert len(series) == len({(p["variant"], p["engine"], p["batch"]) for p in saved["results"] if not p["error"]})


def test_bench_json_files_joined_refuse_a_point_twice(tmp_path):
    plot_bench_json = script("plot_bench_json")
    points = plot_bench_json.joined_points([BENCH], variants=["dense"])
    assert {point["variant"] for point in points} == {"dense"} and len(points) == 4
    with pytest.raises(RetrofitError, match="dense, batch 1 at context 4096 measured twice"):
        bench_series(plot_bench_json.joined_points([BENCH, BENCH]))
    out = tmp_path / "joined.png"
    plot_bench_json.main([str(BENCH), "--variants", "dense,streaming@2048", "--out", str(out)])
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_loss_curve_from_a_conversion_log(tmp_path):
    losses = script("plot_convert_loss").losses_from_log(CONVERT_LOG)
    assert [step for step, _ in losses["stage1"]] == list(range(1, 74))
    assert [step for step, _ in losses["stage2"]] == list(range(1, 296))
    assert losses["stage1"][:2] == [(1, 1.1519), (2, 1.0965)]
    assert losses["stage2"][-1] == (295, 0.0867)
    out = tmp_path / "loss.png"
    series = save_loss_plot({"KDA 8 of 30": losses}, out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    line = series["KDA 8 of 30"]
    assert line["stage2_from"] == [74] and line["step"] == list(range(1, 74 + 295))
    assert line["loss"] == [loss for _, loss in losses["stage1"] + losses["stage2"]]


def test_loss_curve_from_convert_loss_curve_json(tmp_path):
    plot_convert_loss = script("plot_convert_loss")
    saved = tmp_path / "after.json"
    saved.write_text(json.dumps({"stage1": [0.9, 0.5, 0.4], "stage2": [0.3, 0.2]}))
    out = tmp_path / "loss.png"
    plot_convert_loss.main([str(saved), str(CONVERT_LOG), "--label", "cpu-small", "--out", str(out)])
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert plot_convert_loss.losses_from_json(saved) == {"stage1": [(1, 0.9), (2, 0.5), (3, 0.4)],
                                                         "stage2": [(1, 0.3), (2, 0.2)]}
    empty = tmp_path / "quiet.log"
    empty.write_text("stage 1 finished: loss of its first step here 1.1415, mean of the last 20 steps 0.0759\n")
    with pytest.raises(RetrofitError, match="no progress bar with a loss"):
        plot_convert_loss.losses_from_log(empty)
