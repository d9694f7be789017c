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


class LayerAligner(nn.Module):
    """Stage 1 objective: mean over the converted layers of ``||layer(x) - attention(x)||^2 / ||attention(x)||^2``."""

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

    def backward_layer_by_layer(self, records: dict[int, dict]) -> float:
        """The gradients of ``self(records).backward()``, computed one layer at a time (the records are detached, so
        each layer's loss reaches only its own parameters): one layer's autograd graph alive at a time instead of
        all of them. Returns the loss value (read once: each read on the host waits for the device)."""
        total = torch.zeros((), device=next(iter(records.values()))["target"].device)
        for key in self.converted:
            loss = self.layer_loss(int(key), records) / len(self.converted)
            loss.backward()
            total += loss.detach().float()
        return float(total)


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean per-token KL(teacher || student) of ``[B, T, V]`` logits at ``temperature`` (scaled by T^2)."""
    s = F.log_softmax(student_logits.float().flatten(0, 1) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float().flatten(0, 1) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature ** 2


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
    """

    def __init__(self, model: nn.Module, first: int, checkpoint_from: int = 0):
        super().__init__()
        self.model, self.first, self.checkpoint_from = model, first, checkpoint_from
        self.architecture = architecture.of(model)

    def forward(self, hidden_states: torch.Tensor, layer_kwargs: dict[int, dict]) -> torch.Tensor:
        """hidden_states ``[B, T, hidden]`` (input of layer ``first``), each layer's keyword arguments
        (:class:`DecoderInputCapture`) -> logits ``[B, T, vocab]`` as the causal LM computes them (the family's
        multiplier and final softcap included)."""
        return self.architecture.logits(self.model, self.final_hidden(hidden_states, layer_kwargs))

    def final_hidden(self, hidden_states: torch.Tensor, layer_kwargs: dict[int, dict]) -> torch.Tensor:
        """hidden_states ``[B, T, hidden]`` (input of layer ``first``) -> the final-norm output ``[B, T, hidden]``
        that the LM head reads."""
        recompute = torch.is_grad_enabled() and 0 < self.checkpoint_from <= hidden_states.shape[1]
        blocks = self.architecture.blocks(self.model)
        for index in range(self.first, len(blocks)):
            layer, kwargs = blocks[index], layer_kwargs[index]
            if recompute:
                out = checkpoint(layer, hidden_states, use_reentrant=False, **kwargs)
            else:
                out = layer(hidden_states, **kwargs)
            hidden_states = out[0] if isinstance(out, tuple) else out
        return self.architecture.final_norm_of(self.model)(hidden_states)


def lora_target_names(model: nn.Module, converted: list[int], groups: list[str]) -> list[str]:
    """Full module names of the projections LoRA adapts, from the first converted layer on: the attention
    projections of the layers kept softmax and the MLP's projections, as the family's architecture record names
    them (fused q/k/v where the family fuses them; a mixture of experts' MLP is left out)."""
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
        if "mlp" in groups:
            mlp = getattr(block, arch.mlp)
            names += [f"{arch.block_prefix(i)}{arch.mlp}.{p}" for p in arch.mlp_projections
                      if _adaptable(getattr(mlp, p, None))]
    return names


def _adaptable(module) -> bool:
    """A projection peft's LoRA adapts: ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
