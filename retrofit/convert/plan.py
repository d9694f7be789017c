"""What a distillation run does, decided before it starts: its settings (:class:`DistillConfig`, the recipe keys) and
its steps (:class:`Plan`): stage 1 on windows of ``seq_len`` tokens, then stage 2 as one or more phases, each on
windows of its own length (a curriculum up to the model's maximum positions)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from retrofit.convert.copies import check_copy_settings

PARALLEL_MODES = ("ddp", "fsdp")
FROZEN_DTYPES = ("float32", "bfloat16")
STAGE1_TARGETS = ("attention", "block")
LORA_GROUPS = ("attention", "mlp", "norms")


@dataclass
class DistillConfig:
    """Distillation hyper-parameters (recipe keys of the same names; CLI options override them).

    Attributes:
        tokens: calibration tokens processed in total (both stages, all ranks).
        seq_len: tokens per training window (stage 1, and stage 2 unless ``stage2_lengths`` says otherwise).
        batch_size: windows of ``seq_len`` tokens per micro-batch per rank.
        grad_accum: micro-batches per optimizer step.
        stage1_fraction: share of the token budget spent on stage 1 (layer-wise alignment).
        stage2_lengths: stage 2's curriculum, ``"LEN:SHARE,LEN:SHARE,..."`` run in the order given, e.g.
            ``"1024:0.5,4096:0.3,8192:0.2"``: half of stage 2's tokens on windows of 1,024 tokens, then 30% on 4,096,
            then 20% on 8,192. Shares sum to 1. A phase keeps stage 2's tokens per micro-batch
            (``batch_size * seq_len``): its micro-batch holds ``max(1, batch_size * seq_len // LEN)`` windows.
            Empty: all of stage 2 on ``seq_len`` windows.
        checkpoint_activations_from: windows of at least this many tokens run each decoder layer of the student under
            activation checkpointing in stage 2 (recomputed in the backward pass instead of kept): memory stays
            near one layer's activations when a long window cannot be split any further. 0 = never. ``auto``: from
            the shortest window whose stage-2 peak without it would not fit the device, by the memory plan
            (:mod:`retrofit.convert.memory`) made before the model loads.
        lr_stage1: learning rate of the new layers in stage 1.
        lr_stage2: learning rate of the new layers in stage 2.
        lr_lora: learning rate of the LoRA adapters in stage 2.
        lr_whole: learning rate in stage 2 of the weights trained whole besides the converted attention (``norms``
            in ``lora_targets``, ``finetune_converted_blocks``): pretrained weights changed directly, so well under
            LoRA's rate.
        lora_rank: LoRA rank (0 = no LoRA: stage 2 trains the new layers only).
        lora_alpha: LoRA alpha.
        lora_targets: comma list of ``attention`` (LoRA on q/k/v/o of the layers kept dense), ``mlp`` (LoRA on
            gate/up/down) and ``norms`` (the decoder blocks' norms and the final norm, from the first converted
            layer on: their weights are vectors, with no low-rank form, so they train whole, on the student's own
            float32 copies, at ``lr_whole``).
        finetune_converted_blocks: stage 2 trains the converted layers' whole decoder blocks (MLP and norms) on the
            student's own float32 copies at ``lr_whole``, instead of LoRA on their MLP (the converted attention
            trains in full either way). More trained parameters (SmolLM2-135M: 2.65M per block) for the blocks
            whose attention changed most.
        stage1_target: what stage 1 aligns: ``attention`` (each converted attention's output to the dense
            attention's, on its recorded input) or ``block`` (each converted layer's whole decoder block, MLP
            included, to the dense block's output hidden states: relative MSE over the block's own update, so the
            attention learns what matters after the MLP). Only the converted attention trains in stage 1.
        kl_weight: weight of the KL divergence from the dense model's next-token distribution in stage 2.
        ce_weight: weight of the next-token cross-entropy added to the KL loss in stage 2.
        hidden_cosine_weight: weight of a third stage-2 term, the mean over positions and decoder blocks (from the
            first converted layer on) of ``1 - cos(student hidden state, dense hidden state)`` at each block's output.
            Arcee's KDA conversion weighted 0.2 CE + 0.2 KL + 0.6 cosine. 0 = off.
        copy_share: share of stage 2's windows that repeat spans of their own text further on (one copy per 1,024
            tokens; :mod:`retrofit.convert.copies`), so the KL loss covers the teacher's long-range copying. 0 = off.
        copy_span: mean length in tokens of those copies.
        temperature: distillation temperature of the KL loss.
        warmup: fraction of each stage's steps spent in linear warm-up (then cosine decay to 10%).
        weight_decay: AdamW weight decay.
        grad_clip: gradient-norm clip (0 = off).
        checkpoint_every: optimizer steps between training checkpoints (0 = never).
        seed: seed of the data order and of the LoRA initialisation.
        bf16: bf16 autocast (None: on CUDA only).
        frozen_dtype: dtype of the dense model's weights, held once and shared by the teacher and the student's
            frozen part: ``float32`` or ``bfloat16`` (half the bytes; needs bf16 autocast, and the run then computes
            the teacher's hidden states from bfloat16 weights and residual stream). What trains (the converted layers,
            LoRA) keeps float32 weights, gradients and AdamW state either way; the saved hybrid is in this dtype.
        parallel: multi-process engine under torchrun: ``ddp`` (DistributedDataParallel) or ``fsdp`` (FSDP2
            ``fully_shard``); ignored in a single process.
    """

    tokens: int = 2_000_000
    seq_len: int = 512
    batch_size: int = 8
    grad_accum: int = 1
    stage1_fraction: float = 0.25
    stage2_lengths: str = ""
    checkpoint_activations_from: int | str = 0
    lr_stage1: float = 1e-3
    lr_stage2: float = 3e-4
    lr_lora: float = 1e-4
    lr_whole: float = 5e-5
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_targets: str = "attention,mlp"
    finetune_converted_blocks: bool = False
    stage1_target: str = "attention"
    kl_weight: float = 1.0
    ce_weight: float = 0.0
    hidden_cosine_weight: float = 0.0
    copy_share: float = 0.0
    copy_span: int = 32
    temperature: float = 1.0
    warmup: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    seed: int = 0
    bf16: bool | None = None
    frozen_dtype: str = "float32"
    parallel: str = "ddp"

    def __post_init__(self):
        positive = ("tokens", "seq_len", "batch_size", "grad_accum", "lora_alpha")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("lr_stage1", "lr_stage2", "lr_lora", "lr_whole", "temperature"):
            if float(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        check_copy_settings(self.copy_share, self.copy_span)
        for name in ("stage1_fraction", "warmup"):
            if not 0 <= float(getattr(self, name)) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.lora_rank < 0 or self.checkpoint_every < 0 or self.ce_weight < 0:
            raise ValueError("lora_rank, checkpoint_every and ce_weight must be >= 0")
        for name in ("kl_weight", "hidden_cosine_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.kl_weight + self.ce_weight + self.hidden_cosine_weight <= 0:
            raise ValueError("kl_weight, ce_weight and hidden_cosine_weight are all 0: stage 2 would have no loss")
        if self.stage1_target not in STAGE1_TARGETS:
            raise ValueError(f"stage1_target must be one of {', '.join(STAGE1_TARGETS)}, got {self.stage1_target!r}")
        if not isinstance(self.finetune_converted_blocks, bool):
            raise ValueError(f"finetune_converted_blocks must be true or false, got {self.finetune_converted_blocks!r}")
        self.checkpoint_activations_from = _tokens_or_auto(self.checkpoint_activations_from)
        if self.frozen_dtype not in FROZEN_DTYPES:
            raise ValueError(f"frozen_dtype must be one of {', '.join(FROZEN_DTYPES)}, got {self.frozen_dtype!r}")
        if self.frozen_dtype != "float32" and self.bf16 is False:
            raise ValueError(f"frozen_dtype {self.frozen_dtype} needs bf16 autocast; bf16 is false")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {self.parallel!r}")
        unknown = set(self.lora_target_groups()) - set(LORA_GROUPS)
        if unknown:
            raise ValueError(f"lora_targets: unknown group(s) {', '.join(sorted(unknown))}; use "
                             f"{', '.join(LORA_GROUPS)}")
        self.stage2_lengths = format_lengths(self.stage2_curriculum())

    def lora_target_groups(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip() and t.strip() != "none"]

    def stage2_curriculum(self) -> list[tuple[int, float]]:
        """``[(window length, share of stage 2's tokens), ...]`` in training order (``[(seq_len, 1.0)]`` by default)."""
        return parse_lengths(self.stage2_lengths) or [(int(self.seq_len), 1.0)]

    @property
    def longest_window(self) -> int:
        return max([int(self.seq_len)] + [length for length, _ in self.stage2_curriculum()])

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def to_dict(self) -> dict:
        return asdict(self)


def _tokens_or_auto(value) -> int | str:
    """``checkpoint_activations_from``: a token count >= 0 (also as text) or ``"auto"``; ValueError naming it else."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        tokens = int(value)
    except (TypeError, ValueError):
        tokens = -1
    if isinstance(value, (bool, float)) or tokens < 0:
        raise ValueError(f"checkpoint_activations_from must be a token count >= 0 or auto, got {value!r}")
    return tokens


def parse_lengths(value) -> list[tuple[int, float]]:
    """``"1024:0.5,4096:0.5"`` (or a YAML mapping ``{1024: 0.5, 4096: 0.5}``) -> ``[(1024, 0.5), (4096, 0.5)]``;
    raises ValueError naming the bad part. Shares must be > 0 and sum to 1 (within 0.001)."""
    if value is None or value == "":
        return []
    if isinstance(value, dict):
        parts = [f"{length}:{share}" for length, share in value.items()]
    else:
        parts = [part.strip() for part in str(value).split(",") if part.strip()]
    phases = []
    for part in parts:
        length, sep, share = part.partition(":")
        try:
            phase = (int(length), float(share))
        except ValueError:
            phase = None
        if not sep or phase is None or phase[0] < 2 or not 0 < phase[1] <= 1:
            raise ValueError(f"stage2_lengths: bad phase {part!r}; expected LEN:SHARE with LEN >= 2 tokens and "
                             "0 < SHARE <= 1, e.g. 1024:0.5,4096:0.3,8192:0.2")
        phases.append(phase)
    total = sum(share for _, share in phases)
    if abs(total - 1) > 1e-3:
        raise ValueError(f"stage2_lengths: the shares sum to {total:g}, not 1")
    return phases


def format_lengths(phases: list[tuple[int, float]]) -> str:
    return ",".join(f"{length}:{share:g}" for length, share in phases)


@dataclass(frozen=True)
class Phase:
    """A run of stage-2 steps on windows of ``seq_len`` tokens, ``batch_size`` windows per micro-batch per rank."""

    seq_len: int
    batch_size: int
    steps: int
    first_step: int  # the stage-2 step this phase starts at
    tokens_per_step: int  # all micro-batches and ranks of one optimizer step

    def __contains__(self, step: int) -> bool:
        return self.first_step <= step < self.first_step + self.steps


@dataclass
class Plan:
    """Steps of each stage for a token budget.

    A stage-1 step holds ``batch_size * grad_accum * world_size`` windows of ``seq_len`` tokens
    (``tokens_per_step``). Stage 2 gets the steps of the budget that stage 1 leaves; with a curriculum
    (``stage2_lengths``) its tokens are split by share into phases, each phase keeping the tokens per step.
    """

    stage1_steps: int
    phases: list[Phase]
    tokens_per_step: int

    @property
    def stage2_steps(self) -> int:
        return sum(phase.steps for phase in self.phases)

    @property
    def tokens_trained(self) -> int:
        """Tokens the whole run reads (both stages, every rank): the budget rounded up to whole steps."""
        return self.stage1_steps * self.tokens_per_step + sum(p.steps * p.tokens_per_step for p in self.phases)

    @classmethod
    def from_config(cls, config: DistillConfig, world_size: int = 1) -> "Plan":
        per_step = config.batch_size * config.grad_accum * world_size * config.seq_len
        total = max(1, math.ceil(config.tokens / per_step))
        stage1 = round(total * config.stage1_fraction)
        if config.stage1_fraction > 0 and stage1 == 0:
            stage1 = 1
        stage2_tokens = max(0, total - stage1) * per_step
        tokens_per_micro_batch = config.batch_size * config.seq_len
        phases, first = [], 0
        for length, share in config.stage2_curriculum():
            windows = max(1, tokens_per_micro_batch // length)
            step_tokens = windows * config.grad_accum * world_size * length
            if length == config.seq_len and share == 1:  # no curriculum: exactly the steps stage 1 leaves
                steps = max(0, total - stage1)
            else:
                steps = math.ceil(stage2_tokens * share / step_tokens) if stage2_tokens else 0
            phases.append(Phase(length, windows, steps, first, step_tokens))
            first += steps
        return cls(stage1, phases, per_step)

    def phase_of(self, step: int) -> tuple[int, Phase]:
        """(index, phase) of stage-2 step ``step``."""
        for index, phase in enumerate(self.phases):
            if step in phase:
                return index, phase
        raise IndexError(f"stage 2 has {self.stage2_steps} steps; there is no step {step}")

    def windows_needed(self, config: DistillConfig, world_size: int = 1) -> dict[int, int]:
        """Window length -> how many distinct windows of that length the run reads (stage 1 and the stage-2 phases on
        ``seq_len`` share one pool; the samplers repeat windows over epochs if a pool runs short)."""
        per_window_step = config.grad_accum * world_size
        needed = {config.seq_len: self.stage1_steps * config.batch_size * per_window_step}
        for phase in self.phases:
            needed[phase.seq_len] = needed.get(phase.seq_len, 0) + phase.steps * phase.batch_size * per_window_step
        return needed

    def describe(self) -> list[dict]:
        """The stage-2 phases as plain values (for the hybrid's config and the conversion report)."""
        return [{"seq_len": phase.seq_len, "batch_size": phase.batch_size, "steps": phase.steps}
                for phase in self.phases]
