"""The distillation loop reads its step losses on the host in batches (every ``LOSS_READS_EVERY`` optimizer steps, and
when a stage ends or pauses) instead of once per micro-batch: the history it keeps must be the one a read per step
gives, value for value, also when the run pauses between two reads."""
from __future__ import annotations

import time

import torch

import retrofit.convert.distill as distill
from retrofit.convert.build import to_hybrid
from retrofit.convert.distill import Distiller, TrainingPaused
from retrofit.convert.plan import DistillConfig
from retrofit.hybrid import HybridSection

STEPS = 20  # more than LOSS_READS_EVERY (16): one batched read inside the stage, one at its end
SEQ_LEN = 16


def stage2_history(smollm2, tmp_path, deadline: float | None = None) -> list[float]:
    """Stage 2 of a one-layer GDN hybrid (layer 27), 2 micro-batches of one 16-token window a step, ``STEPS`` steps:
    the per-step losses the loop kept (up to a pause, if ``deadline`` has passed)."""
    dense, _ = smollm2
    config = DistillConfig(tokens=STEPS * 2 * SEQ_LEN, seq_len=SEQ_LEN, batch_size=1, grad_accum=2,
                           stage1_fraction=0.0, lora_rank=4, lora_alpha=8, checkpoint_every=0, seed=3)
    windows = torch.randint(dense.config.vocab_size, (STEPS * 2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    section = HybridSection(layers=[27], layer_type="gdn", base_model_type=dense.config.model_type)
    hybrid = to_hybrid(dense, section, share_weights=False)
    distiller = Distiller(dense, hybrid, [27], config, windows, tmp_path, {"test": True}, torch.device("cpu"),
                          show_progress=False, deadline=deadline)
    try:
        distiller.stage2()
    except TrainingPaused as paused:
        assert (paused.stage, paused.step) == (2, 1)
    return distiller.history["stage2"]


def test_batched_loss_reads_keep_every_step_loss(smollm2, tmp_path, monkeypatch):
    batched = stage2_history(smollm2, tmp_path / "batched")
    monkeypatch.setattr(distill, "LOSS_READS_EVERY", 1)  # the loop's behaviour before the reads were batched
    per_step = stage2_history(smollm2, tmp_path / "per_step")
    assert len(batched) == STEPS
    # the same arithmetic on the CPU, so the same values exactly; a lost, repeated or shifted read breaks equality
    assert batched == per_step
    # the losses are a step's (two micro-batches' halves summed), plausible KL values of a hybrid still learning
    assert all(0 < value < 20 for value in batched) and len(set(batched)) == STEPS


def test_a_paused_run_keeps_the_losses_read_before_its_checkpoint(smollm2, tmp_path):
    full = stage2_history(smollm2, tmp_path / "full")
    paused = stage2_history(smollm2, tmp_path / "paused", deadline=time.time() - 1)  # pauses after its first step
    assert paused == full[:1]
