"""Standard errors, paired deltas and intervals against their closed forms on known vectors of outcomes, and the JSON
entries the runner builds from them."""
from __future__ import annotations

import math

import pytest

from retrofit.eval import stats
from retrofit.eval.outcome import MeanMetric, PerplexityMetric, TaskOutcome, is_primary, summarize, summarize_against

# Closed forms are evaluated in float64 from the same inputs; 1e-12 relative covers summation-order rounding only.
EXACT = 1e-12


def test_acc_stderr_is_lm_evals_closed_form():
    # 123 right of 200: p = 0.615, stderr = sqrt(p (1 - p) / (n - 1)) (lm-eval's sample stderr of a 0/1 mean)
    outcomes = [1.0] * 123 + [0.0] * 77
    p = 123 / 200
    assert stats.mean(outcomes) == p
    assert stats.mean_stderr(outcomes) == pytest.approx(math.sqrt(p * (1 - p) / 199), rel=EXACT)
    assert stats.mean_stderr(outcomes) == pytest.approx(0.0344938, abs=1e-7)  # the "3.5 points on 200 items"
    assert math.isnan(stats.mean_stderr([1.0]))  # one item has no spread


def test_acc_stderr_equals_lm_evaluation_harness():
    from lm_eval.api.metrics import mean_stderr  # the harness's own aggregation of acc_stderr

    for outcomes in ([1.0] * 123 + [0.0] * 77, [0.0, 1.0, 1.0], [0.25, 0.5, 1.0, 0.0, 0.75]):
        assert stats.mean_stderr(outcomes) == pytest.approx(mean_stderr(outcomes), rel=EXACT)


def test_paired_delta_is_the_stderr_of_the_mean_difference():
    # 200 items: the variant loses 6 items dense got right and wins 2 dense got wrong; the rest agree.
    dense = [1.0] * 6 + [0.0] * 2 + [1.0] * 120 + [0.0] * 72
    variant = [0.0] * 6 + [1.0] * 2 + [1.0] * 120 + [0.0] * 72
    delta, stderr = stats.paired_delta(variant, dense)
    assert delta == pytest.approx(-4 / 200, rel=EXACT)
    # differences: six -1, two +1, 192 zeros -> sample variance = (sum d^2 - n mean^2) / (n - 1)
    variance = (8 - 200 * (4 / 200) ** 2) / 199
    assert stderr == pytest.approx(math.sqrt(variance / 200), rel=EXACT)
    # pairing is much tighter than two independent stderrs (~3.4 points each): here about 1.4 points
    assert stderr < 0.5 * stats.mean_stderr(dense)
    low, high = stats.normal_interval(delta, stderr)
    assert low == pytest.approx(delta - 1.959963984540054 * stderr, rel=EXACT) and high > 0  # interval holds 0
    assert not stats.excludes_zero(low, high)
    assert stats.paired_delta(dense, dense) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same items"):
        stats.paired_delta(dense, dense[:-1])


def test_wilson_interval_matches_its_formula_and_the_edges():
    low, high = stats.wilson_interval(9, 10)
    # Wilson (1927) for 9/10 at z = 1.96: the textbook values 0.5958 and 0.9821
    assert low == pytest.approx(0.59585, abs=5e-5) and high == pytest.approx(0.98212, abs=5e-5)
    low, high = stats.wilson_interval(0, 20)
    assert low == 0.0 and high == pytest.approx(0.16113, abs=5e-5)  # 0 of 20 is not "exactly 0"
    low, high = stats.wilson_interval(20, 20)
    assert high == 1.0 and low == pytest.approx(1 - 0.16113, abs=5e-5)


def test_perplexity_bootstrap_is_seeded_and_brackets_the_value():
    nll = [2.9 * 1023, 3.3 * 1023, 3.1 * 1023, 3.0 * 1023, 3.4 * 1023, 3.2 * 1023]
    tokens = [1023.0] * 6
    value = stats.perplexity_of(nll, tokens)
    assert value == pytest.approx(math.exp(3.15), rel=EXACT)
    low, high, spread = stats.bootstrap_perplexity(nll, tokens)
    assert (low, high, spread) == stats.bootstrap_perplexity(nll, tokens)  # fixed seed: same interval every run
    assert min(math.exp(x / 1023) for x in nll) < low < value < high < max(math.exp(x / 1023) for x in nll)
    assert spread > 0
    # paired: a variant 5% worse on every window has a delta interval strictly above 0
    worse = [x + 1023 * math.log(1.05) for x in nll]
    low, high, _ = stats.paired_bootstrap_perplexity(worse, nll, tokens)
    assert 0 < low <= 0.05 * math.exp(3.15) * 1.0001 and stats.excludes_zero(low, high)
    assert stats.paired_bootstrap_perplexity(nll, nll, tokens) == (0.0, 0.0, 0.0)


def test_summaries_carry_lm_eval_names_and_paired_deltas():
    dense = TaskOutcome({"acc": MeanMetric([1.0, 1.0, 0.0, 1.0]), "ppl": PerplexityMetric([4.0, 6.0], [2.0, 2.0]),
                         "kl": 0.5})
    variant = TaskOutcome({"acc": MeanMetric([1.0, 0.0, 0.0, 1.0]), "ppl": PerplexityMetric([5.0, 7.0], [2.0, 2.0]),
                           "kl": 0.75})
    entries = summarize_against(variant, dense)
    assert entries["n"] == 4
    assert entries["acc"] == 0.5 and entries["acc_stderr"] == pytest.approx(math.sqrt(0.25 / 3), rel=EXACT)
    assert entries["acc_delta"] == -0.25
    assert entries["acc_delta_stderr"] == pytest.approx(0.25, rel=EXACT)  # differences 0, -1, 0, 0: sd 0.5, / 2
    assert entries["acc_delta_ci95_low"] == -0.25 - 1.959963984540054 * 0.25
    assert entries["ppl"] == pytest.approx(math.exp(3.0), rel=EXACT)
    assert entries["ppl_delta"] == pytest.approx(math.exp(3.0) - math.exp(2.5), rel=EXACT)
    assert entries["ppl_delta_ci95_low"] > 0  # worse on both windows
    assert entries["kl_delta"] == 0.25 and "kl_stderr" not in entries  # a plain value: a bare delta
    assert [name for name in entries if is_primary(name)] == ["acc", "ppl", "kl"]
    assert set(summarize(dense)) == {"acc", "acc_stderr", "ppl", "ppl_stderr", "ppl_ci95_low", "ppl_ci95_high",
                                     "kl", "n"}
