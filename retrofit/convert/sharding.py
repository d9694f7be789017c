"""FSDP2 under ``parallel: fsdp``: every weight of the teacher and the student sharded once over the processes.

The student holds the teacher's frozen weights (:func:`retrofit.convert.build.to_hybrid` with ``share_weights``), so
one set of shards serves both passes. A stage shards a copy of the teacher and of the module it trains (the copies'
modules hold the originals' frozen tensors, so nothing is copied), in which each frozen tensor of the student is the
teacher's own ``Parameter`` object: FSDP then manages it once and swaps its sharded and all-gathered forms into both
models' modules. Units, one per decoder layer:

- where the student runs a module of layer ``i`` (a converted attention in stage 1, a decoder block in stage 2), that
  module is the unit, with the teacher's block ``i`` attached while ``fully_shard`` gathers the unit's parameters; the
  student reaches the unit through FSDP's own forward and backward hooks, the teacher through hooks on its block that
  all-gather the unit before the block and free it after;
- elsewhere the teacher's block ``i`` is the unit (the student does not run that layer).

The root (:class:`TeacherAndStudent`) holds what no unit holds: the embeddings, the final norm and the LM head, which
both passes of a step run through its forward. Once sharded, the originals' frozen tensors are released (their
``Parameter`` objects kept, emptied), and :meth:`ShardedPair.restore` gives them back their full values at the end of
the stage: the hybrid, the dense model (possibly the caller's) and LoRA's merge see plain full tensors again.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from retrofit import architecture


class TeacherAndStudent(nn.Module):
    """FSDP's root: the teacher and the student's root as children (one root group for what both read outside the
    decoder layers), and a forward that runs either pass (``run(*args, **kwargs)``), so that FSDP all-gathers the
    root's shards for each."""

    def __init__(self, teacher: nn.Module, student: nn.Module):
        super().__init__()
        self.teacher, self.student = teacher, student

    def forward(self, run: Callable, *args, **kwargs):
        return run(*args, **kwargs)


def _storage_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensors the same memory: storage, offset, shape, strides, dtype."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
            tensor.dtype)


@contextlib.contextmanager
def _attached(unit: nn.Module, companion: nn.Module):
    """``companion`` registered as a child of ``unit`` for the duration (so ``fully_shard(unit)`` manages its
    parameters and swaps them in its modules too); the unit's own module tree is unchanged afterwards."""
    name = "_fsdp_companion"
    unit.add_module(name, companion)
    try:
        yield
    finally:
        del unit._modules[name]


def frozen_bytes_held(*modules: nn.Module) -> int:
    """Bytes of memory held by the frozen parameters of ``modules``, each storage counted once: of an FSDP-sharded
    parameter, this process's shard (padding included); of a plain one, its whole storage."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for module in modules:
        for parameter in module.parameters():
            if parameter.requires_grad:
                continue
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass
class ShardedPair:
    """A stage's teacher and student under FSDP. ``root`` runs both passes; ``teacher`` and ``student`` are the
    sharded copies (the teacher computes the dense function, the student is the module the stage trains)."""

    root: TeacherAndStudent
    teacher: nn.Module
    student: nn.Module
    shared_units: list[nn.Module] = field(default_factory=list)  # units the teacher reaches through its hooks
    released: list[tuple[str, list[nn.Parameter]]] = field(default_factory=list)  # teacher name -> emptied originals

    def teacher_pass(self, run: Callable[[], Any]) -> Any:
        """``run()`` (the teacher's pass) through the root; every unit freed afterwards (a pass stopped early by an
        exception, as the stage-1 captures stop it, skips its last block's hook)."""
        result = self.root(run)
        for unit in self.shared_units:
            unit.reshard()
        return result

    def student_pass(self, *args, **kwargs) -> Any:
        """The student root's forward (``args``, ``kwargs``) through FSDP's root."""
        return self.root(self.root.student, *args, **kwargs)

    def restore(self) -> None:
        """Give the originals' frozen parameters their full values (all-gathered: a collective, every rank calls
        this), shared again by the dense model and the hybrid as before."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        sharded = dict(self.teacher.named_parameters())
        with torch.no_grad():
            for name, originals in self.released:
                full = sharded[name].detach().full_tensor()
                for original in originals:
                    original.data = full


def shard_teacher_and_student(teacher: nn.Module, module: nn.Module, originals: list[nn.Module],
                              make_root: Callable[[nn.Module], nn.Module],
                              student_units: Callable[[nn.Module], dict[int, nn.Module]]) -> ShardedPair:
    """Shard ``teacher`` (the dense model) and ``module`` (what a stage trains, holding the teacher's frozen tensors)
    once over the processes (the module docstring says how), then release the full frozen tensors that
    ``originals`` (the dense model, the hybrid) hold.

    ``make_root(student)``: the module whose forward the student pass calls; ``student_units(student)``: layer index
    -> the module of that layer that the student runs (a unit of its own). Returns the :class:`ShardedPair`.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    frozen = {p for p in module.parameters() if not p.requires_grad} | set(teacher.parameters())
    teacher_copy, student = copy.deepcopy((teacher, module), memo={id(p): p for p in frozen})
    by_storage = {_storage_key(p): p for p in teacher_copy.parameters()}
    for submodule in student.modules():
        for name, parameter in list(submodule._parameters.items()):
            if parameter is not None and not parameter.requires_grad:
                twin = by_storage.get(_storage_key(parameter))
                if twin is not None:
                    submodule._parameters[name] = twin  # the teacher's object: one FSDP parameter, one set of shards
    keys = {_storage_key(p): name for name, p in teacher_copy.named_parameters()}
    holders: dict[str, dict[int, nn.Parameter]] = {}  # teacher name -> the originals holding its tensor, by id
    for original in originals:
        for parameter in original.parameters():
            name = keys.get(_storage_key(parameter))
            if name is not None and not parameter.requires_grad:
                holders.setdefault(name, {})[id(parameter)] = parameter
    released = [(name, list(parameters.values())) for name, parameters in holders.items()]

    root = TeacherAndStudent(teacher_copy, make_root(student))
    units = student_units(student)
    in_units: set[nn.Parameter] = set()
    pair = ShardedPair(root, teacher_copy, student, released=released)
    for index, block in enumerate(architecture.of(teacher_copy).blocks(teacher_copy)):
        unit = units.get(index)
        if unit is None:
            in_units.update(block.parameters())
            fully_shard(block)
            continue
        with _attached(unit, block):
            in_units.update(unit.parameters())
            fully_shard(unit)
        block.register_forward_pre_hook(lambda *_, unit=unit: unit.unshard())
        block.register_forward_hook(lambda *_, unit=unit: unit.reshard())
        pair.shared_units.append(unit)
    # The student's copies of layers it does not run still hold the teacher's objects that a unit now manages (the
    # unit swapped only the teacher's modules): the root leaves them, and they are emptied below with the originals
    ignored = {p for p in root.parameters() if p in in_units or isinstance(p, DTensor)}
    fully_shard(root, ignored_params=ignored)
    for _, parameters in released:
        for parameter in parameters:
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
    return pair
