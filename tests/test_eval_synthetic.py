"""RULER-style synthetic tasks: deterministic generation, prompts that fit the window, answers in the prompt,
scorers on hand-made outputs, and LEFT-padded batched generation equal to one-at-a-time generation."""
from __future__ import annotations

import pytest

from retrofit.errors import RetrofitError
from retrofit.eval.generation import greedy_generate
from retrofit.eval.synthetic import (ITEMS_PER_SEED, NOISE, SYNTHETIC_TASKS, Haystack, SyntheticItem, generate_items,
                                     insert_at_depths, item_scores, score_outputs, seed_spread, sweep_slot)

TASK_NAMES = SYNTHETIC_TASKS.names()


def test_registry_has_the_ruler_tasks():
    assert set(TASK_NAMES) == {"niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe", "fwe", "passkey"}


@pytest.mark.parametrize("task", TASK_NAMES)
@pytest.mark.parametrize("length", [1024, 3000])
def test_prompt_fits_requested_context(smollm2, task, length):
    _, tokenizer = smollm2
    items = generate_items(task, tokenizer, length, seeds=[0], num_items=3)
    for item in items:
        # the prompt plus the tokens to generate fit the window, and the haystack fills at least 90% of it
        assert 0.9 * length <= len(item.prompt_ids) <= length - item.max_new_tokens
        prompt = tokenizer.decode(list(item.prompt_ids))
        for answer in item.answers:
            assert answer in prompt, f"{task}: answer {answer!r} missing from the prompt"
        assert prompt.startswith("<|im_start|>")  # SmolLM2 has a chat template: prompts go through it


@pytest.mark.parametrize("task", TASK_NAMES)
def test_generation_is_deterministic_per_seed(smollm2, task):
    _, tokenizer = smollm2
    first = generate_items(task, tokenizer, 1024, seeds=[7], num_items=2)
    again = generate_items(task, tokenizer, 1024, seeds=[7], num_items=2)
    other = generate_items(task, tokenizer, 1024, seeds=[8], num_items=2)
    assert first == again
    assert [i.answers for i in first] != [i.answers for i in other]
    assert first[0].answers != first[1].answers  # items within a seed differ too


def test_needle_depth_follows_the_sweep_order(smollm2):
    """The first items of a seed spread over the haystack: depth 0, 1, 9/19, 14/19, 4/19."""
    _, tokenizer = smollm2
    items = generate_items("passkey", tokenizer, 2048, seeds=[0], num_items=5)
    offsets = []
    for item in items:
        text = tokenizer.decode(list(item.prompt_ids))
        offsets.append(text.index(f"The pass key is {item.answers[0]}") / len(text))
    assert [item.index for item in items] == [0, 19, 9, 14, 4]
    # the needle's place in the whole prompt, whose instructions and question add a few percent around the haystack
    assert offsets == pytest.approx([0, 1, 9 / 19, 14 / 19, 4 / 19], abs=0.05)


def test_fewer_items_are_the_first_items_of_more():
    """Any count of items per seed starts with the same items: `--limit N` takes the first N of the task."""
    assert [sweep_slot(position) for position in range(3)] == [(0, 0.0), (19, 1.0), (9, 9 / 19)]
    one_sweep = sorted(sweep_slot(position) for position in range(ITEMS_PER_SEED))
    assert one_sweep == [(index, index / 19) for index in range(20)]  # 20 items: every depth i/19 once
    assert sweep_slot(20) == (20, 0.0) and sweep_slot(21) == (39, 1.0)  # the next sweep: new items, same depths


def test_the_first_items_of_a_run_are_a_longer_runs_first_items(smollm2):
    _, tokenizer = smollm2
    short = generate_items("niah_single", tokenizer, 512, seeds=[0, 1], num_items=2)
    long = generate_items("niah_single", tokenizer, 512, seeds=[0, 1], num_items=5)
    assert short == long[:2] + long[5:7]  # seed by seed


def test_haystack_file_replaces_noise(smollm2, eval_data_dir):
    _, tokenizer = smollm2
    haystack = Haystack(eval_data_dir / "moby_dick_body.txt")
    items = generate_items("niah_single", tokenizer, 1024, seeds=[0], num_items=2, haystack=haystack)
    text = tokenizer.decode(list(items[0].prompt_ids))
    assert NOISE not in text
    assert any(word in text for word in ("whale", "sea", "ship", "Ahab", "I"))
    assert 0.9 * 1024 <= len(items[0].prompt_ids) <= 1024
    with pytest.raises(RetrofitError, match="not found"):
        Haystack(eval_data_dir / "no_such_haystack.txt")


def test_too_short_context_is_a_user_error(smollm2):
    _, tokenizer = smollm2
    with pytest.raises(RetrofitError, match="too short for cwe"):
        generate_items("cwe", tokenizer, 64, seeds=[0], num_items=1)


def test_insert_at_depths_places_needles_by_fraction():
    units = ["a.", "b.", "c.", "d."]
    assert insert_at_depths(units, [(0.0, "X.")]) == "X. a. b. c. d."
    assert insert_at_depths(units, [(1.0, "X.")]) == "a. b. c. d. X."
    assert insert_at_depths(units, [(0.5, "X."), (0.25, "Y.")]) == "a. Y. b. X. c. d."


def _item(task: str, answers: tuple[str, ...]) -> SyntheticItem:
    return SyntheticItem(task, 1024, 0, 0, (1, 2, 3), answers, 8)


def test_scorers_on_hand_made_outputs():
    single = [_item("niah_single", ("1234567",)), _item("niah_single", ("7654321",))]
    assert score_outputs("niah_single", single, [" 1234567.", " 765432"]) == {"score": 0.5}
    multi = [_item("niah_multivalue", ("111", "222", "333", "444")), _item("niah_multivalue", ("5", "6", "7", "8"))]
    outputs = ["111, 222, 333 and 444", "5 and 6"]
    assert score_outputs("niah_multivalue", multi, outputs) == {"score": 0.5, "partial": 0.75}
    words = [_item("cwe", ("Apple", "pear"))]
    assert score_outputs("cwe", words, ["1. apple 2. PEAR"]) == {"score": 1.0, "partial": 1.0}  # case-insensitive
    keys = [_item("passkey", ("12345",)), _item("passkey", ("12345",)), _item("passkey", ("12345",))]
    # first integer only: "99 ... 12345" is wrong although the key appears later
    assert score_outputs("passkey", keys, [" 12345.", "99 then 12345", "123456"]) == {"score": 1 / 3}
    assert item_scores("passkey", keys, [" 12345.", "99 then 12345", "123456"]) == {"score": [1.0, 0.0, 0.0]}
    assert item_scores("niah_multivalue", multi, outputs) == {"score": [1.0, 0.0], "partial": [1.0, 0.5]}


def test_left_padded_batches_generate_like_single_prompts(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in (
        "The capital of France is",
        "Counting: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen,",
        "The pass key is 48213. Remember it. The grass is green. The sky is blue. What is the pass key? It is")]
    assert len({len(p) for p in prompts}) == 3  # different lengths, so the batch is padded on the left
    single = [greedy_generate(model, tokenizer, [prompt], max_new_tokens=8)[0] for prompt in prompts]
    batched = greedy_generate(model, tokenizer, prompts, max_new_tokens=8, batch_size=3)
    assert batched == single
    assert "48213" in single[2]  # the model reads the key back from a short context


def test_dense_smollm2_reads_the_pass_key_at_1k(smollm2):
    """The whole path (chat template, answer prefix, left-padded batch, greedy decode, first-integer scorer) on
    the real model: design/evaluation.md measured SmolLM2 answering 3 of 4 seeds at ~2,000 tokens, so at 1,024
    at least 3 of 4 depth-swept items must be right (100% was seen here)."""
    model, tokenizer = smollm2
    items = generate_items("passkey", tokenizer, 1024, seeds=[0], num_items=4)
    outputs = greedy_generate(model, tokenizer, [list(item.prompt_ids) for item in items], items[0].max_new_tokens,
                              batch_size=4)
    assert score_outputs("passkey", items, outputs)["score"] >= 0.75, outputs


def test_seed_spread_is_the_sample_sd_of_per_seed_scores():
    items = [SyntheticItem("passkey", 1024, seed, index, (1,), ("42",), 8) for seed in (0, 1) for index in range(2)]
    outputs = ["42", "42", "42", "7"]  # seed 0: 1.0, seed 1: 0.5 -> mean 0.75, sample SD = sqrt(2 * 0.25^2 / 1)
    assert seed_spread("passkey", items, outputs) == pytest.approx(0.5 / 2 ** 0.5)
    assert score_outputs("passkey", items, outputs)["score"] == 0.75
