"""Layer selection: the ``--layers`` grammar, and the scored selector on the real SmolLM2 and calibration text."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from retrofit.convert.command import select_command
from retrofit.convert.data import token_windows
from retrofit.convert.distill import kl_loss
from retrofit.errors import RetrofitError
from retrofit.convert.selection import choose, layer_count, parse_layer_spec, ranking_table, score_layers


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.parametrize("spec, expected", [
    ("0,2,4", (0, 2, 4)),
    ("4,0,2,2", (0, 2, 4)),
    ("3-6,10", (3, 4, 5, 6, 10)),
    ("every:4", (3, 7, 11, 15, 19, 23, 27)),
    ("every:4:0", (0, 4, 8, 12, 16, 20, 24, 28)),
    ("every:2", tuple(range(1, 30, 2))),
    # not:SPEC = the layers SPEC leaves out: 3 of every 4 layers, every 4th (3, 7, ...) kept softmax
    ("not:every:4", tuple(i for i in range(30) if i % 4 != 3)),
    ("not:every:4:0", tuple(i for i in range(30) if i % 4 != 0)),
    ("not:0,29", tuple(range(1, 29))),
    ("not: 3-27", (0, 1, 2, 28, 29)),
], ids=["list", "unsorted-dupes", "range", "every4", "every4-offset0", "every2", "not-every4", "not-every4-offset0",
        "not-list", "not-range-with-space"])
def test_explicit_and_every_specs(spec, expected):
    parsed = parse_layer_spec(spec, 30)
    assert parsed.indices == expected and not parsed.needs_scoring


@pytest.mark.parametrize("spec, message", [
    ("0,30", "layer index 30 is out of range"),
    ("", "--layers is empty"),
    ("every:0", "K must be >= 1"),
    ("every:x", "expected every:K"),
    ("fraction:1.5", "the fraction must be in"),
    ("fraction:abc", "expected fraction:F"),
    ("layers 1 2", "use a list like"),
    ("6-3", "bad range"),
    ("not:", "expected not:SPEC"),
    ("not:fraction:0.5", "SPEC must be a list or every:K"),
    ("not:not:3", "SPEC must be a list or every:K"),
    ("not:0-29", "leaves no layer to convert"),
    ("not:every:1", "leaves no layer to convert"),
    ("not:every:0", "K must be >= 1"),
    ("not:30", "layer index 30 is out of range"),
    ("0-29", "keep at least one softmax attention layer"),
    ("every:1", "keep at least one softmax attention layer"),
], ids=["out-of-range", "empty", "every0", "every-nan", "fraction-big", "fraction-nan", "words", "reversed-range",
        "not-empty", "not-fraction", "not-not", "not-everything", "not-every1", "not-every0", "not-out-of-range", "all-layers", "every1-all"])
def test_bad_specs_raise_retrofit_error(spec, message):
    with pytest.raises(RetrofitError, match=message) as raised:
        parse_layer_spec(spec, 30)
    assert "\n" not in str(raised.value)  # the CLI prints it as one line


@pytest.mark.parametrize("num_layers, inner", [(4, "every:4"), (7, "every:2:1"), (32, "every:4"), (5, "0"),
                                               (9, "2-4,8")])
def test_complement_is_exactly_what_the_spec_leaves_out(num_layers, inner):
    named = set(parse_layer_spec(inner, num_layers).indices)
    complement = parse_layer_spec(f"not:{inner}", num_layers)
    assert set(complement.indices) == set(range(num_layers)) - named
    assert list(complement.indices) == sorted(complement.indices)
    assert complement.kind == "complement" and not complement.needs_scoring


def test_not_every_4_is_three_of_four_layers():
    # the llama3-8b hybrid of BENCHMARKS.md (End-to-end generation, 2026-11-30): 24 of 32 layers converted, softmax attention kept at 3, 7, ..., 31
    parsed = parse_layer_spec("not:every:4", 32)
    assert len(parsed.indices) == 24 and set(range(3, 32, 4)).isdisjoint(parsed.indices)


def test_fraction_counts():
    assert parse_layer_spec("fraction:0.5", 30).needs_scoring
    assert layer_count(0.5, 30) == 15 and layer_count(8 / 30, 30) == 8 and layer_count(0.01, 30) == 1
    assert layer_count(1.0, 30) == 29  # one softmax layer always stays


@pytest.fixture(scope="module")
def scored(smollm2, calib_data_dir):
    """Scores of all 30 SmolLM2 layers from a short alignment (4 steps x 2 windows of 64 tokens) and a KL probe on 3
    windows, plus 3 held-out windows the scorer never saw."""
    model, tokenizer = smollm2
    windows = token_windows(tokenizer, [str(calib_data_dir)], 8 + 3 + 3, 64, seed=7, show_progress=False)
    aligned: dict = {}
    scores = score_layers(model, windows[:11], layer_type="gdn", align_steps=4, batch_size=2, probe_windows=3,
                          show_progress=False, aligned=aligned)
    return scores, windows[11:], aligned


def test_scored_selector_ranks_every_layer(scored):
    scores, _, _ = scored
    assert sorted(s.layer for s in scores) == list(range(30))
    kls = [s.kl for s in scores]
    assert kls == sorted(kls) and all(k > 0 and k == k for k in kls)  # ascending, positive, finite (not NaN)
    chosen = choose(scores, 0.5, 30)
    assert len(chosen) == 15 and chosen == sorted(s.layer for s in scores[:15])
    table = ranking_table(scores, chosen)
    assert table.count("\n") == 31 and "| 1 | " in table


def test_ranking_generalises_to_held_out_text(smollm2, scored):
    """The cheapest-ranked layers, converted alone (aligned layer swapped in), cost less KL on text the scorer never
    saw than the costliest-ranked ones: the ranking measures the layers, not the probe windows."""
    model, _ = smollm2
    scores, held_out, aligned = scored
    cheap, costly = [s.layer for s in scores[:3]], [s.layer for s in scores[-3:]]
    # a spread of at least 2x between the ends of the ranking on the probe windows makes the comparison meaningful
    assert scores[-1].kl > 2 * scores[0].kl
    with torch.no_grad():
        reference = model(held_out).logits

    def kl_if_converted(layer: int) -> float:
        block = model.model.layers[layer]
        original = block.self_attn
        block.self_attn = aligned[layer]
        try:
            with torch.no_grad():
                return float(kl_loss(model(held_out).logits, reference))
        finally:
            block.self_attn = original

    assert sum(map(kl_if_converted, cheap)) < sum(map(kl_if_converted, costly))


def test_select_command_rejects_bad_fraction(calib_data_dir):
    result = CliRunner().invoke(select_command, ["smollm2-135m", "--fraction", "0", "--data", str(calib_data_dir)])
    assert isinstance(result.exception, RetrofitError) and "fraction must be in" in str(result.exception)
