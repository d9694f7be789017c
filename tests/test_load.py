"""retrofit.load on the real reference model: GGUF equivalence, alias cache, and one-line errors for bad input."""
from __future__ import annotations

import copy

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, BertConfig

import retrofit
from retrofit._entry import cli_module
from retrofit.errors import RetrofitError
from retrofit.load import reference_gguf

PROMPT = "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published"


@pytest.fixture(scope="module")
def gguf_path():
    return reference_gguf("smollm2-135m")


def test_gguf_load_matches_transformers(gguf_path, smollm2, monkeypatch):
    import gguf

    readers = []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            readers.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    model, tokenizer = retrofit.load(gguf_path, dtype="float32")
    ours_read = len(readers)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
    # transformers' own load parses the file for the config and again for the weights; retrofit.load, which reads the
    # tokenizer from it as well, shares one parse between all three (retrofit/gguf_files.py) and leaves gguf-py as it
    # found it
    assert ours_read == 1 and len(readers) - ours_read >= 2
    assert gguf.GGUFReader is CountedReader
    # sharing the parse changes no weight: the very bits transformers' own load gives
    theirs_state = reference.state_dict()
    assert all(torch.equal(value, theirs_state[name]) for name, value in model.state_dict().items())
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > 10
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
        cached = smollm2[0](ids).logits  # the alias loads the float32 safetensors cache made from the same file
    # Same file, same dequantization, same float32 math: the bound is 1e-5.
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (cached - theirs).abs().max().item() < 1e-5
    assert theirs.abs().max().item() > 1.0  # real logits, not an empty forward


def _write_gguf(path, name: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_a_gguf_file_is_parsed_once_inside_the_block_and_again_when_it_changes(tmp_path):
    import gguf

    from retrofit.gguf_files import parsed_once

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "first")
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with parsed_once():
        first = gguf.GGUFReader(path)
        with parsed_once():  # a nested load shares the outer block's parses
            assert gguf.GGUFReader(str(path)) is first
        assert gguf.GGUFReader(path) is first  # the inner block's end keeps the outer one's memo
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        _write_gguf(path, "second, rewritten")  # another size: read again, not the stale parse
        second = gguf.GGUFReader(path)
        assert second is not first
        assert bytes(second.fields["general.name"].parts[-1]).decode() == "second, rewritten"
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)  # outside the block: a parse per call, as before


def test_alias_is_the_reference_model(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.hidden_size == 576 and config.max_position_embeddings == 8192
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_tokenizer_without_pad_token_pads_with_eos(smollm2):
    # transformers 5.17 reads SmolLM2's GGUF tokenizer without a pad token (5.24 has one): batches must still pad
    from retrofit.load import _ensure_pad_token

    tokenizer = copy.deepcopy(smollm2[1])
    tokenizer.pad_token = None
    _ensure_pad_token(tokenizer)
    assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.pad_token_id == tokenizer.eos_token_id
    batch = tokenizer(["a", "a longer prompt"], padding=True, return_tensors="pt")
    assert batch.input_ids.shape[0] == 2 and int(batch.attention_mask[0].sum()) < batch.input_ids.shape[1]


def test_dtype_and_device_are_applied():
    model, _ = retrofit.load("smollm2-135m", dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training


def _run(*args):
    return CliRunner().invoke(cli_module().main, list(args))


def _assert_one_line_error(result, fragment):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.strip().splitlines() if line]
    assert len(lines) == 1, result.output
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_missing_path(tmp_path):
    _assert_one_line_error(_run("inspect", str(tmp_path / "nowhere")), "no such file or directory")
    _assert_one_line_error(_run("inspect", str(tmp_path / "model.gguf")), "no such GGUF file")


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    _assert_one_line_error(_run("inspect", str(tmp_path)), "is not a model directory")


def test_model_that_is_not_a_causal_lm(tmp_path):
    # A BERT masked-LM checkpoint's config: transformers has a causal head for BERT, but this model is not one.
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               architectures=["BertForMaskedLM"]).save_pretrained(tmp_path)
    _assert_one_line_error(_run("inspect", str(tmp_path)), "is not a causal language model")


def test_unknown_dtype():
    _assert_one_line_error(_run("inspect", "smollm2-135m", "--dtype", "float13"), "unknown dtype 'float13'")


def test_offline_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # CI has no hub either way; offline mode makes the failure immediate
    _assert_one_line_error(_run("inspect", "HuggingFaceTB/SmolLM2-135M-Instruct-does-not-exist"),
                           "could not fetch 'HuggingFaceTB/SmolLM2-135M-Instruct-does-not-exist'")


def test_library_raises_retrofit_error(tmp_path):
    with pytest.raises(RetrofitError, match="unknown device"):
        retrofit.load("smollm2-135m", device="tpu:7")


def test_inspect_reports_layout():
    result = _run("inspect", "smollm2-135m")
    assert result.exit_code == 0, result.output
    assert "9 query, 3 key-value" in result.output
    # 30 layers x 2 (K and V) x 3 kv heads x 64 dims x 4 bytes
    assert f"{30 * 2 * 3 * 64 * 4:,} bytes per token" in result.output
    assert "  0-29  full_attention" in result.output and "30 layer(s) whose cache grows" in result.output


def test_generate_chat_answers_paris():
    result = CliRunner().invoke(cli_module().main, ["generate", "smollm2-135m", "--chat", "--prompt",
                                                    "What is the capital of France?", "--max-new-tokens", "24",
                                                    "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output
    assert "tokens/s" in result.output


def test_parallel_first_use_converts_once(gguf_path, tmp_path):
    """Three processes asking for the alias on an empty cache at once (parallel evaluations on a fresh GPU machine
    once failed to load the tokenizer): all get a loadable checkpoint, and the GGUF is converted exactly once."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    (cache / "smollm2-135m").mkdir(parents=True)
    os.symlink(gguf_path, cache / "smollm2-135m" / gguf_path.name)
    script = ("from transformers import AutoTokenizer; from retrofit.load import reference_checkpoint; "
              "path = reference_checkpoint('smollm2-135m'); print(len(AutoTokenizer.from_pretrained(path)))")
    env = {**os.environ, "RETROFIT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [proc.communicate(timeout=300) + (proc.returncode,) for proc in procs]
    assert [code for _, _, code in results] == [0, 0, 0], [err[-500:] for _, err, _ in results]
    assert {out.strip() for out, _, _ in results} == {"49152"}
    assert sum("converting" in err for _, err, _ in results) == 1
