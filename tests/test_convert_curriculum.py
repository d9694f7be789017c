"""Long-window distillation: stage 2's curriculum of window lengths (the plan's arithmetic, a real run through its
phases, resuming inside a later phase) and activation checkpointing of the student (same gradients, less memory)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from retrofit.convert.checkpoint import STATE_FILE, work_dir_for
from retrofit.convert.objectives import DecoderInputCapture, StudentTail, kl_loss
from retrofit.convert.pipeline import convert
from retrofit.convert.plan import DistillConfig, Plan, parse_lengths
from retrofit.errors import RetrofitError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_plan_without_curriculum_is_the_one_stage2_of_before():
    """No ``stage2_lengths``: one phase on ``seq_len`` with exactly the steps that stage 1 leaves."""
    config = DistillConfig(tokens=20_000_000, seq_len=1024, batch_size=16, stage1_fraction=0.2)
    plan = Plan.from_config(config)
    total = -(-20_000_000 // (16 * 1024))  # 1221 steps of 16 windows of 1024 tokens
    assert plan.stage1_steps == round(total * 0.2) == 244
    assert [(p.seq_len, p.batch_size, p.steps) for p in plan.phases] == [(1024, 16, total - 244)]
    assert plan.windows_needed(config) == {1024: total * 16}
    assert plan.tokens_trained == total * 16 * 1024


def test_curriculum_keeps_tokens_per_step_and_splits_stage2_by_share():
    config = DistillConfig(tokens=20_000_000, seq_len=1024, batch_size=16, stage1_fraction=0.2,
                           stage2_lengths="1024:0.5,4096:0.3,8192:0.2")
    plan = Plan.from_config(config)
    stage2_tokens = (1221 - 244) * 16 * 1024
    assert [(p.seq_len, p.batch_size) for p in plan.phases] == [(1024, 16), (4096, 4), (8192, 2)]
    for phase, share in zip(plan.phases, (0.5, 0.3, 0.2)):
        tokens = phase.steps * phase.batch_size * phase.seq_len  # every phase moves 16,384 tokens a step
        assert phase.batch_size * phase.seq_len == 16 * 1024
        assert abs(tokens - share * stage2_tokens) <= 16 * 1024  # rounded up to whole steps
    assert [p.first_step for p in plan.phases] == [0, plan.phases[0].steps, plan.phases[0].steps + plan.phases[1].steps]
    assert plan.phase_of(plan.phases[0].steps)[0] == 1
    assert plan.tokens_trained == (plan.stage1_steps + plan.stage2_steps) * 16 * 1024
    needed = plan.windows_needed(config)
    assert needed[8192] == plan.phases[2].steps * 2 and needed[4096] == plan.phases[1].steps * 4
    assert needed[1024] == (plan.stage1_steps + plan.phases[0].steps) * 16


def test_phase_longer_than_a_micro_batch_takes_one_window():
    config = DistillConfig(tokens=4096, seq_len=128, batch_size=8, stage1_fraction=0.5, stage2_lengths="128:0.5,2048:0.5")
    plan = Plan.from_config(config)
    assert [(p.seq_len, p.batch_size, p.steps) for p in plan.phases] == [(128, 8, 1), (2048, 1, 1)]
    assert plan.tokens_trained == 2 * 1024 + 1024 + 2048  # the long phase's step holds its whole window


@pytest.mark.parametrize("value, message", [
    ("1024:0.5,4096:0.4", "sum to 0.9"),
    ("1024", "bad phase '1024'"),
    ("1024:0", "bad phase '1024:0'"),
    ("1:1", "bad phase '1:1'"),
    ("abc:1", "bad phase 'abc:1'"),
], ids=["shares-short", "no-share", "zero-share", "length-1", "not-a-number"])
def test_bad_curricula_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        DistillConfig(stage2_lengths=value)


def test_yaml_mapping_form_is_the_string_form():
    assert parse_lengths({1024: 0.25, 8192: 0.75}) == [(1024, 0.25), (8192, 0.75)]
    assert DistillConfig(stage2_lengths={1024: 0.25, 8192: 0.75}).stage2_lengths == "1024:0.25,8192:0.75"


def test_windows_past_the_models_positions_are_refused(smollm2, calib_data_dir, tmp_path):
    with pytest.raises(RetrofitError, match="windows of 16384 tokens .* over the model's limit of 8192 positions"):
        convert(smollm2, recipe="smollm2-135m/cpu-small", data=[str(calib_data_dir / "walden.txt")], layers="22",
                tokens=512, stage2_lengths="32:0.5,16384:0.5", out=tmp_path / "h", show_progress=False)
    assert not (tmp_path / "h").exists()


def test_activation_checkpointing_gives_the_same_gradients(smollm2, calib_data_dir):
    """The student tail recomputed in the backward pass: loss and every gradient equal to the stored-activation run
    (float32 on the CPU; 1e-6 relative covers the summation order, which the recomputation does not change)."""
    from retrofit.convert.build import to_hybrid
    from retrofit.convert.data import token_windows
    from retrofit.hybrid import HybridSection

    dense, tokenizer = smollm2
    batch = token_windows(tokenizer, [str(calib_data_dir / "walden.txt")], 2, 96, show_progress=False)
    hybrid = to_hybrid(dense, HybridSection(layers=[20, 25], layer_type="gdn", base_model_type="llama"),
                       share_weights=False)
    capture = DecoderInputCapture(dense, 20)
    try:
        with torch.no_grad():
            teacher = dense(input_ids=batch, use_cache=False).logits
        record = capture.record
    finally:
        capture.remove()
    results = []
    for checkpoint_from in (0, 96):
        hybrid.zero_grad(set_to_none=True)
        for layer in (hybrid.model.layers[20].self_attn, hybrid.model.layers[25].self_attn):
            layer.requires_grad_(True)
        loss = kl_loss(StudentTail(hybrid, 20, checkpoint_from)(record["hidden_states"], record["kwargs"]), teacher)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in hybrid.named_parameters() if p.grad is not None}))
    (loss_stored, grads_stored), (loss_recomputed, grads_recomputed) = results
    assert grads_stored and grads_stored.keys() == grads_recomputed.keys()
    assert loss_recomputed == pytest.approx(loss_stored, rel=1e-6)
    for name, grad in grads_stored.items():
        assert torch.allclose(grads_recomputed[name], grad, rtol=1e-5, atol=1e-7), name


def test_curriculum_run_through_its_phases_and_resume_inside_the_long_phase(smollm2, calib_data_dir, tmp_path):
    """A tiny real conversion whose stage 2 runs 4 steps on 32-token windows, then 2 steps on 256-token windows (one
    window a step, activation checkpointing on); interrupted in the long phase and resumed, it ends with the weights
    of an uninterrupted run (1e-6, as the resume test of plain runs)."""
    settings = dict(recipe="smollm2-135m/cpu-small", data=[str(calib_data_dir / "walden.txt")], layers="22",
                    tokens=1536, seq_len=32, batch_size=4, stage1_fraction=0.34, stage2_lengths="32:0.5,256:0.5",
                    checkpoint_activations_from=256, checkpoint_every=1, show_progress=False)
    seen: list[tuple[int, int]] = []
    convert(smollm2, out=tmp_path / "straight", on_step=lambda stage, step: seen.append((stage, step)), **settings)
    assert seen == [(1, step) for step in range(4)] + [(2, step) for step in range(6)]
    section = json.loads((tmp_path / "straight" / "config.json").read_text())["retrofit"]
    assert section["distillation"]["stage2_phases"] == [{"seq_len": 32, "batch_size": 4, "steps": 4},
                                                        {"seq_len": 256, "batch_size": 1, "steps": 2}]

    class Interrupt(Exception):
        pass

    def stop_in_long_phase(stage, step):
        if stage == 2 and step == 5:  # the long phase's second step, after the checkpoint of its first
            raise Interrupt

    with pytest.raises(Interrupt):
        convert(smollm2, out=tmp_path / "resumed", on_step=stop_in_long_phase, **settings)
    assert (work_dir_for(tmp_path / "resumed") / STATE_FILE).is_file()
    convert(smollm2, out=tmp_path / "resumed", resume=True, **settings)
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
