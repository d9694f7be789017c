"""Two-stage distillation of a hybrid from its dense model.

Stage 1 (layer-wise): one teacher pass per batch records the inputs and outputs of every selected attention layer
(or, with ``stage1_target: block``, of every converted layer's decoder block); each converted layer is trained to
reproduce its attention's output (or its block's output hidden states) on the same inputs (relative MSE), all
layers at once (one process backpropagates them one layer at a time: the same gradients, one layer's activations).
Stage 2 (end to end): the hybrid is trained against the dense model's logits (KL, optional CE, optional cosine of
every block's output hidden states) with LoRA on the remaining attention and MLP projections from the first
converted layer on (peft), the new layers trained fully, and optionally the norms and the converted layers' whole
blocks trained on the student's own copies; LoRA is merged at the end.

Runs unchanged under ``torchrun`` (one process per GPU; batches sharded by rank; rank 0 saves), with DDP
(``parallel: ddp``, the default) or FSDP2 (``parallel: fsdp``: ``torch.distributed.fsdp.fully_shard``). Checkpoints
every ``checkpoint_every`` steps; a resumed run ends with the same weights as an uninterrupted one.

The student may hold the teacher's frozen weights themselves (``to_hybrid(..., share_weights=True)``, what the
pipeline builds): nothing here writes into a frozen tensor. LoRA wraps the student's own modules (the teacher's stay
as they are, so the teacher computes the dense function), and the final merge writes into a float32 copy of each
adapted weight, never into the weight the teacher (or the caller's model) holds. Stage 2's loss is computed from the
final hidden states chunk by chunk (:func:`retrofit.convert.objectives.distillation_loss`): no ``[tokens, vocab]``
logits of either model exist at once.

FSDP (:mod:`retrofit.convert.sharding`) shards a copy of the teacher and of what a stage trains, every weight once:
the trained parameters (new layers, LoRA) with their gradients and AdamW state, and the frozen weights, which the
student holds as the teacher's own tensors, so that one set of shards (1/world of them per process) serves the
teacher's pass and the student's. One unit per decoder layer holds both models' modules of that layer, all-gathered
just in time for either pass; the root holds the embeddings, final norm and LM head. While a stage runs, the dense
model's and the hybrid's own frozen tensors are emptied; at its end they get their full values back (the same
values, bit for bit), and the full trained values are written into the hybrid's own (plain) parameters, so LoRA
merging and saving see ordinary tensors. Checkpoints hold full (unsharded) tensors in the layout of a one-process
run.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from retrofit import architecture
from retrofit.convert.checkpoint import (
    full_optimizer_state,
    load_sharded_optimizer_state,
    load_train_state,
    load_trainable_state,
    rng_state,
    save_train_state,
    set_rng_state,
    trainable_state,
)
from retrofit.convert.copies import copy_generator, with_copied_spans
from retrofit.convert.data import BatchSampler
from retrofit.convert.objectives import (AttentionCapture, BlockAligner, BlockCapture, BlockOutputCapture,
                                         DecoderInputCapture, LayerAligner, StudentTail, directly_trained_names,
                                         distillation_loss, hidden_cosine_loss, lora_target_names, next_token_targets,
                                         output_logits, warmup_cosine)
from retrofit.convert.plan import PARALLEL_MODES, DistillConfig, Plan  # noqa: F401  (re-exported: the settings' old home)
from retrofit.devices import parse_dtype

LOSS_READS_EVERY = 16  # optimizer steps between reads of the step losses on the host


def distributed() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _backward(loss: torch.Tensor, accumulation: int) -> torch.Tensor:
    """Backpropagate ``loss / accumulation`` (one micro-batch of a step of ``accumulation``) and return it detached."""
    loss = loss / accumulation
    loss.backward()
    return loss.detach()


class TrainingPaused(Exception):
    """Raised when a run reaches its time budget: a checkpoint was written; rerun with ``--resume`` to continue."""

    def __init__(self, stage: int, step: int):
        super().__init__(f"time budget reached at stage {stage}, step {step}: checkpoint saved; rerun with --resume")
        self.stage, self.step = stage, step


@dataclass
class PreparedStage:
    """What one stage runs. ``student(*args)``: the student pass (through DDP or FSDP where they wrap it);
    ``student_root``: the module that pass runs, unwrapped; ``teacher``: the dense model the teacher pass reads (under
    FSDP its sharded copy); ``teacher_pass(run)``: ``run()``, the teacher's pass (under FSDP through FSDP's root);
    ``checkpointed``: what checkpoints read; ``start``: the step to start at; ``finish()``: writes FSDP's trained
    values back into the stage's module and the frozen weights back, full, into the dense model and the hybrid."""

    student: Callable
    student_root: nn.Module
    teacher: nn.Module
    teacher_pass: Callable[[Callable], object]
    checkpointed: nn.Module
    params: list
    opt: torch.optim.Optimizer
    sched: object
    start: int
    finish: Callable[[], None]


class Distiller:
    """Runs stage 1 and stage 2 on a hybrid built from ``dense`` and returns the trained hybrid (LoRA merged).

    ``hybrid`` may share its frozen weights' storage with ``dense`` (neither is written: see the module docstring).
    ``windows``: ``[N, seq_len]`` calibration token windows, or a dict window length -> ``[N_len, len]`` windows
    holding every length of stage 2's curriculum (``config.stage2_lengths``). ``work_dir``: where training checkpoints go.
    ``on_step(stage, step)`` is called after every optimizer step (progress reporting; tests use it to interrupt).
    """

    def __init__(self, dense: nn.Module, hybrid: nn.Module, layers: list[int], config: DistillConfig,
                 windows: torch.Tensor | dict[int, torch.Tensor], work_dir: Path, fingerprint: dict, device: torch.device,
                 resume: bool = False, show_progress: bool = True,
                 on_step: Callable[[int, int], None] | None = None, deadline: float | None = None):
        self.dense, self.hybrid, self.layers, self.config = dense, hybrid, sorted(layers), config
        self.work_dir, self.device, self.on_step = Path(work_dir), device, on_step
        self.deadline = deadline  # time.time() after which the run checkpoints and raises TrainingPaused
        if config.checkpoint_activations_from == "auto":
            raise ValueError("checkpoint_activations_from auto is decided by the memory plan before training "
                             "(retrofit.convert.pipeline); give the Distiller a window length")
        self.rank, self.world_size = distributed()
        self.show_progress = show_progress and self.rank == 0
        self.plan = Plan.from_config(config, self.world_size)
        self.fingerprint = fingerprint
        self.pools = dict(windows) if isinstance(windows, dict) else {config.seq_len: windows}
        self.windows = self.pools[config.seq_len]
        for phase in self.plan.phases:
            if phase.steps and phase.seq_len not in self.pools:
                raise ValueError(f"no calibration windows of {phase.seq_len} tokens for stage 2's curriculum")
        self.saved = load_train_state(self.work_dir, fingerprint) if resume else None
        self.bf16 = config.bf16 if config.bf16 is not None else device.type == "cuda"
        self.frozen_dtype = parse_dtype(config.frozen_dtype)
        self.history: dict[str, list[float]] = {"stage1": [], "stage2": []}
        self.frozen_bytes_held: dict[int, int] = {}  # stage -> bytes of frozen weights this process holds under FSDP
        self.running: PreparedStage | None = None  # the stage being trained (what on_step may look at)

    # ----- shared plumbing -----
    def _autocast(self):
        if self.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _batch(self, stage: int, step: int, micro: int) -> torch.Tensor:
        """The ``[batch, length]`` windows of micro-batch ``micro`` of ``step`` (a stage-2 step reads the windows of
        its curriculum phase, indexed from the phase's first step, so a resumed run reads what an uninterrupted one
        would)."""
        if stage == 1:
            key, pool, batch_size, index = (1, 0), self.windows, self.config.batch_size, step
        else:
            phase_index, phase = self.plan.phase_of(step)
            key, pool = (2, phase_index), self.pools[phase.seq_len]
            batch_size, index = phase.batch_size, step - phase.first_step
        samplers = self.__dict__.setdefault("_samplers", {})
        if key not in samplers:  # phase 0's seed is the seed stage 2 had before curricula existed
            samplers[key] = BatchSampler(pool, batch_size, seed=self.config.seed * 10 + stage + 1000 * key[1],
                                         rank=self.rank, world_size=self.world_size)
        batch = samplers[key].batch(index * self.config.grad_accum + micro)
        if stage == 2 and self.config.copy_share > 0:
            generator = copy_generator(self.config.seed, step, micro, self.rank)
            batch = with_copied_spans(batch, self.config.copy_share, self.config.copy_span, generator)
        return batch

    @property
    def sharded(self) -> bool:
        """Whether training runs under FSDP (``parallel: fsdp`` with more than one process)."""
        return self.world_size > 1 and self.config.parallel == "fsdp"

    def _prepare(self, stage: int, module: nn.Module, groups: list[dict], steps: int,
                 make_root: Callable[[nn.Module], nn.Module],
                 units: Callable[[nn.Module], dict[int, nn.Module]]) -> "PreparedStage":
        """Optimizer, resume point and the teacher and student to run for one stage.

        ``module``: what checkpoints name (the aligner, or the peft model); ``groups``: its trainable parameters as
        optimizer groups; ``make_root(module)``: the module whose forward the student pass calls; ``units(module)``:
        layer index -> the module of that layer the student runs, which FSDP shards as a unit (with the teacher's
        block of that layer: :mod:`retrofit.convert.sharding`).
        """
        if not self.sharded:
            params = [p for group in groups for p in group["params"]]
            opt, sched = self._optimizer(groups, steps)
            start = self._resume_point(stage, module, opt, sched)
            root = make_root(module)
            self.running = PreparedStage(self._wrap(root), root, self.dense, lambda run: run(), module, params, opt,
                                         sched, start, lambda: None)
            return self.running
        from retrofit.convert.sharding import frozen_bytes_held, shard_teacher_and_student

        resuming = self.saved is not None and self.saved["stage"] == stage
        if resuming:
            load_trainable_state(module, self.saved["model"])
        pair = shard_teacher_and_student(self.dense, module, [self.dense, self.hybrid], make_root, units)
        self.frozen_bytes_held[stage] = frozen_bytes_held(self.dense, self.hybrid, pair.teacher, pair.student)
        names = {id(p): name for name, p in module.named_parameters()}
        copies = dict(pair.student.named_parameters())
        sharded_groups = [{**group, "params": [copies[names[id(p)]] for p in group["params"]]} for group in groups]
        params = [p for group in sharded_groups for p in group["params"]]
        opt, sched = self._optimizer(sharded_groups, steps)
        start = 0
        if resuming:
            load_sharded_optimizer_state(opt, self.saved["optimizer"])
            sched.load_state_dict(self.saved["scheduler"])
            set_rng_state(self.saved["rng"])
            start = int(self.saved["step"])

        def finish() -> None:
            """Full trained values (all-gathered on every rank) -> the plain parameters of ``module``; the frozen
            weights full again in the dense model and the hybrid."""
            trained_values = trainable_state(pair.student)
            originals = dict(module.named_parameters())
            with torch.no_grad():
                for name, value in trained_values.items():
                    originals[name].copy_(value.to(originals[name].device))
            pair.restore()

        self.running = PreparedStage(pair.student_pass, pair.root.student, pair.teacher, pair.teacher_pass,
                                     pair.student, params, opt, sched, start, finish)
        return self.running

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        # Only what trains is DDP's: the frozen weights and the buffers are the teacher's (equal on every rank, from
        # the same checkpoint), and DDP's broadcasts would write into them.
        untouched = [name for name, p in module.named_parameters() if not p.requires_grad]
        untouched += [name for name, _ in module.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, untouched)
        return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=False, broadcast_buffers=False)

    def _optimizer(self, groups: list[dict], steps: int):
        # On CUDA one fused kernel updates every tensor: the per-tensor loop launched about ten kernels for each of
        # a conversion's ~330 trained tensors, a host-bound step's largest single share. Elsewhere (CPU, FSDP's
        # DTensors) the per-tensor update, whose arithmetic the CPU tests' tolerances were set against.
        fused = self.device.type == "cuda" and not self.sharded
        opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=self.config.weight_decay,
                                **({"fused": True} if fused else {"foreach": False}))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, self.config.warmup))
        return opt, sched

    def _past_deadline(self) -> bool:
        """Whether the time budget is spent (decided on rank 0 and shared, so all ranks stop at the same step; one
        process reads its clock alone, without a device tensor whose read would wait for the device)."""
        import time

        import torch.distributed as dist

        if self.world_size == 1:
            return time.time() > self.deadline
        late = torch.tensor([float(time.time() > self.deadline)], device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.broadcast(late, src=0)
        return bool(late.item())

    def _checkpoint(self, stage: int, next_step: int, module: nn.Module, opt, sched, force: bool = False) -> None:
        if self.config.checkpoint_every == 0 and not force:
            return
        if self.sharded or self.rank == 0:  # under FSDP gathering full tensors is a collective: every rank takes part
            model_state = trainable_state(module)
            optimizer_state = full_optimizer_state(opt) if self.sharded else opt.state_dict()
        if self.rank == 0:
            save_train_state(self.work_dir, {
                "fingerprint": self.fingerprint, "stage": stage, "step": next_step,
                "model": model_state, "optimizer": optimizer_state, "scheduler": sched.state_dict(),
                "rng": rng_state()})
        _barrier()

    def _resume_point(self, stage: int, module: nn.Module, opt, sched) -> int:
        if self.saved is None or self.saved["stage"] != stage:
            return 0
        load_trainable_state(module, self.saved["model"])
        opt.load_state_dict(self.saved["optimizer"])
        sched.load_state_dict(self.saved["scheduler"])
        set_rng_state(self.saved["rng"])
        return int(self.saved["step"])

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A batch of token ids on the training device. To a GPU from pinned memory without blocking: a copy from
        ordinary host memory first waits for everything queued on the device, which would drain the queue the
        host keeps ahead of it at every micro-batch."""
        if self.device.type != "cuda":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def _loop(self, stage: int, steps: int, start: int, step_fn, params, opt, sched, module) -> None:
        """Optimizer steps ``start..steps-1`` of ``stage``; ``step_fn(batch, accumulation)`` runs the forward and
        backward pass of one micro-batch, its loss divided by ``accumulation``, and returns that (detached) loss.
        Step losses stay on the device and are read on the host every :data:`LOSS_READS_EVERY` steps (and when the
        stage ends or pauses): each read waits for the device, and a read per micro-batch kept the host from
        queueing the next step's kernels while the device ran."""
        if steps == 0 or start >= steps:
            return
        bar = None
        if self.show_progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=start, desc=f"stage {stage}: " + ("align layers" if stage == 1 else
                       "distill logits"), unit="step", dynamic_ncols=True)
        unread: list[torch.Tensor] = []  # losses of the steps since the last read

        def read_losses(step: int) -> None:
            if not unread:
                return
            values = torch.stack(unread).tolist()
            unread.clear()
            self.history[f"stage{stage}"].extend(values)
            if bar is not None:
                window = self.config.seq_len if stage == 1 else self.plan.phase_of(step)[1].seq_len
                bar.set_postfix(loss=f"{values[-1]:.4f}", lr=f"{sched.get_last_lr()[0]:.2e}", window=window)

        for step in range(start, steps):
            total = None
            for micro in range(self.config.grad_accum):
                batch = self._to_device(self._batch(stage, step, micro))
                loss = step_fn(batch, self.config.grad_accum)
                total = loss if total is None else total + loss
            if self.config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            unread.append(total.float())
            if len(unread) >= LOSS_READS_EVERY or step + 1 == steps:
                read_losses(step)
            if bar is not None:
                bar.update(1)
            if self.config.checkpoint_every and (step + 1) % self.config.checkpoint_every == 0 and step + 1 < steps:
                self._checkpoint(stage, step + 1, module, opt, sched)
            if self.on_step is not None:
                self.on_step(stage, step)
            if self.deadline is not None and step + 1 < steps and self._past_deadline():
                read_losses(step)
                self._checkpoint(stage, step + 1, module, opt, sched, force=True)
                if bar is not None:
                    bar.close()
                raise TrainingPaused(stage, step + 1)
        if bar is not None:
            bar.close()
            history = self.history[f"stage{stage}"]
            if history:  # one line that survives a log without progress bars
                tail = history[-20:]
                print(f"stage {stage} finished: loss of its first step here {history[0]:.4f}, "
                      f"mean of the last {len(tail)} steps {sum(tail) / len(tail):.4f}", flush=True)

    # ----- stages -----
    def run(self) -> nn.Module:
        """Both stages -> the hybrid (LoRA merged, eval mode, in ``config.frozen_dtype``)."""
        self.dense.eval().requires_grad_(False)
        if self.saved is None:
            from retrofit.convert.init import match_output_scale

            # the same windows on every rank and for any world size (a global batch), so runs agree
            from retrofit.convert.init import calibrate_far_logits

            calibration = self.windows[: self.config.batch_size * self.world_size].to(self.device)
            with self._autocast():
                match_output_scale(self.converted_layers(), self.dense, calibration)
                calibrate_far_logits(self.converted_layers(), self.dense, calibration)
        skip_stage1 = self.saved is not None and self.saved["stage"] == 2
        if not skip_stage1:
            self.stage1()
        model = self.stage2()
        return model.to(self.frozen_dtype).eval()  # trained in float32; saved in the dtype of the frozen weights

    def converted_layers(self) -> dict[int, nn.Module]:
        arch = architecture.of(self.hybrid)
        return {i: arch.attention_module(self.hybrid, i) for i in self.layers}

    def stage1(self) -> None:
        self.hybrid.requires_grad_(False)
        if self.config.stage1_target == "block":  # whole decoder blocks; only their converted attention trains
            blocks = architecture.of(self.hybrid).blocks(self.hybrid)
            aligner = BlockAligner({i: blocks[i] for i in self.layers}).train()
        else:
            aligner = LayerAligner(self.converted_layers()).train()
        for layer in self.converted_layers().values():
            layer.requires_grad_(True)
        params = [p for p in aligner.parameters() if p.requires_grad]
        stage = self._prepare(1, aligner, [{"params": params, "lr": self.config.lr_stage1}], self.plan.stage1_steps,
                              make_root=lambda m: m, units=lambda m: {int(i): layer for i, layer in m.converted.items()})
        if self.config.stage1_target == "block":
            capture = BlockCapture(stage.teacher, self.layers)
        else:
            capture = AttentionCapture(stage.teacher, self.layers)

        def step_fn(batch, accumulation):
            with self._autocast():
                records = stage.teacher_pass(lambda: capture.run(stage.teacher, batch))
            if self.world_size == 1:  # one layer's autograd graph at a time; DDP and FSDP run the aligner whole
                return aligner.backward_layer_by_layer(records, accumulation, self._autocast)
            with self._autocast():
                loss = stage.student(records)
            return _backward(loss, accumulation)

        try:
            self._loop(1, self.plan.stage1_steps, stage.start, step_fn, stage.params, stage.opt, stage.sched,
                       stage.checkpointed)
        finally:
            capture.remove()
        stage.finish()
        self.running = None

    def stage2(self) -> nn.Module:
        torch.manual_seed(self.config.seed + 2)  # LoRA init does not depend on how stage 1 went (resume-safe)
        self.hybrid.requires_grad_(False)
        groups = self.config.lora_target_groups()
        whole_blocks = self.config.finetune_converted_blocks
        trained_whole = own_trained_copies(self.hybrid, directly_trained_names(self.hybrid, self.layers, groups,
                                                                               whole_blocks))
        targets = lora_target_names(self.hybrid, self.layers, groups, whole_blocks)
        use_lora = self.config.lora_rank > 0 and bool(targets) and self.plan.stage2_steps > 0
        model = self.hybrid
        if use_lora:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=self.config.lora_rank, lora_alpha=self.config.lora_alpha, lora_dropout=0.0,
                              target_modules=targets, bias="none")
            with warnings.catch_warnings():  # peft reads transformers' deprecated alias; nothing for the user to do
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                        category=FutureWarning)
                model = get_peft_model(self.hybrid, lora)
        model.train()
        for layer in self.converted_layers().values():
            layer.requires_grad_(True)
        for parameter in trained_whole:
            parameter.requires_grad_(True)
        new_params = [p for layer in self.converted_layers().values() for p in layer.parameters()]
        known = {id(p) for p in new_params} | {id(p) for p in trained_whole}
        lora_params = [p for p in model.parameters() if p.requires_grad and id(p) not in known]
        param_groups = [{"params": new_params, "lr": self.config.lr_stage2}]
        if lora_params:
            param_groups.append({"params": lora_params, "lr": self.config.lr_lora})
        if trained_whole:  # norms and whole converted blocks, on the student's own copies
            param_groups.append({"params": trained_whole, "lr": self.config.lr_whole})
        first = min(self.layers)
        cosine = self.config.hidden_cosine_weight > 0

        def base(m: nn.Module) -> nn.Module:  # the hybrid inside a peft model
            return m.get_base_model() if use_lora else m

        stage = self._prepare(
            2, model, param_groups, self.plan.stage2_steps,
            make_root=lambda m: StudentTail(base(m), first, self.config.checkpoint_activations_from, logits=False,
                                            block_outputs=cosine),
            units=lambda m: {i: block for i, block in enumerate(architecture.of(base(m)).blocks(base(m))) if i >= first})
        student_head = functools.partial(output_logits, stage.student_root.model)  # the hybrid that the pass runs
        teacher_head = functools.partial(output_logits, stage.teacher)
        capture = DecoderInputCapture(stage.teacher, first)
        teacher_blocks = BlockOutputCapture(stage.teacher, first) if cosine else None

        def step_fn(batch, accumulation):
            with self._autocast():
                with torch.no_grad():
                    teacher = stage.teacher_pass(
                        lambda: stage.teacher.base_model(input_ids=batch, use_cache=False).last_hidden_state)
                record = capture.record
                student = stage.student(record["hidden_states"], record["kwargs"])
                if cosine:
                    student, student_blocks = student
                targets = next_token_targets(batch) if self.config.ce_weight > 0 else None
                loss = distillation_loss(student, teacher, student_head, teacher_head, self.config.temperature,
                                         targets, self.config.ce_weight, kl_weight=self.config.kl_weight)
                if cosine:
                    loss = loss + self.config.hidden_cosine_weight * hidden_cosine_loss(student_blocks,
                                                                                        teacher_blocks.outputs)
            return _backward(loss, accumulation)

        try:
            self._loop(2, self.plan.stage2_steps, stage.start, step_fn, stage.params, stage.opt, stage.sched,
                       stage.checkpointed)
        finally:
            capture.remove()
            if teacher_blocks is not None:
                teacher_blocks.remove()
        stage.finish()
        self.running = None
        # AdamW state (and under FSDP the stage's copies of both models) freed before the merge
        stage = student_head = teacher_head = None
        if use_lora:
            model = merge_lora(model, self.frozen_dtype)
        model.requires_grad_(False)
        return model


def own_trained_copies(model: nn.Module, names: list[str]) -> list[nn.Parameter]:
    """Give ``model`` its own float32 copy of each named parameter (a new ``Parameter`` in its module, frozen until
    the caller lets it train) and return them: a student built on the teacher's tensors then trains these weights
    without writing the teacher's (or a caller's model's)."""
    copies = []
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        copy = nn.Parameter(getattr(module, attribute).detach().to(torch.float32, copy=True), requires_grad=False)
        setattr(module, attribute, copy)
        copies.append(copy)
    return copies


def merge_lora(peft_model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The base model of ``peft_model`` with every LoRA adapter merged, one adapted layer at a time: its weight is
    replaced by an own float32 copy, the adapter's update is added there, and the sum is stored in ``dtype`` (rounded
    once). The weights the model held before (possibly the teacher's, or a caller's model's) are never written, and
    one layer's float32 copy exists at a time."""
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            layer = module.get_base_layer()
            layer.weight = nn.Parameter(layer.weight.detach().to(torch.float32, copy=True), requires_grad=False)
            module.merge()
            layer.weight = nn.Parameter(layer.weight.detach().to(dtype), requires_grad=False)
    return peft_model.unload()  # the adapters removed; the merged weights stay
