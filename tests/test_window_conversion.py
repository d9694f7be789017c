"""A hybrid whose converted layers hold a softmax window (``layer_spec: window, sink_tokens``), end to end on tiny
random models of four families (tests/architecture_zoo.py: Llama; Gemma 2 with logit softcapping, its own scaling
and sliding-window layers; SmolLM3 with layers that do not rotate; GPT-2 with no rotation and a fused projection),
through the real pipeline with SmolLM2's tokenizer and the calibration books, and every lever of the same recipe on
(block alignment, the weighted stage-2 loss with the hidden-state cosine, norms and whole converted blocks trained);
on Llama also the window alone on the recipe's other settings, the combination the lever recipes convert with.

The hybrid saves and loads back through ``AutoModelForCausalLM`` (after ``import retrofit``) and ``retrofit.load``;
its greedy tokens through ``retrofit.generate`` (a ragged batch of two 100-token prompts, the window 16 tokens, so
most keys are far) equal ``model.generate``'s, also when a second call of the same cache bucket reuses the first
call's cache and rings in place; Quest still runs on its softmax layers. A pipeline check (512 tokens): it trains,
but says nothing of quality.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import architecture_zoo as zoo
import retrofit
from retrofit import architecture
from retrofit.convert.pipeline import convert
from retrofit.generation import kept_generation, release
from retrofit.hybrid import register
from retrofit.sparse import SparseLayer, sparse_decoding

TINY = dict(tokens=512, seq_len=64, batch_size=2, stage1_fraction=0.5, checkpoint_every=0)
WINDOW = dict(layer_spec={"window": 16, "sink_tokens": 2})
LEVERS = dict(WINDOW, stage1_target="block", kl_weight=0.2, ce_weight=0.2, hidden_cosine_weight=0.6,
              lora_targets="attention,mlp,norms", finetune_converted_blocks=True)
CONVERTED = [0, 2]


def prompts(length: int = 100, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, zoo.VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    ids[1, :37] = 0
    return ids, mask


def transformers_tokens(model, ids, mask, new: int = 8) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("name, kind, levers", [("llama", "kda", LEVERS), ("gemma2-softcap5", "gdn", LEVERS),
                                                ("smollm3", "kda", LEVERS), ("gpt2", "gdn", LEVERS),
                                                ("llama", "kda", WINDOW)],  # the window alone: the lever recipes'
                         ids=["llama-kda-levers", "gemma2-gdn-levers", "smollm3-kda-levers", "gpt2-gdn-levers",
                              "llama-kda-window"])
def test_a_windowed_hybrid_saves_reloads_and_generates_alike(name, kind, levers, smollm2, calib_data_dir, tmp_path,
                                                             one_cpu_thread):
    _, tokenizer = smollm2
    out = tmp_path / "hybrid"
    convert((zoo.build(name), tokenizer), to=kind, layers=",".join(map(str, CONVERTED)), data=[str(calib_data_dir)],
            out=out, recipe="smollm2-135m/cpu-small", show_progress=False, **TINY, **levers)
    section = json.loads((out / "config.json").read_text())["retrofit"]
    assert section["layer_spec"]["window"] == 16 and section["layer_spec"]["sink_tokens"] == 2
    assert section["distillation"]["settings"]["stage1_target"] == levers.get("stage1_target", "attention")
    register()
    config = zoo.BY_NAME[name].config()
    hybrid = AutoModelForCausalLM.from_pretrained(out, attn_implementation=zoo.implementation(config)).eval()
    loaded, _ = retrofit.load(str(out), dtype="float32")
    arch = architecture.of(hybrid)
    for i in CONVERTED:
        layer = arch.attention_module(hybrid, i)
        assert (layer.window, layer.sink_tokens) == (16, 2)
        assert torch.equal(layer.far_logit_proj.bias, arch.attention_module(loaded, i).far_logit_proj.bias)
        assert layer.far_logit_proj.bias.abs().max() > 0  # calibrated, then trained: not the reset value
    ids, mask = prompts()
    expected = transformers_tokens(hybrid, ids, mask)
    release(hybrid)
    assert torch.equal(retrofit.generate(hybrid, ids, mask, max_new_tokens=8, eos_token_id=[]), expected), name
    assert torch.equal(transformers_tokens(loaded, ids, mask), expected)
    # another batch of the same cache bucket: the kept cache, its rings rewritten in place by the new prefill
    ring = kept_generation(hybrid).generation.cache.layers[CONVERTED[0]].retrofit_window_ring
    other_ids, other_mask = prompts(90, seed=1)
    again = retrofit.generate(hybrid, other_ids, other_mask, max_new_tokens=8, eos_token_id=[])
    assert kept_generation(hybrid).generation.cache.layers[CONVERTED[0]].retrofit_window_ring is ring
    assert torch.equal(again, transformers_tokens(hybrid, other_ids, other_mask)), name
    with sparse_decoding(hybrid, method="quest", budget=16, page_size=8, dense_layers=()) as session:
        retrofit.generate(hybrid, ids, mask, max_new_tokens=8, eos_token_id=[])
        patched = [i for i, layer in enumerate(session.cache.layers) if isinstance(layer, SparseLayer)]
    assert patched and not set(patched) & set(CONVERTED)
    release(hybrid)
