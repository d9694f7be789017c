"""What conversion optimises and how it reads the dense model: the captures of attention inputs/outputs and of a
decoder layer's input, the stage-1 and stage-2 objectives, and the learning-rate schedule. Shared by distillation
(``distill.py``) and scored layer selection (``selection.py``)."""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from retrofit import architecture


def warmup_cosine(total_steps: int, warmup: float, floor: float = 0.1) -> Callable[[int], float]:
    warm = max(1, round(total_steps * warmup)) if warmup > 0 else 0

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class _StopForward(Exception):
    """Raised by the capture hook after the last selected layer: the rest of the teacher pass is not needed."""


class AttentionCapture:
    """Records the inputs (hidden_states, position_embeddings, attention_mask) and outputs of selected attention
    modules during one forward pass of the dense model, then stops the pass."""

    def __init__(self, model: nn.Module, layers: list[int]):
        self.layers = sorted(layers)
        self.records: dict[int, dict] = {}
        self.handles = []
        arch = architecture.of(model)
        for i in self.layers:
            attn = arch.attention_module(model, i)
            self.handles.append(attn.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(attn.register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self.records[i] = {"hidden_states": hidden, "position_embeddings": kwargs.get("position_embeddings"),
                               "attention_mask": kwargs.get("attention_mask")}
        return hook

    def _post(self, i):
        def hook(module, args, output):
            self.records[i]["target"] = output[0] if isinstance(output, tuple) else output
            if i == self.layers[-1]:
                raise _StopForward
        return hook

    @torch.no_grad()
    def run(self, model: nn.Module, input_ids: torch.Tensor) -> dict[int, dict]:
        self.records = {}
        with contextlib.suppress(_StopForward):
            model(input_ids=input_ids, use_cache=False)
        return self.records

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class BlockCapture:
    """Records the input (hidden states and keyword arguments) and the output hidden states of selected decoder
    blocks during one forward pass of the dense model, then stops the pass: ``records[i] = {"hidden_states": [B, T,
    hidden], "kwargs": {...}, "target": [B, T, hidden]}`` (the model's own tensors, nothing copied)."""

    def __init__(self, model: nn.Module, layers: list[int]):
        self.layers = sorted(layers)
        self.records: dict[int, dict] = {}
        blocks = architecture.of(model).blocks(model)
        self.handles = []
        for i in self.layers:
            self.handles.append(blocks[i].register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(blocks[i].register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.records[i] = {"hidden_states": hidden,
                               "kwargs": {k: v for k, v in kwargs.items() if k != "hidden_states"}}
        return hook

    def _post(self, i):
        def hook(module, args, output):
            self.records[i]["target"] = output[0] if isinstance(output, tuple) else output
            if i == self.layers[-1]:
                raise _StopForward
        return hook

    @torch.no_grad()
    def run(self, model: nn.Module, input_ids: torch.Tensor) -> dict[int, dict]:
        self.records = {}
        with contextlib.suppress(_StopForward):
            model(input_ids=input_ids, use_cache=False)
        return self.records

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class LayerAligner(nn.Module):
    """Stage 1 objective: mean over the converted layers of ``||layer(x) - attention(x)||^2 / ||attention(x)||^2``
    (the records of :class:`AttentionCapture`)."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        self.converted = nn.ModuleDict({str(i): layer for i, layer in layers.items()})

    def forward(self, records: dict[int, dict]) -> torch.Tensor:
        return torch.stack([self.layer_loss(int(key), records) for key in self.converted]).mean()

    def layer_loss(self, layer: int, records: dict[int, dict]) -> torch.Tensor:
        """The relative MSE of converted layer ``layer`` on its recorded inputs (a scalar)."""
        rec, converted = records[layer], self.converted[str(layer)]
        out = converted(hidden_states=rec["hidden_states"], position_embeddings=rec["position_embeddings"],
                        attention_mask=rec["attention_mask"])[0]
        target = rec["target"].float()
        return F.mse_loss(out.float(), target) / target.pow(2).mean().clamp_min(1e-12)

    def backward_layer_by_layer(self, records: dict[int, dict], accumulation: int = 1,
                                autocast: Callable = contextlib.nullcontext) -> torch.Tensor:
        """The gradients of ``(self(records) / accumulation).backward()`` (each layer's forward under ``autocast()``),
        computed one layer at a time (the records are detached, so each layer's loss reaches only its own
        parameters): one layer's autograd graph alive at a time instead of all of them, the same gradients. Returns
        the loss divided by ``accumulation`` as a device scalar (not read on the host, which would wait for the
        device)."""
        total = torch.zeros((), device=next(iter(records.values()))["target"].device)
        for key in self.converted:
            with autocast():
                loss = self.layer_loss(int(key), records) / len(self.converted)
            loss = loss / accumulation
            loss.backward()
            total += loss.detach().float()
        return total


class BlockAligner(LayerAligner):
    """Stage 1 objective on whole decoder blocks (``stage1_target: block``): mean over the converted layers of
    ``||block(x) - dense_block(x)||^2 / ||dense_block(x) - x||^2``, each block (its converted attention, the dense
    model's norms and MLP) run on the dense block's recorded input ``x`` (the records of :class:`BlockCapture`).

    The error is relative to the block's own update (output minus input), not to its output: the residual stream
    passes through both blocks unchanged and would make any error look small. Shapes: each record's
    ``hidden_states`` and ``target`` ``[B, T, hidden]``."""

    def layer_loss(self, layer: int, records: dict[int, dict]) -> torch.Tensor:
        rec, block = records[layer], self.converted[str(layer)]
        out = block(rec["hidden_states"], **rec["kwargs"])
        out = out[0] if isinstance(out, tuple) else out
        target = rec["target"].float()
        update = target - rec["hidden_states"].float()
        return F.mse_loss(out.float(), target) / update.pow(2).mean().clamp_min(1e-12)


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean per-token KL(teacher || student) of ``[B, T, V]`` logits at ``temperature`` (scaled by T^2).

    The whole-vocabulary reference of :func:`distillation_loss`, which stage 2 runs (the same value, chunk by chunk).
    """
    s = F.log_softmax(student_logits.float().flatten(0, 1) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float().flatten(0, 1) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature ** 2


LOGIT_CHUNK_BYTES = 1 << 26  # 64 MiB: one float32 [rows, vocab] tensor of distillation_loss's chunks (a chunk holds
# about seven such tensors at once: both models' logits, log-softmaxes, the KL terms, the backward's)


def logit_chunk_rows(vocab_size: int) -> int:
    """Positions per chunk of :func:`distillation_loss`: a float32 ``[rows, vocab]`` tensor of at most
    :data:`LOGIT_CHUNK_BYTES` (341 rows for SmolLM2's 49,152-token vocabulary, 130 for Llama-3's 128,256)."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))


def output_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """What the causal LM ``model`` makes of final hidden states ``[..., hidden]``: its LM head, then its family's
    multiplier and final logit softcapping (the architecture record's :meth:`Architecture.logits`) -> logits
    ``[..., vocab]``."""
    return architecture.of(model).logits(model, hidden)


class _ChunkedDistillation(torch.autograd.Function):
    """Forward: the loss, and its gradient with respect to the student's final hidden states, one chunk of positions
    at a time (each chunk's logits exist only while it is computed); backward: that gradient, scaled."""

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, targets, student_head, teacher_head, temperature, ce_weight,
                rows, kl_weight):
        total = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
        grad = torch.empty_like(student_hidden)
        positions = student_hidden.shape[0]
        scored = int((targets >= 0).sum()) if ce_weight > 0 else 0
        for start in range(0, positions, rows):
            end = min(positions, start + rows)
            with torch.no_grad():
                t = F.log_softmax(teacher_head(teacher_hidden[start:end]).float() / temperature, dim=-1)
            with torch.enable_grad():
                hidden = student_hidden[start:end].detach().requires_grad_(True)
                logits = student_head(hidden).float()
                s = F.log_softmax(logits / temperature, dim=-1)
                loss = F.kl_div(s, t, log_target=True, reduction="sum") * (kl_weight * temperature ** 2 / positions)
                if scored:
                    loss = loss + F.cross_entropy(logits, targets[start:end], ignore_index=-100,
                                                  reduction="sum") * (ce_weight / scored)
                (grad[start:end],) = torch.autograd.grad(loss, hidden)
            total += loss.detach()
            del t, logits, s, loss
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None, None, None, None, None


def distillation_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head: Callable,
                      teacher_head: Callable, temperature: float = 1.0, targets: torch.Tensor | None = None,
                      ce_weight: float = 0.0, rows: int | None = None, kl_weight: float = 1.0) -> torch.Tensor:
    """Stage 2's loss from final hidden states, without a whole ``[tokens, vocab]`` logit tensor of either model:
    ``kl_weight * kl_loss(student_head(student_hidden), teacher_head(teacher_hidden), temperature)``, plus
    ``ce_weight`` times the mean next-token cross-entropy of the student's logits (at temperature 1) where
    ``targets`` name a token.

    Args:
        student_hidden: ``[B, T, hidden]``, differentiable; the gradient reaches it (the heads must be frozen).
        teacher_hidden: ``[B, T, hidden]`` (no gradient).
        student_head, teacher_head: final hidden ``[rows, hidden]`` -> logits ``[rows, vocab]``
            (e.g. ``functools.partial(output_logits, model)``).
        targets: ``[B, T]`` token ids, ``-100`` where a position has no target (needed when ``ce_weight`` > 0).
        rows: positions per chunk (default :func:`logit_chunk_rows`). Memory beyond the inputs: a few float32
            ``[rows, vocab]`` tensors while a chunk is computed, and the gradient ``[B, T, hidden]``, kept for the
            backward pass (so the logits are never recomputed).

    Returns:
        The scalar loss (float32). Equal to the whole-vocabulary computation up to float32 rounding (sums in
        another order): ``tests/test_distill_memory.py``.
    """
    if ce_weight > 0 and targets is None:
        raise ValueError("distillation_loss: ce_weight > 0 needs targets")
    hidden_size = student_hidden.shape[-1]
    flat_targets = (targets.reshape(-1) if targets is not None
                    else torch.full(student_hidden.shape[:-1], -100, device=student_hidden.device).reshape(-1))
    if rows is None:
        with torch.no_grad():
            rows = logit_chunk_rows(teacher_head(teacher_hidden.reshape(-1, hidden_size)[:1]).shape[-1])
    return _ChunkedDistillation.apply(student_hidden.reshape(-1, hidden_size), teacher_hidden.reshape(-1, hidden_size),
                                      flat_targets, student_head, teacher_head, float(temperature), float(ce_weight),
                                      int(rows), float(kl_weight))


def hidden_cosine_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean over decoder blocks and positions of ``1 - cos(student, teacher)``: ``student[i]`` (differentiable) and
    ``teacher[i]`` ``[B, T, hidden]``, the output hidden states of the same block of each model -> a float32
    scalar in [0, 2]."""
    terms = [1 - F.cosine_similarity(s.float(), t.float(), dim=-1).mean() for s, t in zip(student, teacher)]
    return torch.stack(terms).mean()


class BlockOutputCapture:
    """Keeps, during a forward pass of ``model``, the output hidden states of its decoder blocks ``first..L-1``:
    ``outputs`` (a list ``[B, T, hidden]`` per block, in order; the model's own tensors), refilled at each pass."""

    def __init__(self, model: nn.Module, first: int):
        blocks = architecture.of(model).blocks(model)
        self.outputs: list[torch.Tensor] = []
        self.first = first
        self.handles = [blocks[index].register_forward_hook(self._hook(index)) for index in range(first, len(blocks))]

    def _hook(self, index: int):
        def hook(module, args, output):
            if index == self.first:
                self.outputs = []
            self.outputs.append(output[0] if isinstance(output, tuple) else output)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token ids -> ``[B, T]`` targets: position ``t`` predicts token ``t + 1``; the last position of each
    window has none (``-100``)."""
    targets = torch.full_like(input_ids, -100)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


class DecoderInputCapture:
    """Records, during a forward pass, the input hidden states of decoder layer ``layer`` and the keyword arguments
    of it and every later layer: ``record = {"hidden_states": [B, T, hidden], "kwargs": {index: kwargs}}``. Layers
    may differ in what they are passed (a sliding-window layer's mask, Gemma 3's local rotary), so each keeps its
    own (the tensors are the model's, shared: nothing is copied)."""

    def __init__(self, model: nn.Module, layer: int):
        self.record: dict = {}
        self.first = layer
        blocks = architecture.of(model).blocks(model)
        self.handles = [blocks[index].register_forward_pre_hook(self._hook(index), with_kwargs=True)
                        for index in range(layer, len(blocks))]

    def _hook(self, index: int):
        def hook(module, args, kwargs):
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if index == self.first:
                self.record = {"hidden_states": args[0] if args else kwargs["hidden_states"], "kwargs": {}}
            self.record["kwargs"][index] = rest
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class StudentTail(nn.Module):
    """The hybrid from decoder layer ``first`` on: layers ``first..L-1``, final norm, LM head.

    Layers below the first converted one compute exactly what the dense model computes (they are not adapted), so
    stage 2 starts the student from the teacher's residual stream there instead of recomputing it.

    ``checkpoint_from``: windows of at least this many tokens run each layer under activation checkpointing (its
    activations recomputed in the backward pass instead of kept; 0 = never): the memory a long window needs beyond
    the residual stream is one layer's, at the cost of a second forward pass of the tail.

    ``logits``: whether the forward ends with the LM head (False: it returns the final hidden states, and the loss
    applies the head chunk by chunk, :func:`distillation_loss`). ``block_outputs``: the forward returns
    ``(result, [output hidden states of each layer first..L-1])`` (what :func:`hidden_cosine_loss` reads).
    """

    def __init__(self, model: nn.Module, first: int, checkpoint_from: int = 0, logits: bool = True,
                 block_outputs: bool = False):
        super().__init__()
        self.model, self.first, self.checkpoint_from, self.logits = model, first, checkpoint_from, logits
        self.block_outputs = block_outputs
        self.architecture = architecture.of(model)

    def forward(self, hidden_states: torch.Tensor, layer_kwargs: dict[int, dict]):
        """hidden_states ``[B, T, hidden]`` (input of layer ``first``), each layer's keyword arguments
        (:class:`DecoderInputCapture`) -> logits ``[B, T, vocab]`` as the causal LM computes them (the family's
        multiplier and final softcap included), or, without ``logits``, the final hidden states ``[B, T, hidden]``;
        with ``block_outputs``, that and the list of each layer's output ``[B, T, hidden]``."""
        outputs: list[torch.Tensor] = []
        final = self.final_hidden(hidden_states, layer_kwargs, outputs)
        result = self.architecture.logits(self.model, final) if self.logits else final
        return (result, outputs) if self.block_outputs else result

    def final_hidden(self, hidden_states: torch.Tensor, layer_kwargs: dict[int, dict],
                     outputs: list | None = None) -> torch.Tensor:
        """hidden_states ``[B, T, hidden]`` (input of layer ``first``) -> the final-norm output ``[B, T, hidden]``
        that the LM head reads; each layer's output is appended to ``outputs`` where given."""
        recompute = torch.is_grad_enabled() and 0 < self.checkpoint_from <= hidden_states.shape[1]
        blocks = self.architecture.blocks(self.model)
        for index in range(self.first, len(blocks)):
            layer, kwargs = blocks[index], layer_kwargs[index]
            if recompute:
                out = checkpoint(layer, hidden_states, use_reentrant=False, **kwargs)
            else:
                out = layer(hidden_states, **kwargs)
            hidden_states = out[0] if isinstance(out, tuple) else out
            if outputs is not None:
                outputs.append(hidden_states)
        return self.architecture.final_norm_of(self.model)(hidden_states)


def lora_target_names(model: nn.Module, converted: list[int], groups: list[str],
                      whole_blocks: bool = False) -> list[str]:
    """Full module names of the projections LoRA adapts, from the first converted layer on: the attention
    projections of the layers kept softmax and the MLP's projections, as the family's architecture record names
    them (fused q/k/v where the family fuses them; a mixture of experts' MLP is left out). ``whole_blocks``: the
    converted layers' blocks train whole (:func:`directly_trained_names`), so their MLP gets no adapter. The group
    ``norms`` names no adapter (norms train whole)."""
    arch = architecture.of(model)
    config = architecture.text_config(model)
    names = []
    first = min(converted)
    for i, block in enumerate(arch.blocks(model)):
        if i < first:
            continue
        if "attention" in groups and i not in converted:
            attention = arch.attention_of(block)
            names += [f"{arch.attention_prefix(i)}{p}" for p in arch.attention_projection_names(config)
                      if _adaptable(getattr(attention, p, None))]
        if "mlp" in groups and not (whole_blocks and i in converted):
            mlp = getattr(block, arch.mlp)
            names += [f"{arch.block_prefix(i)}{arch.mlp}.{p}" for p in arch.mlp_projections
                      if _adaptable(getattr(mlp, p, None))]
    return names


def directly_trained_names(model: nn.Module, converted: list[int], groups: list[str],
                           whole_blocks: bool = False) -> list[str]:
    """Full names of the parameters of ``model`` (a hybrid) that stage 2 trains whole besides the converted
    attention: with ``norms`` in ``groups``, every norm of the decoder blocks from the first converted layer on and
    the final norm; with ``whole_blocks``, everything of the converted layers' blocks outside their attention (MLP
    and norms). A norm is what a block holds besides its attention and MLP: its one-dimensional parameters (no
    per-family names)."""
    arch = architecture.of(model)
    first = min(converted)
    names: list[str] = []
    for i, block in enumerate(arch.blocks(model)):
        if i < first:
            continue
        for name, parameter in block.named_parameters():
            top = name.split(".", 1)[0]
            if top == arch.attention:
                continue
            whole = whole_blocks and i in converted
            norm = "norms" in groups and top != arch.mlp and parameter.dim() == 1
            if whole or norm:
                names.append(f"{arch.block_prefix(i)}{name}")
    if "norms" in groups:
        final = arch.final_norm_of(model)
        prefix = next(name for name, module in model.named_modules() if module is final)
        names += [f"{prefix}.{name}" for name, _ in final.named_parameters()]
    return names


def _adaptable(module) -> bool:
    """A projection peft's LoRA adapts: ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
