"""The architecture records (retrofit.architecture) against what transformers really computes, for every family.

Each zoo row (tests/architecture_zoo.py: a tiny random model of the family, random biases) runs one forward pass
with an attention function that records what every softmax layer receives. The record of the family must agree:
per layer the sliding window, softcap and scaling transformers passes; the biases of the modules; q, k and v split
from the projection weights as the record says equal the query, key and value the attention receives at position 0
(where rotation is the identity), after the family's q/k norm; at position 1 exactly the channels past the record's
rotary dims are unrotated; and the record's logits (LM head, multiplier, final softcap) equal the model's.

Tolerances: q, k, v recomputed from the split weights in float32 differ from the module's own GEMM only by the
summation order, ~1e-7 relative; 1e-5 bounds that with room. A wrong row block, head order or missing bias is of
order 1.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

import architecture_zoo as zoo
import retrofit.architecture as architecture
from retrofit.architecture.table import support_table
from retrofit.attention_functions import attention_function, dense_attention, implementation_of
from retrofit.errors import RetrofitError
from retrofit.model_info import attention_layout

TOL = 1e-5


def _record_attention_calls(model, input_ids):
    """Run ``model`` on ``input_ids [1, T]``; -> (calls: layer -> dict of what its attention received,
    inputs: layer -> the attention module's hidden_states input, final: the final norm's output)."""
    arch = architecture.of(model)
    implementation = implementation_of(model)
    calls, inputs, final = {}, {}, {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls[module.layer_idx] = dict(query=query.detach(), key=key.detach(), value=value.detach(), **{
            name: kwargs.get(name) for name in ("sliding_window", "softcap", "scaling")})
        return dense_attention(implementation, module, query, key, value, attention_mask, **kwargs)

    handles = []
    for index, block in enumerate(arch.blocks(model)):
        def keep_input(module, args, kwargs, index=index):
            inputs[index] = (args[0] if args else kwargs["hidden_states"]).detach()
        handles.append(arch.attention_of(block).register_forward_pre_hook(keep_input, with_kwargs=True))
    handles.append(arch.final_norm_of(model).register_forward_hook(
        lambda module, args, output: final.setdefault("hidden", output.detach())))
    try:
        with torch.no_grad(), attention_function(model, recording, "probe") if attention_layout(model).interfaced \
                else contextlib.nullcontext():
            logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    return calls, inputs, final["hidden"], logits


@pytest.fixture(scope="module", params=[row.name for row in zoo.ROWS])
def probed(request, one_cpu_thread):
    model = zoo.build(request.param)
    input_ids = torch.tensor([[5, 17, 42, 99]])
    return model, architecture.of(model), _record_attention_calls(model, input_ids)


def _interfaced_or_refused(model) -> bool:
    """Whether the family's attention runs through transformers' attention interface in this transformers release;
    where it does not (Falcon in 5.17), retrofit's attention hooks must refuse it in one line."""
    if attention_layout(model).interfaced:
        return True
    with pytest.raises(RetrofitError, match="outside transformers' attention interface") as err:
        with attention_function(model, lambda *args, **kwargs: None, "probe"):
            pass
    assert "\n" not in str(err.value)
    return False


def test_every_layer_is_described_as_transformers_runs_it(probed):
    model, arch, (calls, _, _, _) = probed
    if not _interfaced_or_refused(model):
        return
    layers = arch.layers(model.config)
    assert len(layers) == len(arch.blocks(model)) == model.config.num_hidden_layers
    for layer in layers:
        assert arch.attention_module(model, layer.index).layer_idx == layer.index
        seen = calls[layer.index]
        assert (seen["sliding_window"] or None) == layer.window, layer
        assert seen["softcap"] == layer.softcap, layer
        assert math.isclose(seen["scaling"], layer.scaling, rel_tol=1e-12), layer


def _heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[T, heads * head_dim] -> [heads, T, head_dim], as attention functions receive them."""
    return x.view(x.shape[0], heads, head_dim).transpose(0, 1)


def _projected(weight, x):
    out = x @ weight.weight.T
    return out if weight.bias is None else out + weight.bias


def test_split_projections_are_what_attention_receives(probed):
    model, arch, (calls, inputs, _, _) = probed
    if not _interfaced_or_refused(model):
        return
    config = model.config
    heads, kv_heads, head_dim = arch.num_heads(config), arch.num_kv_heads(config), arch.head_dim(config)
    qkv_bias, o_bias = arch.biases(config)
    for layer in arch.layers(config):
        attention = arch.attention_module(model, layer.index)
        parts = arch.projections(attention, config)
        assert (parts.q.bias is not None, parts.o.bias is not None) == (qkv_bias, o_bias)
        x = inputs[layer.index][0]  # [T, hidden]
        with torch.no_grad():
            q, k, v = (_projected(part, x) for part in (parts.q, parts.k, parts.v))
            norm = arch.qk_norm_of(config)
            if norm is not None and norm.per == "projection":
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k, v = _heads(q, heads, head_dim), _heads(k, kv_heads, head_dim), _heads(v, kv_heads, head_dim)
            if norm is not None and norm.per == "head":
                q, k = attention.q_norm(q), attention.k_norm(k)
        seen = calls[layer.index]
        got_q, got_k, got_v = seen["query"][0], seen["key"][0], seen["value"][0]
        assert torch.allclose(got_v, v, rtol=TOL, atol=TOL)
        for got, want in ((got_q, q), (got_k, k)):
            assert torch.allclose(got[:, 0], want[:, 0], rtol=TOL, atol=TOL)  # position 0: rotation is the identity
            rotated = layer.rotary_dims
            assert torch.allclose(got[:, 1, rotated:], want[:, 1, rotated:], rtol=TOL, atol=TOL)
            if rotated:
                assert not torch.allclose(got[:, 1, :rotated], want[:, 1, :rotated], rtol=1e-3, atol=1e-4)


def test_record_logits_are_the_models(probed):
    model, arch, (_, _, final_hidden, logits) = probed
    with torch.no_grad():
        assert torch.allclose(arch.logits(model, final_hidden), logits, rtol=TOL, atol=TOL)


def test_an_undescribed_family_is_refused_in_one_line():
    from transformers import BertConfig

    with pytest.raises(RetrofitError) as err:
        architecture.of(BertConfig())
    assert "'bert' has no architecture record" in str(err.value) and "\n" not in str(err.value)


def test_every_record_has_a_zoo_row_and_every_row_a_record():
    """A family added to the records is contract-tested the day it is added (and the zoo tests nothing else)."""
    zoo_families = {row.model_type for row in zoo.ROWS + zoo.HYBRID_ROWS}
    assert zoo_families == set(architecture.ARCHITECTURES.names())
    assert len({row.model_type for row in zoo.ROWS}) == 21


def test_readme_table_is_the_one_the_records_make():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = readme.index("<!-- architectures -->\n"), readme.index("<!-- /architectures -->")
    assert readme[start + len("<!-- architectures -->\n"):end].strip() == support_table()
