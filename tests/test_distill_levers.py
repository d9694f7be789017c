"""The distillation levers on the real SmolLM2: stage 1 on whole decoder blocks (``stage1_target: block``), stage 2's
loss as the weighted sum of KL, cross-entropy and the hidden-state cosine (``kl_weight``, ``ce_weight``,
``hidden_cosine_weight``), and what trains with ``lora_targets: ...,norms`` and ``finetune_converted_blocks``."""
from __future__ import annotations

import functools

import pytest
import torch

from retrofit.convert.build import to_hybrid
from retrofit.convert.distill import Distiller
from retrofit.convert.init import match_output_scale
from retrofit.convert.objectives import (BlockAligner, BlockCapture, DecoderInputCapture, StudentTail,
                                         directly_trained_names, distillation_loss, hidden_cosine_loss,
                                         lora_target_names, next_token_targets, output_logits)
from retrofit.convert.plan import DistillConfig
from retrofit.hybrid import HybridSection

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LAYERS = [13, 22]


def windows(smollm2, calib_data_dir, count: int, length: int, seed: int = 0) -> torch.Tensor:
    from retrofit.convert.data import token_windows

    _, tokenizer = smollm2
    return token_windows(tokenizer, [str(calib_data_dir / "walden.txt")], count, length, seed=seed,
                         show_progress=False)


def block_errors(dense, hybrid, ids: torch.Tensor) -> dict[int, float]:
    """Layer -> the converted block's relative error against the dense block on ``ids``, as stage 1 measures it."""
    capture = BlockCapture(dense, LAYERS)
    try:
        records = capture.run(dense, ids)
    finally:
        capture.remove()
    blocks = hybrid.model.layers
    aligner = BlockAligner({i: blocks[i] for i in LAYERS}).eval()
    with torch.no_grad():
        return {i: aligner.layer_loss(i, records).item() for i in LAYERS}


def test_the_captured_block_inputs_reproduce_the_dense_blocks(smollm2, calib_data_dir):
    """Everything a decoder block is called with (hidden states, rotary, masks, positions) is recorded: the dense
    block run again on its record gives the record's output."""
    dense, _ = smollm2
    capture = BlockCapture(dense, LAYERS)
    try:
        records = capture.run(dense, windows(smollm2, calib_data_dir, 2, 48))
    finally:
        capture.remove()
    for i in LAYERS:
        with torch.no_grad():
            again = dense.model.layers[i](records[i]["hidden_states"], **records[i]["kwargs"])
        again = again[0] if isinstance(again, tuple) else again
        assert torch.equal(again, records[i]["target"]), i


def test_stage1_on_blocks_trains_the_converted_attention_only_and_aligns_the_blocks(smollm2, calib_data_dir,
                                                                                      tmp_path):
    dense, _ = smollm2
    hybrid = to_hybrid(dense, HybridSection(layers=LAYERS, layer_type="gdn", base_model_type="llama"),
                       share_weights=True, layer_dtype=torch.float32)
    train, held_out = windows(smollm2, calib_data_dir, 48, 64), windows(smollm2, calib_data_dir, 4, 64, seed=9)
    config = DistillConfig(tokens=40 * 4 * 64, seq_len=64, batch_size=4, stage1_fraction=1.0, stage1_target="block",
                           lr_stage1=3e-3, lora_rank=0, checkpoint_every=0, seed=0)
    match_output_scale({i: hybrid.model.layers[i].self_attn for i in LAYERS}, dense, train[:4])
    before = block_errors(dense, hybrid, held_out)
    mlp = {i: hybrid.model.layers[i].mlp.up_proj.weight.data_ptr() for i in LAYERS}
    distiller = Distiller(dense, hybrid, LAYERS, config, train, tmp_path, {"test": True}, torch.device("cpu"),
                          show_progress=False)
    trained = distiller.run()
    after = block_errors(dense, trained, held_out)
    # 40 steps at 3e-3 on real text: seen 0.465 -> 0.170 (layer 13) and 0.166 -> 0.065 (layer 22) on held-out
    # windows; a loss that did not reach the converted attention (or trained the wrong thing) leaves them there
    assert all(after[i] < 0.8 * before[i] for i in LAYERS), (before, after)
    assert len(distiller.history["stage1"]) == 40 and not distiller.history["stage2"]
    for i in LAYERS:  # the MLP and norms are the dense model's tensors, untouched
        block, dense_block = trained.model.layers[i], dense.model.layers[i]
        assert block.mlp.up_proj.weight.data_ptr() == mlp[i] == dense_block.mlp.up_proj.weight.data_ptr()
        assert torch.equal(block.post_attention_layernorm.weight, dense_block.post_attention_layernorm.weight)


def test_hidden_cosine_is_one_minus_the_mean_cosine():
    torch.manual_seed(0)
    a, b = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    assert hidden_cosine_loss([a, a], [a, a * 3]).item() == pytest.approx(0.0, abs=1e-6)
    assert hidden_cosine_loss([a], [-a]).item() == pytest.approx(2.0, abs=1e-6)
    manual = 1 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    assert hidden_cosine_loss([a, b], [b, b]).item() == pytest.approx(manual.mean().item() / 2, rel=1e-6)


def test_a_stage2_step_optimises_the_weighted_sum_of_kl_ce_and_cosine(smollm2, calib_data_dir, tmp_path):
    """Stage 2's first step (LoRA still the identity, nothing updated yet) reads exactly 0.2 KL + 0.2 CE + 0.6 of
    the hidden-state cosine (Arcee's weights), each computed here the plain way: whole-vocabulary logits, the
    cosine of every block's output from the first converted layer on."""
    dense, _ = smollm2
    hybrid = to_hybrid(dense, HybridSection(layers=LAYERS, layer_type="kda", base_model_type="llama"),
                       share_weights=True, layer_dtype=torch.float32)
    train = windows(smollm2, calib_data_dir, 8, 48)
    config = DistillConfig(tokens=2 * 4 * 48, seq_len=48, batch_size=4, stage1_fraction=0.0, kl_weight=0.2,
                           ce_weight=0.2, hidden_cosine_weight=0.6, lora_rank=4, lora_alpha=8, checkpoint_every=0,
                           seed=3)
    distiller = Distiller(dense, hybrid, LAYERS, config, train, tmp_path, {"test": True}, torch.device("cpu"),
                          show_progress=False)
    batch = distiller._batch(2, 0, 0)
    match_output_scale(distiller.converted_layers(), dense, train[:4])  # what run() does first (idempotent)
    with torch.no_grad():
        logits = dense(input_ids=batch, use_cache=False).logits
        teacher_capture = DecoderInputCapture(dense, LAYERS[0])
        outputs = []
        handles = [dense.model.layers[i].register_forward_hook(lambda m, a, o: outputs.append(o))
                   for i in range(LAYERS[0], 30)]
        try:
            dense(input_ids=batch, use_cache=False)
        finally:
            teacher_capture.remove()
            for handle in handles:
                handle.remove()
        student_final, student_blocks = StudentTail(hybrid, LAYERS[0], logits=False, block_outputs=True)(
            teacher_capture.record["hidden_states"], teacher_capture.record["kwargs"])
        student_logits = output_logits(hybrid, student_final)
    kl = torch.nn.functional.kl_div(torch.log_softmax(student_logits.float(), -1).flatten(0, 1),
                                    torch.log_softmax(logits.float(), -1).flatten(0, 1), log_target=True,
                                    reduction="batchmean")
    ce = torch.nn.functional.cross_entropy(student_logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    cosine = hidden_cosine_loss(student_blocks, outputs)
    expected = 0.2 * kl + 0.2 * ce + 0.6 * cosine
    distiller.run()
    # float32; the step sums the KL chunk by chunk: ~1e-7 relative. Each term is > 1e-3 of the sum here, so a
    # dropped or misweighted term moves it by far more than the bar
    assert min(0.2 * kl.item(), 0.2 * ce.item(), 0.6 * cosine.item()) > 1e-3 * expected.item()
    assert distiller.history["stage2"][0] == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("kl_weight, ce_weight", [(1.0, 0.0), (0.2, 0.2)], ids=["kl", "0.2kl+0.2ce"])
def test_the_chunked_loss_weighs_its_kl(smollm2, calib_data_dir, kl_weight, ce_weight):
    dense, _ = smollm2
    hybrid = to_hybrid(dense, HybridSection(layers=[22], layer_type="gdn", base_model_type="llama"))
    ids = windows(smollm2, calib_data_dir, 2, 40)
    with torch.no_grad():
        capture = DecoderInputCapture(dense, 22)
        try:
            teacher = dense.model(input_ids=ids, use_cache=False).last_hidden_state
        finally:
            capture.remove()
        student = StudentTail(hybrid, 22).final_hidden(capture.record["hidden_states"], capture.record["kwargs"])
    heads = functools.partial(output_logits, hybrid), functools.partial(output_logits, dense)
    targets = next_token_targets(ids)
    full = distillation_loss(student, teacher, *heads, 1.0, targets, ce_weight, rows=30)
    kl_only = distillation_loss(student, teacher, *heads, 1.0, None, 0.0, rows=30)
    weighted = distillation_loss(student, teacher, *heads, 1.0, targets, ce_weight, rows=30, kl_weight=kl_weight)
    # the KL term scaled, the cross-entropy term as it was: float32 sums of the same terms
    assert weighted.item() == pytest.approx(full.item() - (1 - kl_weight) * kl_only.item(), rel=1e-6)


def test_norms_and_whole_converted_blocks_train_on_the_students_own_copies(smollm2, calib_data_dir, tmp_path):
    """``lora_targets: attention,mlp,norms`` with ``finetune_converted_blocks``: every norm from the first converted
    layer on and the converted layers' MLPs train whole, in float32, on copies of the student's own; LoRA adapts
    the other layers' MLPs and the softmax layers' attention; the teacher's weights stay bit for bit."""
    dense, _ = smollm2
    before = {name: tensor.clone() for name, tensor in dense.state_dict().items()}
    hybrid = to_hybrid(dense, HybridSection(layers=LAYERS, layer_type="gdn", base_model_type="llama"),
                       share_weights=True, layer_dtype=torch.float32)
    config = DistillConfig(tokens=2 * 4 * 16, seq_len=16, batch_size=4, stage1_fraction=0.5, lora_rank=4,
                           lora_alpha=8, lora_targets="attention,mlp,norms", finetune_converted_blocks=True,
                           lr_whole=1e-3, checkpoint_every=0, seed=1)
    seen = {}

    def inspect(stage, step):
        if stage == 2 and step == 0:
            seen["trained"] = {name.removeprefix("base_model.model."): p.dtype
                               for name, p in hybrid.named_parameters() if p.requires_grad}

    distiller = Distiller(dense, hybrid, LAYERS, config, windows(smollm2, calib_data_dir, 8, 16), tmp_path,
                          {"test": True}, torch.device("cpu"), show_progress=False, on_step=inspect)
    merged = distiller.run()
    whole = set(directly_trained_names(dense, LAYERS, ["norms"], whole_blocks=True))
    norms = {f"model.layers.{i}.{n}.weight" for i in range(13, 30) for n in ("input_layernorm",
                                                                             "post_attention_layernorm")}
    mlps = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in LAYERS for p in ("gate", "up", "down")}
    assert whole == norms | mlps | {"model.norm.weight"}
    targets = lora_target_names(dense, LAYERS, ["attention", "mlp"], whole_blocks=True)
    assert not any(f"layers.{i}.mlp" in t for t in targets for i in LAYERS)
    assert "model.layers.14.mlp.up_proj" in targets and "model.layers.14.self_attn.q_proj" in targets
    trained = seen["trained"]
    assert whole <= set(trained) and {trained[name] for name in whole} == {torch.float32}
    after = dense.state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)  # the teacher is untouched
    for name in ("model.layers.13.mlp.down_proj.weight", "model.layers.20.input_layernorm.weight", "model.norm.weight"):
        mine = merged.get_parameter(name)
        assert mine.data_ptr() != dense.get_parameter(name).data_ptr() and not torch.equal(mine, before[name]), name
