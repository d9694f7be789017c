"""`retrofit generate`: text streamed with retrofit's engine; bad options are one line on stderr and exit code 2,
before the model is loaded where they need no model."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from retrofit._entry import cli_module


def run(*args: str):
    return CliRunner().invoke(cli_module().main, list(args))


def test_generate_streams_greedy_text(smollm2):
    import torch

    model, tokenizer = smollm2
    result = run("generate", "smollm2-135m", "--prompt", "The capital of France is", "--max-new-tokens", "8",
                 "--device", "cpu")
    assert result.exit_code == 0, result.output
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id)
    assert result.stdout.strip() == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert "tokens/s]" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive number of tokens"),
    (["--max-new-tokens", "9000"], "over the model's limit of 8192 positions"),
    (["--top-p", "0.9"], "--top-p only apply to sampling"),
    (["--seed", "1"], "--seed only apply to sampling"),
    (["--temperature", "0.7", "--top-p", "2"], "top_p=2.0 is invalid"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or above"),
], ids=["no-tokens", "too-long", "top-p-greedy", "seed-greedy", "bad-top-p", "negative-temperature"])
def test_bad_generate_options_are_one_line_errors(args, message):
    result = run("generate", "smollm2-135m", "--prompt", "Hello", "--device", "cpu", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr
