"""What converting each layer alone costs the dense model, measured in memory that does not grow with the probe.

Three steps, each bounded:

1. :func:`align_every_layer`: every layer gets a GDN/KDA replacement initialised from its attention and aligned to
   that attention's output, all layers from one teacher pass per batch (as in distillation stage 1); the backward
   pass runs one layer at a time, so one layer's autograd graph is alive, not all of them.
2. :func:`alignment_errors`: each aligned layer's relative MSE on the held-out probe windows, a few windows at a time.
3. :func:`swap_kl`: for each layer, KL(dense || dense with only that layer swapped for its replacement) per token.
   The probe windows go through the dense model a few at a time (:data:`PROBE_TOKENS_PER_PASS` tokens, or one
   window when longer); one pass records every decoder layer's input and the dense model's log-probabilities for
   those tokens, and each swap reruns only the layers from the swapped one on (the layers below compute exactly
   what the dense model computed). The swapped model's logits exist :data:`LOGIT_ROWS` positions at a time, so
   no ``[windows, seq_len, vocab]`` tensor (0.8 GB for 8 x 512 tokens of SmolLM2's 49152-token vocabulary) exists:
   the largest is the dense log-probabilities of one pass (200 MB for SmolLM2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from retrofit import architecture

PROBE_TOKENS_PER_PASS = 1024  # tokens of probe windows per dense pass (at least one window)
LOGIT_ROWS = 512  # positions whose logits exist at once: 512 x 49152 fp32 = 100 MB per tensor for SmolLM2


def align_every_layer(dense, windows: torch.Tensor, layer_type: str, steps: int, batch_size: int, lr: float,
                      device, show_progress: bool) -> dict[int, torch.nn.Module]:
    """Layer index -> its replacement (``layer_type``) aligned on ``windows [N, L]`` for ``steps`` steps of
    ``batch_size`` windows (AdamW, warm-up then cosine), in eval mode without gradients."""
    from retrofit.convert.build import to_hybrid
    from retrofit.convert.data import BatchSampler
    from retrofit.convert.objectives import AttentionCapture, LayerAligner, warmup_cosine
    from retrofit.hybrid import HybridSection

    arch = architecture.of(dense)
    everything = list(range(len(arch.blocks(dense))))
    section = HybridSection(layers=everything, layer_type=layer_type,
                            base_model_type=architecture.base_model_type(dense.config))
    candidates = to_hybrid(dense, section)
    replacements = {i: arch.attention_module(candidates, i) for i in everything}
    aligner = LayerAligner(replacements).train()
    aligner.requires_grad_(True)
    dense.requires_grad_(False)
    opt = torch.optim.AdamW(aligner.parameters(), lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, 0.1))
    sampler = BatchSampler(windows, batch_size, seed=12345)
    capture = AttentionCapture(dense, everything)
    bar = _progress_bar(steps, show_progress, "scoring: align every layer", "step")
    try:
        for step in range(steps):
            loss = float(aligner.backward_layer_by_layer(capture.run(dense, sampler.batch(step).to(device))))
            torch.nn.utils.clip_grad_norm_(aligner.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(rel_mse=f"{loss:.4f}")
    finally:
        capture.remove()
        if bar is not None:
            bar.close()
    aligner.eval().requires_grad_(False)
    return replacements


@torch.no_grad()
def alignment_errors(dense, replacements: dict[int, torch.nn.Module], probe: torch.Tensor) -> dict[int, float]:
    """Layer -> relative MSE ``sum (out - target)^2 / sum target^2`` of its replacement against its attention over
    all probe windows ``[N, L]`` (sums accumulated a few windows at a time)."""
    from retrofit.convert.objectives import AttentionCapture

    layers = sorted(replacements)
    squared_error = dict.fromkeys(layers, 0.0)
    squared_target = dict.fromkeys(layers, 0.0)
    capture = AttentionCapture(dense, layers)
    try:
        for windows in _window_chunks(probe):
            records = capture.run(dense, windows)
            for i in layers:
                rec, replacement = records[i], replacements[i]
                out = replacement(hidden_states=rec["hidden_states"], position_embeddings=rec["position_embeddings"],
                                  attention_mask=rec["attention_mask"])[0]
                target = rec["target"].float()
                squared_error[i] += float((out.float() - target).pow(2).sum(dtype=torch.float64))
                squared_target[i] += float(target.pow(2).sum(dtype=torch.float64))
            del records
    finally:
        capture.remove()
    return {i: squared_error[i] / max(squared_target[i], 1e-12) for i in layers}


@torch.no_grad()
def swap_kl(dense, replacements: dict[int, torch.nn.Module], probe: torch.Tensor,
            show_progress: bool = False) -> dict[int, float]:
    """Layer -> mean per-token KL(dense || dense with that layer's attention swapped for its replacement), nats, over
    the probe windows ``[N, L]`` (the value ``kl_loss`` gives on the full logits, up to float rounding)."""
    from retrofit.convert.objectives import DecoderInputCapture, StudentTail

    layers = sorted(replacements)
    arch = architecture.of(dense)

    def head(hidden: torch.Tensor) -> torch.Tensor:  # the LM head with the family's multiplier and softcap
        return arch.logits(dense, hidden)

    totals = dict.fromkeys(layers, 0.0)
    chunks = list(_window_chunks(probe))
    # one step per layer and chunk of probe windows, shown in layers (all the chunks through a layer make one)
    bar = _progress_bar(len(layers) * len(chunks), show_progress, "scoring: KL probe per layer", "layer",
                        unit_scale=1 / len(chunks))
    for windows in chunks:
        captures = {i: DecoderInputCapture(dense, i) for i in layers}
        try:
            teacher = log_probs(dense.base_model(input_ids=windows, use_cache=False).last_hidden_state, head,
                                dense.config.vocab_size)
        finally:
            for capture in captures.values():
                capture.remove()
        for i in layers:
            original = arch.replace_attention(dense, i, replacements[i])
            try:
                record = captures[i].record
                student = StudentTail(dense, i).final_hidden(record["hidden_states"], record["kwargs"])
            finally:
                arch.replace_attention(dense, i, original)
            totals[i] += summed_kl(student, teacher, head)
            if bar is not None:
                bar.update(1)
        del captures, teacher
    if bar is not None:
        bar.close()
    tokens = probe.shape[0] * probe.shape[1]
    return {i: totals[i] / tokens for i in layers}


def log_probs(hidden: torch.Tensor, lm_head, vocab: int, rows: int = LOGIT_ROWS) -> torch.Tensor:
    """Final hidden states ``[B, T, hidden]`` -> next-token log-probabilities ``[B * T, vocab]`` (float32), the
    logits (``lm_head``: final hidden ``[N, hidden]`` -> ``[N, vocab]``) built ``rows`` positions at a time."""
    hidden = hidden.flatten(0, 1)
    out = torch.empty(hidden.shape[0], vocab, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        out[start:start + rows] = F.log_softmax(lm_head(hidden[start:start + rows]).float(), dim=-1)
    return out


def summed_kl(student_hidden: torch.Tensor, teacher_log_probs: torch.Tensor, lm_head,
              rows: int = LOGIT_ROWS) -> float:
    """Sum over positions of KL(teacher || student): the student's distribution is ``lm_head`` on its final hidden
    states ``[B, T, hidden]``, ``rows`` positions at a time; the teacher's is given as ``[B * T, vocab]``
    log-probabilities (:func:`log_probs`). Float64 total."""
    student_hidden = student_hidden.flatten(0, 1)
    total = 0.0
    for start in range(0, student_hidden.shape[0], rows):
        s = F.log_softmax(lm_head(student_hidden[start:start + rows]).float(), dim=-1)
        total += float(F.kl_div(s, teacher_log_probs[start:start + rows], log_target=True, reduction="sum"))
    return total


def _window_chunks(windows: torch.Tensor):
    """``windows [N, L]`` in consecutive pieces of about :data:`PROBE_TOKENS_PER_PASS` tokens (>= 1 window)."""
    per_pass = max(1, PROBE_TOKENS_PER_PASS // windows.shape[1])
    for start in range(0, windows.shape[0], per_pass):
        yield windows[start:start + per_pass]


def _progress_bar(total: int, show: bool, desc: str, unit: str, unit_scale: float = 1):
    """A tqdm bar of ``total`` steps, shown as ``steps * unit_scale`` units, or None when progress is not shown."""
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale if unit_scale != 1 else False)
