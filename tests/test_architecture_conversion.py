"""Conversion on every family of the zoo (tests/architecture_zoo.py): the real pipeline (``retrofit.convert`` on a
preloaded tiny random model, SmolLM2's tokenizer, the calibration books) converts layers 0 and 2 to GDN and to KDA
in a few steps, saves the hybrid, and ``AutoModelForCausalLM`` loads it back (after ``import retrofit``); the
reloaded hybrid's greedy tokens through ``retrofit.generate`` equal its own ``model.generate`` (ragged batch of two,
100-token prompts), and Quest runs on its remaining softmax layers. What cannot be converted is refused in one line
with exit code 2, before any weight is loaded. A converted Qwen2 layer starts from the dense layer's q/k/v biases.

The conversion is a pipeline check (512 tokens, 64-token windows): it trains, but says nothing of quality.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import architecture_zoo as zoo
import retrofit
from _cli_runner import assert_one_line_error, run
from retrofit import architecture
from retrofit.convert.build import to_hybrid
from retrofit.convert.pipeline import convert
from retrofit.hybrid import HybridSection, register
from retrofit.sparse import SparseLayer, sparse_decoding

TINY = dict(tokens=512, seq_len=64, batch_size=2, stage1_fraction=0.5, checkpoint_every=0)
CONVERTED = [0, 2]
FAMILY_ROWS = list(dict.fromkeys(row.model_type for row in zoo.ROWS))  # the first row of each family
FAMILY_ROWS = [next(row.name for row in zoo.ROWS if row.model_type == family) for family in FAMILY_ROWS]


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, zoo.VOCAB, (2, 100), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    ids[1, :37] = 0
    return ids, mask


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("name", FAMILY_ROWS)
def test_convert_save_reload_generate(name, kind, smollm2, calib_data_dir, tmp_path, one_cpu_thread):
    _, tokenizer = smollm2
    out = tmp_path / "hybrid"
    convert((zoo.build(name), tokenizer), to=kind, layers=",".join(map(str, CONVERTED)), data=[str(calib_data_dir)],
            out=out, recipe="smollm2-135m/cpu-small", show_progress=False, **TINY)
    section = json.loads((out / "config.json").read_text())["retrofit"]
    assert section["layers"] == CONVERTED and section["layer_type"] == kind
    register()
    config = zoo.BY_NAME[name].config()
    hybrid = AutoModelForCausalLM.from_pretrained(out, attn_implementation=zoo.implementation(config)).eval()
    arch = architecture.of(hybrid)
    assert [getattr(arch.attention_module(hybrid, i), "retrofit_layer_type", None) for i in CONVERTED] == [kind] * 2
    ids, mask = prompts()
    if not zoo.refused_unless_interfaced(hybrid, lambda: retrofit.generate(hybrid, ids, mask, max_new_tokens=8)):
        return
    with torch.no_grad():
        expected = hybrid.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(retrofit.generate(hybrid, ids, mask, max_new_tokens=8, eos_token_id=[]), expected), name
    with sparse_decoding(hybrid, method="quest", budget=16, page_size=8, dense_layers=()) as session:
        retrofit.generate(hybrid, ids, mask, max_new_tokens=8, eos_token_id=[])
        patched = [i for i, layer in enumerate(session.cache.layers) if isinstance(layer, SparseLayer)]
    assert patched and not set(patched) & set(CONVERTED)


def test_a_converted_qwen2_layer_starts_from_the_dense_biases():
    dense = zoo.build("qwen2")
    hybrid = to_hybrid(dense, HybridSection(layers=[1], layer_type="gdn", base_model_type="qwen2"))
    converted, attention = hybrid.model.layers[1].self_attn, dense.model.layers[1].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(attention, name).bias.abs().min() > 0  # the zoo's random biases: dropping one shows
        assert torch.equal(getattr(converted, name).bias, getattr(attention, name).bias), name
    assert converted.o_proj.bias is None  # Qwen2 has none on o


def test_fused_projections_are_split_as_the_family_lays_them_out():
    """Falcon's grouped layout: the converted layer's q, k, v rows are the dense projection's rows of each group."""
    dense = zoo.build("falcon")
    hybrid = to_hybrid(dense, HybridSection(layers=[0], layer_type="gdn", base_model_type="falcon"))
    fused, layer = dense.transformer.h[0].self_attention.query_key_value, hybrid.transformer.h[0].self_attention
    grouped = fused.weight.view(2, 4, 16, 64)  # 2 kv groups of (2 queries, key, value) x head_dim 16
    assert torch.equal(layer.q_proj.weight, grouped[:, :2].reshape(-1, 64))
    assert torch.equal(layer.k_proj.weight, grouped[:, 2].reshape(-1, 64))
    assert torch.equal(layer.v_proj.weight, grouped[:, 3].reshape(-1, 64))


@pytest.mark.parametrize("case", ["cohere-qk-norm", "qwen3_next", "undescribed"])
def test_what_cannot_be_converted_is_refused_in_one_line(case, calib_data_dir, tmp_path, monkeypatch):
    if case == "cohere-qk-norm":
        config = zoo.BY_NAME["cohere"].config()
        config.use_qk_norm = True
        expected = "use_qk_norm"
    elif case == "qwen3_next":
        config = zoo.BY_NAME["qwen3_next"].config()
        expected = "already a hybrid"
    else:
        from transformers import PhiConfig

        config = PhiConfig(vocab_size=zoo.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4)
        expected = "'phi' has no architecture record"
    model_dir = tmp_path / case
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    result = run("convert", str(model_dir), "--to", "gdn", "--layers", "0", "--data", str(calib_data_dir),
                 "--out", str(tmp_path / "out"), "--tokens", "512", "--no-report")
    assert_one_line_error(result, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "cohere2", "mistral-window64", "llama"])
def test_layers_sliding_names_the_sliding_window_layers(name):
    from retrofit.convert.selection import parse_layer_spec, sliding_layers_of
    from retrofit.errors import RetrofitError
    from retrofit.model_info import attention_layout

    config = zoo.BY_NAME[name].config()
    expected = attention_layout(zoo.build(name)).sliding_layers  # the layers the model runs with a window
    if not expected:
        with pytest.raises(RetrofitError, match="no sliding-window attention layers"):
            parse_layer_spec("sliding", config.num_hidden_layers, sliding_layers_of(config))
        return
    if len(expected) == config.num_hidden_layers:  # Mistral: every layer slides, and one must stay softmax
        with pytest.raises(RetrofitError, match="keep at least one softmax"):
            parse_layer_spec("sliding", config.num_hidden_layers, sliding_layers_of(config))
        return
    assert list(parse_layer_spec("sliding", config.num_hidden_layers, sliding_layers_of(config)).indices) == expected
    complement = parse_layer_spec("not:sliding", config.num_hidden_layers, sliding_layers_of(config)).indices
    assert sorted(set(complement) | set(expected)) == list(range(config.num_hidden_layers))
