"""`retrofit generate`: text streamed with retrofit's engine; bad options are one line on stderr and exit code 2,
before the model is loaded where they need no model."""
from __future__ import annotations

import re

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
    assert "tokens/s)]" in result.stderr


SUMMARY = re.compile(r"\[prefill: ([\d,]+) tokens in ([\d.]+) s \(([\d,]+) tokens/s\) \| "
                     r"decode: ([\d,]+) tokens in ([\d.]+) s \(([\d,.]+) tokens/s\)\]")


def test_generate_reads_a_prompt_file_and_reports_prefill_and_decode_apart(smollm2, eval_data_dir, tmp_path):
    """A long prompt from a file gives the text --prompt gives; stderr splits the prompt's prefill from the decode
    steps: the prompt's own token count, the other new tokens, and rates that are those counts over those times."""
    _, tokenizer = smollm2
    words = (eval_data_dir / "wikitext2_test.raw").read_text(encoding="utf-8").split()[:600]
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(words), encoding="utf-8")
    from_file = run("generate", "smollm2-135m", "--prompt-file", str(prompt_file), "--max-new-tokens", "6",
                    "--device", "cpu")
    from_option = run("generate", "smollm2-135m", "--prompt", " ".join(words), "--max-new-tokens", "6",
                      "--device", "cpu")
    assert from_file.exit_code == 0, from_file.output
    assert from_file.stdout == from_option.stdout and from_file.stdout.strip()
    (summary,) = SUMMARY.findall(from_file.stderr)
    prompt_tokens, prefill_s, prefill_rate, decoded, decode_s, decode_rate = (float(x.replace(",", "")) for x in summary)
    assert prompt_tokens == len(tokenizer(" ".join(words)).input_ids) > 500
    assert decoded == 5  # 6 new tokens: the first comes with the prefill (no end token within 6 on this text)
    # each rate is its count over the unrounded time, which lies within 0.005 s of the printed one
    assert prompt_tokens / (prefill_s + 0.005) - 0.5 <= prefill_rate <= prompt_tokens / max(prefill_s - 0.005, 1e-9) + 0.5
    assert decoded / (decode_s + 0.005) - 0.05 <= decode_rate <= decoded / max(decode_s - 0.005, 1e-9) + 0.05


@pytest.mark.parametrize("args, message", [
    ([], "give the text to continue as --prompt TEXT or --prompt-file PATH"),
    (["--prompt", "Hi", "--prompt-file", "README.md"], "give the text to continue as --prompt TEXT or --prompt-file"),
    (["--prompt-file", "no-such-prompt.txt"], "'no-such-prompt.txt' does not exist"),
], ids=["none", "both", "missing-file"])
def test_a_prompt_is_given_one_way(args, message):
    result = run("generate", "smollm2-135m", "--device", "cpu", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr


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
