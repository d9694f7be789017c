"""What a conversion holds in memory, worked out from shapes before any weight is loaded: the memory plan that
``retrofit convert --dry-run`` prints, and that ``checkpoint_activations_from: auto`` reads.

What the run holds (one process; :mod:`retrofit.convert.distill` says why each is so):

- the dense model's weights once, in ``frozen_dtype``: the teacher runs them and the student's frozen part is the
  same tensors; under FSDP each process holds its shard of them, and all-gathers the embeddings and LM head for a
  step and a decoder layer (two in the backward pass) at a time, for both models (:mod:`retrofit.convert.sharding`);
  the LoRA merge at the end holds them whole again;
- what trains, in float32: the converted layers (stages 1 and 2) and the LoRA adapters (stage 2), their gradients
  and AdamW's two moments (FSDP shards these three over the processes; DDP adds a gradient bucket of the same size);
  under bf16 autocast also autocast's bfloat16 copies of these weights, cached for the step;
- per micro-batch, the activations autograd keeps for the backward pass: every layer of the student from the first
  converted one on (or, under activation checkpointing, each layer's input and one layer's activations at a time),
  the teacher's pass before it (no gradient: one layer's temporaries at a time), and stage 2's loss head, whose
  logits exist one chunk of positions at a time (:func:`retrofit.convert.objectives.distillation_loss`);
- stage 1 (one process) backpropagates one converted layer at a time, with every converted layer's recorded input
  and target; under DDP / FSDP all of them at once;
- at the end, the student's own copies of the weights LoRA is merged into (through one float32 copy at a time; the
  optimizer state is freed by then).

The activations are an estimate from the layers' code, per token and layer: the tensors each operation keeps for
its backward (a Llama-style decoder layer: RMSNorms, q/k/v/o and gate/up/down projections, SDPA keeping q, k, v, its
output and log-sum-exp; a converted layer: its projections, the short convolution's input and output, the L2-normed
q and k, the gates, and what the chunk kernel keeps per token and key-value head, :func:`delta_rule_kept_bytes`).
The Triton kernels' figures are used for every device: the PyTorch path that runs elsewhere (the CPU) keeps more.
A peak is said to fit when it is at most the device memory less :data:`HEADROOM`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from retrofit.errors import RetrofitError

HEADROOM = 0.10  # share of the device memory left for what the estimate does not count: the allocator's
# fragmentation, cuBLAS / attention workspaces, the CUDA context. An assumption, not a measurement
FLOAT32 = 4
ADAMW_MOMENTS = 2  # exp_avg, exp_avg_sq: float32, shaped like each trained parameter

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4,
          "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def parse_memory_size(text: str) -> int:
    """``"80GiB"`` / ``"80GB"`` / ``"81920MiB"`` / ``"80G"`` (G = GiB) -> bytes; RetrofitError on anything else."""
    match = _SIZE.match(str(text))
    unit = (match.group(2) or "").lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise RetrofitError(f"bad memory size {text!r}: expected a positive number with a unit, e.g. 80GiB, 80GB or "
                            "81920MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def device_memory_of(device: torch.device) -> int | None:
    """Bytes of memory the device has: a CUDA device's total, or the host's available memory; None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    from retrofit.memory import available_bytes

    return available_bytes(device)


@dataclass(frozen=True)
class Dims:
    """The widths the estimate reads: hidden, MLP intermediate, query and key-value heads, head dim, vocabulary, and
    the converted layers' key-value heads (all query heads with ``expand_kv``)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    converted_kv_heads: int

    @classmethod
    def of(cls, config, expand_kv: bool) -> "Dims":
        from retrofit import architecture

        arch = architecture.of(config)
        text = architecture.text_config(config)
        heads, kv_heads, head_dim = arch.num_heads(text), arch.num_kv_heads(text), arch.head_dim(text)
        intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size  # GPT-2, GPT-NeoX style: 4x
        return cls(text.hidden_size, intermediate, heads, kv_heads, head_dim, text.vocab_size,
                   heads if expand_kv else kv_heads)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the residual stream (``residual``: the frozen weights' dtype, which the embeddings set)
    and of the matrix products' outputs (``compute``: 2 under bf16 autocast, else the residual's)."""

    residual: int
    compute: int

    @property
    def autocast(self) -> bool:
        return self.compute != FLOAT32

    def casts(self, count: int, width: int) -> int:
        """Bytes autocast keeps per token for ``count`` products reading one ``[tokens, width]`` activation in the
        residual's dtype: each product casts (and keeps) its own copy when the dtypes differ."""
        return count * self.compute * width if self.residual != self.compute else 0

    def adapter_inputs(self, count: int, width: int) -> int:
        """Bytes per token that ``count`` LoRA adapters keep of their ``width``-wide input: peft casts the input to
        the adapter's float32 and autocast casts it back for the product, a new tensor each (nothing new without
        autocast)."""
        return count * self.compute * width if self.autocast else 0


def delta_rule_kept_bytes(dims: Dims, per_channel: bool, low_precision: bool) -> int:
    """Bytes per token and key-value head that the chunk kernel's autograd forward keeps for the backward beyond its
    inputs (``retrofit/kernels/delta_common/chunk.py``, ``_kept_for_backward`` with its defaults: chunks of 64 rows;
    T^-1 per chunk row in float32, W, the chunk states Hs and V' in the buffers' dtype; KDA also the decayed keys,
    the per-channel G, the sub-chunk products M and P and the decayed queries, the last two per query head). At head
    dim 128 in bfloat16, one query head per key-value head: GDN 1,284 bytes, KDA 2,688."""
    rows, k = 64, dims.head_dim
    buffer = 2 if low_precision else FLOAT32
    group = dims.heads // dims.converted_kv_heads
    kept = FLOAT32 * rows + buffer * k + buffer * k * k // rows + buffer * k  # T^-1, W, Hs, V'
    if per_channel:
        kept += buffer * k + FLOAT32 * k + FLOAT32 * rows + group * (buffer * rows + buffer * k)  # Kd, G, M, P, QG
    else:
        kept += FLOAT32  # G
    return kept


def _norm(width: int, p: Precision) -> int:
    """An RMSNorm keeps its input in float32 (a copy when the input is not) and its normalised output."""
    return (FLOAT32 + p.residual) * width


def _mlp(dims: Dims, p: Precision, lora: bool) -> int:
    """The post-attention norm and a gated MLP (gate, up, activation, product kept; LoRA on its three projections)."""
    kept = _norm(dims.hidden, p) + p.casts(2, dims.hidden) + 4 * p.compute * dims.intermediate
    if lora:
        kept += p.adapter_inputs(2, dims.hidden) + p.adapter_inputs(1, dims.intermediate)
    return kept


def softmax_layer_bytes(dims: Dims, p: Precision, lora_attention: bool, lora_mlp: bool) -> int:
    """Bytes per token that one decoder layer kept softmax keeps for the backward pass."""
    q_width, kv_width = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    kept = _norm(dims.hidden, p) + p.casts(3, dims.hidden)
    kept += p.compute * (q_width + 2 * kv_width) + p.compute * q_width + FLOAT32 * dims.heads  # SDPA: q, k, v, out, lse
    kept += p.compute * q_width  # o_proj's input (the output's heads joined)
    if lora_attention:
        kept += p.adapter_inputs(3, dims.hidden) + p.adapter_inputs(1, q_width)
    return kept + _mlp(dims, p, lora_mlp)


def window_kept_bytes(dims: Dims, p: Precision, window: int, sinks: int) -> int:
    """Bytes per token that a converted layer's softmax window keeps for the backward pass
    (:mod:`retrofit.layers.window`): each query head's logits and weights over the keys of its block (the sinks,
    ``window`` before the block and the block of :data:`retrofit.layers.window.BLOCK` queries) in float32 (and
    the weights again in the compute dtype under autocast), each block's keys and values (the keys twice: the
    batched product keeps its own layout of them, and of q), the rotated q and k, and the mix with the delta
    rule's output."""
    from retrofit.layers.window import BLOCK

    if not window:
        return 0
    q_width = dims.heads * dims.head_dim
    kv_width = dims.converted_kv_heads * dims.head_dim
    keys = sinks + window + BLOCK
    kept = dims.heads * keys * (2 * FLOAT32 + (p.compute if p.autocast else 0))  # logits, weights
    kept += 2 * p.compute * kv_width * keys // BLOCK  # the blocks' keys and values
    kept += p.compute * (q_width + kv_width * keys // BLOCK)  # q and the keys again, in the batched product's layout
    kept += p.compute * (q_width + kv_width)  # q and k rotated
    kept += 2 * p.compute * q_width + 2 * FLOAT32 * dims.heads  # the mix: window minus delta rule, the share
    return kept


def converted_attention_bytes(dims: Dims, p: Precision, per_channel: bool, window: int = 0, sinks: int = 0) -> int:
    """Bytes per token that one converted (GDN / KDA) attention keeps for the backward pass, without its decoder
    layer's norms and MLP; with a softmax ``window`` (and ``sinks``) inside, :func:`window_kept_bytes` more."""
    q_width = dims.heads * dims.head_dim
    kv_width = dims.converted_kv_heads * dims.head_dim
    joined = q_width + 2 * kv_width
    kept = p.casts(6, dims.hidden)  # q, k, v, beta and two gate projections read x
    kept += 2 * p.compute * joined  # the short convolution's input and output
    kept += (FLOAT32 + p.compute) * (q_width + kv_width) + p.compute * kv_width  # L2-normed q, k; v made contiguous
    decay = dims.converted_kv_heads * (dims.head_dim if per_channel else 1)
    kept += 3 * FLOAT32 * decay + 2 * FLOAT32 * dims.converted_kv_heads  # log decay, beta, softplus and sigmoid
    kept += dims.converted_kv_heads * delta_rule_kept_bytes(dims, per_channel, p.compute == 2)
    kept += (2 * FLOAT32 + 2 * p.compute) * q_width + p.compute * q_width  # gated norm (o, gate), o_proj's input
    return kept + window_kept_bytes(dims, p, window, sinks)


def converted_layer_bytes(dims: Dims, p: Precision, per_channel: bool, lora_mlp: bool, window: int = 0,
                          sinks: int = 0) -> int:
    """Bytes per token that one converted decoder layer keeps for the backward pass."""
    return (_norm(dims.hidden, p) + converted_attention_bytes(dims, p, per_channel, window, sinks)
            + _mlp(dims, p, lora_mlp))


def teacher_pass_bytes(dims: Dims, p: Precision) -> int:
    """Bytes per token alive at the widest point of a pass without gradients: the residual stream, a norm's output
    and the MLP's gate, up and product."""
    return 2 * p.residual * dims.hidden + 3 * p.compute * dims.intermediate


def loss_head_bytes(dims: Dims, p: Precision, tokens: int) -> int:
    """Stage 2's loss head for ``tokens`` positions: the teacher's and student's final hidden states and the
    gradient of the student's (kept), and one chunk's logits of both models with their float32 log-softmaxes, the
    KL terms and the chunk's backward."""
    from retrofit.convert.objectives import logit_chunk_rows

    rows = min(tokens, logit_chunk_rows(dims.vocab))
    return 3 * p.residual * dims.hidden * tokens + rows * dims.vocab * (2 * p.compute + 6 * FLOAT32)


@dataclass
class PlanRow:
    """One stage, at one window length: its micro-batch, activations and peak (bytes)."""

    stage: str
    window: int
    windows_per_micro_batch: int
    activations: int
    activations_without_checkpointing: int
    checkpointed: bool
    peak: int

    @property
    def tokens(self) -> int:
        return self.window * self.windows_per_micro_batch


@dataclass
class MemoryPlan:
    """What a conversion of ``model`` holds (bytes; per process), by stage and window length (:func:`plan_memory`)."""

    model: str
    layer_type: str
    converted: list[int]
    num_layers: int
    first_converted: int
    frozen_dtype: str
    frozen_params: int
    frozen_bytes: int
    converted_params: int
    lora_params: int
    adapted_params: int
    trained_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    autocast_bytes: int
    merge_bytes: int
    world_size: int
    parallel: str
    rows: list[PlanRow]
    device: str
    device_memory: int | None
    layers_assumed: bool = False
    frozen_bytes_held: int | None = None  # what one process holds of frozen_bytes while training (FSDP: a part)

    @property
    def peak(self) -> PlanRow:
        return max(self.rows, key=lambda row: row.peak)

    @property
    def budget(self) -> int | None:
        """The most a peak may be: the device memory less :data:`HEADROOM`."""
        return None if self.device_memory is None else int(self.device_memory * (1 - HEADROOM))

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.peak.peak <= self.budget

    def table(self) -> str:
        """The plan as printed by ``retrofit convert --dry-run``: a summary, then one Markdown row per stage and
        window."""
        layers = f"{len(self.converted)} of {self.num_layers} layers to {self.layer_type}"
        if self.layers_assumed:
            layers += " (scored: which ones is decided in the run; the student is counted from layer 0)"
        else:
            layers += (f" ({_ranges(self.converted)}; the student runs layers {self.first_converted}-"
                       f"{self.num_layers - 1})")
        sharded = " (sharded over the processes)" if self.parallel == "fsdp" and self.world_size > 1 else ""
        lines = [f"memory plan: {self.model}, {layers}; {self.world_size} process(es)"
                 + (f", {self.parallel}" if self.world_size > 1 else ""),
                 f"frozen weights, shared by teacher and student: {self.frozen_params:,} parameters in "
                 f"{self.frozen_dtype}, {_gib(self.frozen_bytes)}"
                 + (f"; sharded, at most {_gib(self.frozen_bytes_held)} per process while training (its shard, the "
                    "embeddings and LM head, two layers all-gathered)" if sharded else ""),
                 f"trained parameters: {self.converted_params + self.lora_params:,} ({self.converted_params:,} in the "
                 f"converted layers, {self.lora_params:,} LoRA), float32: weights {_gib(self.trained_bytes)}, "
                 f"gradients {_gib(self.gradient_bytes)}, AdamW state {_gib(self.optimizer_bytes)}{sharded}"
                 + (f", autocast copies {_gib(self.autocast_bytes)}" if self.autocast_bytes else ""),
                 "",
                 "| stage | window | windows per micro-batch | tokens | activations | without checkpointing "
                 "| checkpointed | peak |",
                 "|---|---:|---:|---:|---:|---:|:---:|---:|"]
        for row in self.rows:
            if not row.window:  # the merge at the end: no micro-batch
                lines.append(f"| {row.stage} | - | - | - | - | - | - | {_gib(row.peak)} |")
                continue
            lines.append(f"| {row.stage} | {row.window:,} | {row.windows_per_micro_batch} | {row.tokens:,} | "
                         f"{_gib(row.activations)} | {_gib(row.activations_without_checkpointing)} | "
                         f"{'yes' if row.checkpointed else 'no'} | {_gib(row.peak)} |")
        peak = self.peak
        lines.append("")
        if self.budget is None:
            lines.append(f"peak {_gib(peak.peak)} ({peak.stage}, {peak.window:,}-token windows); the memory of "
                         f"{self.device} is unknown: pass --device-memory to check the fit")
        else:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"peak {_gib(peak.peak)} ({peak.stage}, {peak.window:,}-token windows) {verdict} "
                         f"{self.device} with {_gib(self.device_memory)} (at most {_gib(self.budget)}: "
                         f"{HEADROOM:.0%} kept free)")
        return "\n".join(lines)

    def refusal(self) -> str | None:
        """One line saying why the plan cannot fit (None when it fits or the memory is unknown)."""
        if self.fits is not False:
            return None
        peak = self.peak
        hints = []
        if not any(row.checkpointed for row in self.rows if row.stage == "stage 2"):
            hints.append("--checkpoint-activations-from auto")
        if self.frozen_dtype == "float32":
            hints.append("--frozen-dtype bfloat16")
        if peak.windows_per_micro_batch > 1:
            hints.append("a smaller --batch-size")
        if self.parallel != "fsdp" or self.world_size == 1:
            hints.append("more processes with --parallel fsdp")
        return (f"the conversion does not fit {self.device}: its peak is {_gib(peak.peak)} ({peak.stage}, "
                f"{peak.windows_per_micro_batch} x {peak.window:,}-token windows per micro-batch), over the "
                f"{_gib(self.budget)} usable of {_gib(self.device_memory)}"
                + (f"; try {', '.join(hints)}" if hints else ""))


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2 ** 30:.2f} GiB"


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 4, 5, 6]`` -> ``"0-2,4-6"``."""
    parts, start = [], None
    for position, index in enumerate(indices):
        if start is None:
            start = index
        if position + 1 == len(indices) or indices[position + 1] != index + 1:
            parts.append(f"{start}" if start == index else f"{start}-{index}")
            start = None
    return ",".join(parts)


def plan_memory(model_config, layers: list[int] | None, layer_type: str, spec, config, world_size: int = 1,
                device: torch.device | str = "cuda", device_memory: int | None = None, model_name: str = "",
                fraction_layers: int = 0) -> MemoryPlan:
    """The memory plan of converting the causal LM of ``model_config`` (a transformers config), built on the meta
    device: shapes only, no weight allocated or read.

    ``layers``: the converted layers; None for a scored choice (``fraction:F``), of which only the count
    ``fraction_layers`` is known: the student is then counted from layer 0 (the most it can hold). ``spec``: the
    converted layers' :class:`retrofit.layers.LinearAttentionSpec`. ``config``: the :class:`DistillConfig`; its
    ``checkpoint_activations_from`` may be ``"auto"``: then the plan checkpoints the stage-2 windows from the
    shortest one whose peak without it is over the budget (the device memory less :data:`HEADROOM`).
    """
    from retrofit import architecture
    from retrofit.architecture import linear_weight
    from retrofit.convert.objectives import directly_trained_names, lora_target_names
    from retrofit.hybrid import HybridSection, hybrid_config, model_class
    from retrofit.layers import LAYER_TYPES
    from retrofit.model_info import attention_layout, decoder_layers

    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config)
    attention_layout(skeleton)  # an attention layout conversion cannot read: refused here, in one line
    num_layers = len(decoder_layers(skeleton))
    assumed = layers is None
    if assumed:
        layers = list(range(fraction_layers))
    arch = architecture.of(skeleton)
    section = HybridSection(layers=list(layers), layer_type=layer_type,
                            base_model_type=architecture.base_model_type(skeleton.config), layer_spec=spec.to_dict())
    with torch.device("meta"):
        hybrid = model_class(section.base_model_type)(hybrid_config(model_config, section))
    frozen_bytes_per = torch.empty((), dtype=getattr(torch, config.frozen_dtype)).element_size()
    frozen_params = sum(p.numel() for p in skeleton.parameters())
    converted_params = sum(p.numel() for i in layers for p in arch.attention_module(hybrid, i).parameters())
    groups = config.lora_target_groups() if config.lora_rank > 0 else []
    whole_blocks = config.finetune_converted_blocks
    targets = [hybrid.get_submodule(name) for name in lora_target_names(hybrid, list(layers), groups, whole_blocks)]
    lora_params = sum(config.lora_rank * sum(linear_weight(m).weight.shape) for m in targets)
    adapted_params = sum(m.weight.numel() for m in targets)
    # norms and whole converted blocks: trained on the student's own float32 copies (counted with the adapters)
    lora_params += sum(hybrid.get_parameter(name).numel() for name in
                       directly_trained_names(hybrid, list(layers), config.lora_target_groups(), whole_blocks))
    trained = converted_params + lora_params
    autocast = config.bf16 if config.bf16 is not None else device.type == "cuda"
    p = Precision(frozen_bytes_per, 2 if autocast else FLOAT32)
    shard = world_size if config.parallel == "fsdp" and world_size > 1 else 1
    ddp_bucket = FLOAT32 * trained if config.parallel == "ddp" and world_size > 1 else 0
    trained_bytes = FLOAT32 * trained // shard
    gradient_bytes = FLOAT32 * trained // shard + ddp_bucket
    optimizer_bytes = ADAMW_MOMENTS * FLOAT32 * trained // shard
    autocast_bytes = 2 * trained if p.autocast else 0
    frozen_bytes = frozen_params * frozen_bytes_per
    frozen_held = frozen_bytes
    if shard > 1:  # each process holds its shard; what runs is all-gathered just in time (retrofit.convert.sharding)
        layer_params = [sum(p.numel() for p in block.parameters()) for block in arch.blocks(skeleton)]
        outside_layers = frozen_params - sum(layer_params)  # the root's: embeddings, final norm, LM head, gathered
        # for a whole step; of the layers, the one running and the one prefetched for the backward
        frozen_held = frozen_bytes // shard + frozen_bytes_per * (outside_layers + 2 * max(layer_params))

    dims = Dims.of(skeleton.config, spec.expand_kv)
    per_channel = bool(getattr(LAYER_TYPES.get(layer_type), "per_key_decay", False))
    first = 0 if assumed else min(layers)
    converted = set(layers)
    lora_attention, lora_mlp = "attention" in groups, "mlp" in groups
    tail = [converted_layer_bytes(dims, p, per_channel, lora_mlp and not whole_blocks, spec.window, spec.sink_tokens)
            if i in converted else softmax_layer_bytes(dims, p, lora_attention, lora_mlp)
            for i in range(first, num_layers)]
    # the hidden-state cosine holds the teacher's output of every tail layer (and float32 copies of both models')
    cosine = len(tail) * dims.hidden * (p.residual + (2 * FLOAT32 if p.residual != FLOAT32 else 0)) \
        if config.hidden_cosine_weight > 0 else 0
    # autocast keeps a bfloat16 copy of each float32 frozen weight whose product's backward needs it: the student's
    # projections from its first converted layer on, but for the converted attentions (which train)
    blocks = arch.blocks(hybrid)
    tail_weights = sum(m.weight.numel() for i in range(first, num_layers) for name, m in
                       blocks[i].named_modules() if isinstance(m, torch.nn.Linear)
                       and not (i in converted and name.startswith(f"{arch.attention}."))) \
        if p.autocast and p.residual != 2 else 0
    static = frozen_held + trained_bytes + gradient_bytes + optimizer_bytes + autocast_bytes
    residual = p.residual * dims.hidden

    def stage2_activations(tokens: int, checkpointed: bool) -> int:
        if checkpointed:  # each layer keeps its input; one layer at a time is recomputed and kept in the backward
            kept = tokens * (residual * len(tail) + 2 * max(tail)) + 2 * tail_weights // len(tail)
        else:  # every layer keeps its activations; the backward of one adds about as much again
            kept = tokens * (sum(tail) + max(tail)) + 2 * tail_weights
        teacher = tokens * teacher_pass_bytes(dims, p)
        kept += tokens * cosine
        return max(teacher, kept + loss_head_bytes(dims, p, tokens)) + tokens * residual  # + the captured input

    rows = []
    from retrofit.convert.plan import Plan

    plan = Plan.from_config(config, world_size)
    if plan.stage1_steps:
        tokens = config.batch_size * config.seq_len
        if config.stage1_target == "block":  # the whole block: its norms and MLP keep theirs too (no LoRA)
            aligned = converted_layer_bytes(dims, p, per_channel, False, spec.window, spec.sink_tokens)
        else:
            aligned = converted_attention_bytes(dims, p, per_channel, spec.window, spec.sink_tokens)
        records = len(layers) * (p.residual + p.compute) * dims.hidden  # each converted layer's input and target
        graphs = len(layers) if world_size > 1 else 1  # one process backpropagates one layer at a time
        activations = tokens * (records + aligned * (graphs + 1))
        activations = max(activations, tokens * teacher_pass_bytes(dims, p) + tokens * records)
        stage1_static = frozen_held + (FLOAT32 * (2 + ADAMW_MOMENTS) * converted_params) // shard
        stage1_static += (FLOAT32 * converted_params if ddp_bucket else 0) + (2 * converted_params if p.autocast else 0)
        rows.append(PlanRow("stage 1", config.seq_len, config.batch_size, activations, activations, False,
                            stage1_static + activations))
    budget = None if device_memory is None else int(device_memory * (1 - HEADROOM))
    automatic = config.checkpoint_activations_from == "auto"
    threshold = 0 if automatic else int(config.checkpoint_activations_from)
    for phase in sorted({(phase.seq_len, phase.batch_size) for phase in plan.phases if phase.steps}):
        window, per_micro = phase
        tokens = window * per_micro
        plain = stage2_activations(tokens, False)
        if automatic and budget is not None and not threshold and static + plain > budget:
            threshold = window
        checkpointed = 0 < threshold <= window
        activations = stage2_activations(tokens, True) if checkpointed else plain
        rows.append(PlanRow("stage 2", window, per_micro, activations, plain, checkpointed, static + activations))
    # the merge gives each adapted weight its own copy (the teacher's stays), through one float32 copy at a time
    merge_bytes = frozen_bytes_per * adapted_params + FLOAT32 * max((m.weight.numel() for m in targets), default=0)
    if plan.stage2_steps and adapted_params:
        rows.append(PlanRow("LoRA merge", 0, 0, 0, 0, False, frozen_bytes + FLOAT32 * trained + merge_bytes))
    return MemoryPlan(model_name, layer_type, list(layers), num_layers, first, config.frozen_dtype, frozen_params,
                      frozen_bytes, converted_params, lora_params, adapted_params, trained_bytes, gradient_bytes,
                      optimizer_bytes, autocast_bytes, merge_bytes, world_size, config.parallel, rows, str(device),
                      device_memory, assumed, frozen_held)


def resolved_checkpointing(plan: MemoryPlan) -> int:
    """The window length from which stage 2 checkpoints activations under this plan (0: never)."""
    windows = [row.window for row in plan.rows if row.stage == "stage 2" and row.checkpointed]
    return min(windows) if windows else 0
