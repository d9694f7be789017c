"""Conversion's memory plan on the real SmolLM2: the student holds the teacher's frozen weights themselves (one copy),
trains exactly its converted layers and LoRA adapters, leaves the teacher (and a caller's model) unchanged through
the LoRA merge, and computes stage 2's loss chunk by chunk with the value and gradient of the whole-vocabulary one."""
from __future__ import annotations

import functools

import pytest
import torch

from retrofit.convert.build import to_hybrid
from retrofit.convert.distill import Distiller
from retrofit.convert.objectives import (DecoderInputCapture, StudentTail, distillation_loss, kl_loss,
                                         lora_target_names, next_token_targets, output_logits)
from retrofit.convert.plan import DistillConfig
from retrofit.hybrid import HybridSection

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LAYERS = [13, 22]
LORA_RANK = 4


def _base_name(name: str) -> str:
    """A student parameter's name -> the dense model's name of the tensor it wraps (peft's prefixes removed)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_student_holds_the_teachers_frozen_tensors_and_trains_only_its_own(smollm2, tmp_path):
    dense, _ = smollm2
    before = {name: tensor.clone() for name, tensor in dense.state_dict().items()}
    dense_tensors = dense.state_dict()
    section = HybridSection(layers=LAYERS, layer_type="gdn", base_model_type=dense.config.model_type)
    hybrid = to_hybrid(dense, section, share_weights=True, layer_dtype=torch.float32)
    config = DistillConfig(tokens=2 * 4 * 16, seq_len=16, batch_size=4, stage1_fraction=0.5, lora_rank=LORA_RANK,
                           lora_alpha=8, checkpoint_every=0, seed=1)
    windows = torch.randint(dense.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    seen = {}

    def inspect(stage, step):
        if stage == 2 and step == 0:  # LoRA is in place: the student as it trains
            seen["params"] = {name: (p.data_ptr(), p.requires_grad, p.numel(), p.dtype)
                              for name, p in hybrid.named_parameters()}
            seen["dense_modules"] = {type(m).__name__ for m in dense.modules()}

    distiller = Distiller(dense, hybrid, LAYERS, config, windows, tmp_path, {"test": True}, torch.device("cpu"),
                          show_progress=False, on_step=inspect)
    merged = distiller.run()

    converted = {name for name, _ in hybrid.named_parameters()
                 if any(f"model.layers.{i}.self_attn." in name and "lora_" not in name for i in LAYERS)}
    trained = {name for name, (_, grad, _, _) in seen["params"].items() if grad}
    frozen = {name for name in seen["params"] if name not in trained}
    # every frozen tensor of the student is the teacher's own storage (no copy), and only those are frozen
    assert frozen and all(seen["params"][name][0] == dense_tensors[_base_name(name)].data_ptr() for name in frozen)
    assert not any(f"layers.{i}.self_attn." in name for name in frozen for i in LAYERS)
    # what trains is exactly the converted layers and the adapters of the LoRA targets, in float32
    targets = lora_target_names(dense, LAYERS, ["attention", "mlp"])
    adapters = {f"{t}.lora_{ab}.default.weight" for t in targets for ab in "AB"}
    assert trained == converted | adapters
    layer_params = sum(p.numel() for i in LAYERS for p in merged.model.layers[i].self_attn.parameters())
    lora_params = sum(LORA_RANK * (m.in_features + m.out_features) for m in map(dense.get_submodule, targets))
    assert sum(seen["params"][name][2] for name in trained) == layer_params + lora_params
    assert {seen["params"][name][3] for name in trained} == {torch.float32}
    # the teacher never held LoRA: peft wrapped the student's own modules
    assert not any("lora" in kind.lower() for kind in seen["dense_modules"])
    # the merge wrote into the student's own copies: the teacher's weights are bit for bit as before
    after = dense.state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)
    adapted = merged.model.layers[14].mlp.up_proj.weight
    assert adapted.data_ptr() != dense.model.layers[14].mlp.up_proj.weight.data_ptr()
    assert not torch.equal(adapted, before["model.layers.14.mlp.up_proj.weight"])  # LoRA merged there
    assert merged.model.layers[12].mlp.up_proj.weight.data_ptr() == dense.model.layers[12].mlp.up_proj.weight.data_ptr()


@pytest.fixture(scope="module")
def hidden_pair(smollm2, calib_data_dir):
    """Final hidden states ``[2, 96, 576]`` of the dense model (teacher) and of a hybrid with layer 22 converted
    (student, differentiable), on a real calibration window, with the hybrid and the token ids."""
    from retrofit.convert.data import token_windows

    dense, tokenizer = smollm2
    ids = token_windows(tokenizer, [str(calib_data_dir / "walden.txt")], 2, 96, show_progress=False)
    hybrid = to_hybrid(dense, HybridSection(layers=[22], layer_type="gdn", base_model_type="llama"))
    capture = DecoderInputCapture(dense, 22)
    try:
        with torch.no_grad():
            teacher = dense.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        capture.remove()
    with torch.no_grad():
        student = StudentTail(hybrid, 22).final_hidden(capture.record["hidden_states"], capture.record["kwargs"])
    return student, teacher, hybrid, ids


@pytest.mark.parametrize("temperature", [1.0, 2.0], ids=["T=1", "T=2"])
@pytest.mark.parametrize("ce_weight", [0.0, 0.5], ids=["kl", "kl+ce"])
def test_chunked_loss_equals_the_whole_vocabulary_loss(smollm2, hidden_pair, temperature, ce_weight):
    dense, _ = smollm2
    student, teacher, hybrid, ids = hidden_pair
    whole_input = student.clone().requires_grad_(True)
    logits = output_logits(hybrid, whole_input)
    expected = kl_loss(logits, output_logits(dense, teacher), temperature)
    if ce_weight:
        expected = expected + ce_weight * torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    expected.backward()
    chunked_input = student.clone().requires_grad_(True)
    # 192 positions in chunks of 50: three full chunks and a ragged one of 42
    loss = distillation_loss(chunked_input, teacher, functools.partial(output_logits, hybrid),
                             functools.partial(output_logits, dense), temperature,
                             next_token_targets(ids) if ce_weight else None, ce_weight, rows=50)
    loss.backward()
    # float32 throughout; the two differ only in the order of their sums (over 192 x 49,152 terms, chunk by chunk or
    # at once): seen <= 8.4e-8 relative on the loss (about float32's epsilon) and bit-equal gradients (a position's
    # gradient reads its own row only); the bar is 1e-6. A wrong scale or a lost chunk moves both by >= 1e-1
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())
    grad, reference = chunked_input.grad, whole_input.grad
    relative_rms = ((grad - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item()
    assert relative_rms < 1e-6
    assert expected.item() > 1e-3  # the student differs from the teacher: the comparison is not 0 == 0
