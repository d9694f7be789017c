"""``convert``: dense model -> selected layers -> hybrid initialised from attention -> distilled -> saved.

    from retrofit.convert.pipeline import convert
    convert("smollm2-135m", to="gdn", layers="every:4", data=["calib/"], tokens=2_000_000, out="hybrid/")
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from retrofit.convert.recipe import load_recipe
from retrofit.devices import parse_dtype
from retrofit.errors import RetrofitError


def _refuse_options_that_do_nothing(given: dict, config) -> None:
    """Options given for this run (CLI or keyword) that this run would ignore are refused in one line."""
    if given.get("parallel") is not None and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise RetrofitError(f"--parallel {given['parallel']} applies under torchrun (several processes); this run "
                            "has one process")
    if given.get("lr_lora") is not None and config.lora_rank == 0:
        raise RetrofitError("--lr-lora applies to LoRA, which --lora-rank 0 turns off")


def _refuse_what_the_family_cannot_take(config, spec) -> None:
    """A family retrofit cannot convert (no record, a hybrid already, an option its converted layers do not carry) is
    refused in one line, before any weight is loaded; so is ``use_rope`` where the family rotates q and k in a way
    converted layers do not."""
    from retrofit.hybrid import conversion_refusal

    refusal = conversion_refusal(config)
    if refusal is not None:
        raise RetrofitError(f"cannot convert: {refusal}")
    _refuse_layer_options_the_family_cannot_take(spec, config)


def _refuse_layer_options_the_family_cannot_take(spec, config) -> None:
    """``use_rope`` rotates q and k as Llama does (halves, on the family's rotary channels): refused in one line for a
    family that rotates adjacent pairs or leaves some layers unrotated. A softmax ``window`` rotates its q and k as
    the replaced layer did, by halves too: refused for a family that rotates adjacent pairs."""
    from retrofit import architecture

    arch = architecture.of(config)
    text = architecture.text_config(config)
    if spec.window and arch.rotary_interleaved:
        raise RetrofitError(f"layer_spec window: {arch.model_type} rotates q and k by adjacent pairs, which the "
                            "window inside a converted layer does not reproduce; convert without window")
    if not spec.use_rope:
        return
    if arch.rotary_interleaved or any(layer.rotary_dims == 0 for layer in arch.layers(text)):
        raise RetrofitError(f"layer_spec use_rope: {arch.model_type} rotates q and k in a way converted layers do not "
                            "(adjacent pairs, or some layers without rotation); convert without use_rope")


def _check_precision(config, device: torch.device) -> None:
    """Frozen weights in bfloat16 need bf16 autocast (the float32 layers that train read bfloat16 activations):
    refused in one line when this run would not autocast (``bf16`` unset means: on CUDA only)."""
    autocast = config.bf16 if config.bf16 is not None else device.type == "cuda"
    if config.frozen_dtype != "float32" and not autocast:
        raise RetrofitError(f"frozen_dtype {config.frozen_dtype} needs bf16 autocast, which is off on {device.type} "
                            "unless the recipe sets bf16: true")


def _init_distributed(device: str | None) -> torch.device:
    """Under torchrun, start the process group (NCCL on GPU) and return this rank's device."""
    import torch.distributed as dist

    from retrofit.devices import parse_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and dist.is_available() and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
            torch.cuda.set_device(local)
            dist.init_process_group("nccl")
            return torch.device("cuda", local)
        dist.init_process_group("gloo")
    if dist.is_available() and dist.is_initialized() and torch.cuda.is_available() and str(device or "cuda").startswith("cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return parse_device(device)


def _resolved_settings(recipe, model, preloaded, given: dict, overrides: dict):
    """The recipe with the arguments and options given applied, checked -> ``(settings, layer type, DistillConfig,
    LinearAttentionSpec)``; RetrofitError in one line on a bad value."""
    from retrofit.convert.distill import DistillConfig
    from retrofit.convert.select_settings import SelectSettings
    from retrofit.layers import LAYER_TYPES, LinearAttentionSpec

    settings = load_recipe(recipe)
    settings.update({k: v for k, v in {"model": None if preloaded else model, **given}.items() if v is not None})
    settings.update({k: v for k, v in overrides.items() if v is not None})
    kind = settings.get("to") or "gdn"
    LAYER_TYPES.get(kind)  # RetrofitError with a suggestion on an unknown layer type
    if settings.get("tokens") is not None and int(settings["tokens"]) <= 0:
        raise RetrofitError(f"--tokens must be > 0, got {settings['tokens']}")
    settings["select"] = SelectSettings.from_mapping(settings.get("select"))  # a bad select: fails before model work
    distill_values = {k: settings[k] for k in DistillConfig.field_names() if k in settings}
    try:
        config = DistillConfig(**distill_values)
        spec = LinearAttentionSpec.from_dict(settings.get("layer_spec") or {})
    except (TypeError, ValueError) as err:
        raise RetrofitError(f"bad setting: {err}") from None
    return settings, kind, config, spec


def _model_config(settings: dict, preloaded, named: bool):
    """The transformers config of the model to convert, without loading a weight: a preloaded model's, a named
    configuration's (``retrofit.model_configs``, when ``named``), else what :func:`retrofit.load.load_config` reads."""
    from retrofit.load import load_config
    from retrofit.model_configs import MODEL_CONFIGS

    if preloaded is not None:
        return preloaded[0].config
    if not settings.get("model"):
        raise RetrofitError("no model given (MODEL argument or `model:` in the recipe)")
    if named and settings["model"] in MODEL_CONFIGS:
        return MODEL_CONFIGS.get(settings["model"])()
    return load_config(settings["model"])


def _memory_plan(model_config, settings: dict, kind: str, spec, config, device: torch.device,
                 device_memory: int | None, world: int):
    """The memory plan (:func:`retrofit.convert.memory.plan_memory`) of this run's layers and settings."""
    from retrofit.convert.memory import device_memory_of, plan_memory
    from retrofit.convert.selection import layer_count, parse_layer_spec

    text = model_config.get_text_config(decoder=True)
    num_layers = int(text.num_hidden_layers)
    parsed = parse_layer_spec(str(settings.get("layers") or "every:4"), num_layers)
    if device_memory is None and (device.type != "cuda" or torch.cuda.is_available()):
        device_memory = device_memory_of(device)
    return plan_memory(model_config, None if parsed.needs_scoring else list(parsed.indices), kind, spec, config,
                       world, device, device_memory, str(settings.get("model") or ""),
                       layer_count(parsed.fraction, num_layers) if parsed.needs_scoring else 0)


def plan(model, to: str | None = None, layers: str | None = None, tokens: int | None = None,
         recipe: str | None = None, device: str | None = None, device_memory: int | str | None = None,
         **overrides):
    """What :func:`convert` with the same arguments would hold in memory, worked out without loading any weight
    (the model is built from its config on the meta device) -> :class:`retrofit.convert.memory.MemoryPlan`.

    ``model`` may also name a configuration of :data:`retrofit.model_configs.MODEL_CONFIGS` (``llama3-8b``,
    ``qwen2.5-7b``, ...). ``device``: the device the run would use; it need not be present here (a plan for a GPU
    made on a laptop). ``device_memory``: bytes or a size like ``"80GiB"`` (default: the device's, where known).
    The number of processes is ``WORLD_SIZE`` (as torchrun sets it; 1 without). RetrofitError on a bad setting.
    """
    from retrofit.convert.memory import parse_memory_size

    preloaded = model if isinstance(model, tuple) else None
    settings, kind, config, spec = _resolved_settings(recipe, model, preloaded,
                                                      {"to": to, "layers": layers, "tokens": tokens, "device": device},
                                                      overrides)
    try:
        torch_device = torch.device(settings.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as err:
        raise RetrofitError(f"unknown device {settings.get('device')!r} ({err})") from None
    _check_precision(config, torch_device)
    memory = None if device_memory is None else parse_memory_size(device_memory)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_config = _model_config(settings, preloaded, named=True)
    _refuse_what_the_family_cannot_take(model_config, spec)
    return _memory_plan(model_config, settings, kind, spec, config, torch_device, memory, world)


def convert(model, to: str | None = None, layers: str | None = None, data: list[str] | None = None,
            out: str | os.PathLike | None = None, tokens: int | None = None, recipe: str | None = None,
            resume: bool = False, overwrite: bool = False, device: str | None = None, show_progress: bool = True,
            on_step: Callable[[int, int], None] | None = None, max_minutes: float | None = None,
            device_memory: int | str | None = None, **overrides) -> Path:
    """Convert ``model`` to a hybrid and save it to ``out`` (returns ``out``).

    ``model``: anything :func:`retrofit.load` takes (directory, .gguf, hub id, alias), or an already loaded
    ``(model, tokenizer)`` pair in the dtype of ``frozen_dtype`` (float32 unless asked), left unchanged: the student
    holds its weights without writing them (the teacher is the model itself), and its own copies only of what it
    changes (the converted layers, the weights LoRA is merged into).

    Arguments left None come from the ``recipe`` (YAML); ``overrides`` are DistillConfig fields (CLI options).
    ``max_minutes``: after this many minutes of training the run writes a checkpoint and raises
    :class:`retrofit.convert.distill.TrainingPaused` (rerun with ``resume=True`` to continue).
    ``device_memory`` (bytes, or a size like ``"80GiB"``): the run's memory plan (:func:`plan`) must fit it, else
    the run is refused before the model loads; ``checkpoint_activations_from: auto`` reads it (default: the
    device's memory).
    Raises :class:`RetrofitError` on bad input: unknown ``to``, bad ``layers``, empty data, ``tokens <= 0``,
    an existing ``out`` without ``overwrite``, an unsupported attention layout, a plan over ``device_memory``.
    """
    from retrofit.convert.data import calibration_files
    from retrofit.convert.memory import parse_memory_size, resolved_checkpointing
    from retrofit.load import load

    preloaded = model if isinstance(model, tuple) else None
    if out is None:
        raise RetrofitError("no output directory: pass --out DIR")
    out = Path(out)
    settings, kind, config, spec = _resolved_settings(
        recipe, model, preloaded, {"to": to, "layers": layers, "data": data, "tokens": tokens, "device": device},
        overrides)
    if out.exists() and not overwrite:
        raise RetrofitError(f"output directory {out} exists; pass --overwrite to replace it")
    if resume:
        from retrofit.convert.checkpoint import STATE_FILE, work_dir_for

        if not (work_dir_for(out) / STATE_FILE).is_file():
            raise RetrofitError(f"--resume: nothing to resume, {work_dir_for(out) / STATE_FILE} does not exist "
                                "(run without --resume to start the conversion)")
    data_paths = settings.get("data")
    if isinstance(data_paths, str):
        data_paths = [data_paths]
    files = calibration_files(data_paths or [])
    _refuse_options_that_do_nothing(overrides, config)
    if preloaded is not None or settings.get("model"):  # before any weight is loaded
        _refuse_what_the_family_cannot_take(_model_config(settings, preloaded, named=False), spec)
    memory = None if device_memory is None else parse_memory_size(device_memory)

    import time

    deadline = None if max_minutes is None else time.time() + 60 * float(max_minutes)
    import torch.distributed as dist

    group_was_open = dist.is_available() and dist.is_initialized()
    torch_device = _init_distributed(settings.get("device"))
    _check_precision(config, torch_device)
    run_config = config
    if memory is not None or config.checkpoint_activations_from == "auto":  # the plan, before any weight loads
        from retrofit.convert.distill import distributed

        memory_plan = _memory_plan(_model_config(settings, preloaded, named=False), settings, kind, spec, config,
                                   torch_device, memory, distributed()[1])
        if memory is not None and memory_plan.refusal():
            raise RetrofitError(memory_plan.refusal())
        run_config = dataclasses.replace(config, checkpoint_activations_from=resolved_checkpointing(memory_plan))
    if preloaded is not None:
        dense, tokenizer = preloaded
        held = next(dense.parameters()).dtype
        if held != parse_dtype(config.frozen_dtype):
            raise RetrofitError(f"the preloaded model is in {str(held).removeprefix('torch.')} and frozen_dtype is "
                                f"{config.frozen_dtype}: pass a model loaded in {config.frozen_dtype}, or its name")
        dense = dense.to(torch_device)
        settings.setdefault("model", getattr(dense.config, "_name_or_path", "") or type(dense).__name__)
    else:
        if not settings.get("model"):
            raise RetrofitError("no model given (MODEL argument or `model:` in the recipe)")
        dense, tokenizer = load(settings["model"], dtype=config.frozen_dtype, device=torch_device)
    grad_flags = {name: p.requires_grad for name, p in dense.named_parameters()}
    try:
        return _convert_loaded(dense, tokenizer, settings, kind, files, config, run_config, spec, torch_device, out,
                               resume, overwrite, show_progress, on_step, deadline)
    finally:
        for name, p in dense.named_parameters():
            p.requires_grad_(grad_flags[name])
        if not group_was_open and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # the group this call started (left open at exit, NCCL warns of a leak)


def _mean_of_last(losses: list[float], count: int) -> float | None:
    """The mean of the last ``count`` step losses (None without any): steadier than the last step's alone."""
    tail = losses[-count:]
    return sum(tail) / len(tail) if tail else None


def _convert_loaded(dense, tokenizer, settings, kind, files, config, run_config, spec, torch_device, out, resume,
                    overwrite, show_progress, on_step, deadline) -> Path:
    """The conversion once the model is loaded. ``config``: the settings as given (what the checkpoint fingerprint
    and the hybrid's record keep); ``run_config``: the same with ``checkpoint_activations_from: auto`` resolved."""
    from retrofit.convert.checkpoint import SELECTION_FILE, save_selection, selection_of_earlier_run, work_dir_for
    from retrofit.convert.data import token_windows
    from retrofit.convert.distill import Distiller, Plan, distributed
    from retrofit.convert.build import to_hybrid
    from retrofit.convert.selection import choose, explain_choice, parse_layer_spec, rank_layers, ranking_table
    from retrofit.hybrid import HybridSection, save_hybrid
    from retrofit.model_info import attention_layout, max_model_length

    rank, world = distributed()
    layout = attention_layout(dense)
    parsed = parse_layer_spec(str(settings.get("layers") or "every:4"), layout.num_layers)
    plan = Plan.from_config(config, world)
    select = settings["select"]
    extra = select.align_steps * select.batch_size + select.probe_windows if parsed.needs_scoring else 0
    data = [str(f) for f in files]
    limit = max_model_length(dense)
    if config.longest_window > limit:
        raise RetrofitError(f"windows of {config.longest_window} tokens (seq_len / stage2_lengths) are over the model's "
                            f"limit of {limit} positions (max_position_embeddings)")
    pools = {}
    for length, count in plan.windows_needed(config, world).items():  # seq_len first: the scorer's windows too
        more = extra if length == config.seq_len else 0
        pools[length] = token_windows(tokenizer, data, count + more, length,
                                      seed=config.seed + (0 if length == config.seq_len else length),
                                      show_progress=show_progress and rank == 0)
    windows = pools[config.seq_len]
    run_key = {"model": str(settings["model"]), "to": kind,
               "data": [f"{f}:{f.stat().st_size}" for f in files], "config": config.to_dict(),
               "layer_spec": spec.to_dict(), "world_size": world}
    work_dir = work_dir_for(out)
    if parsed.needs_scoring:
        scored_from = {**run_key, "layers": str(settings.get("layers")), "select": dataclasses.asdict(select)}
        chosen = selection_of_earlier_run(work_dir, scored_from) if resume else None
        if chosen is not None:
            if rank == 0 and show_progress:
                print(f"layers {', '.join(map(str, chosen))}: scored when this run started "
                      f"({work_dir / SELECTION_FILE})")
        else:
            ranking = rank_layers(dense, tokenizer, windows, data, kind, select, device=torch_device,
                                  show_progress=show_progress and rank == 0)
            chosen = choose(ranking.scores, parsed.fraction, layout.num_layers, select.max_run)
            if rank == 0:
                save_selection(work_dir, scored_from, chosen)
                if show_progress:
                    print(ranking_table(ranking.scores, chosen))
                    print(ranking.summary())
                    print(explain_choice(ranking.scores, chosen, layout.num_layers, select.retrieval_weight,
                                         select.copy_weight, parsed.fraction, select.max_run))
    else:
        chosen = list(parsed.indices)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # every rank converts rank 0's choice
        shared = [chosen]
        dist.broadcast_object_list(shared, src=0)
        chosen = shared[0]

    from retrofit import architecture

    section = HybridSection(layers=chosen, layer_type=kind, base_model_type=architecture.base_model_type(dense.config),
                            layer_spec=spec.to_dict())
    hybrid = to_hybrid(dense, section, share_weights=True, layer_dtype=torch.float32)  # the frozen weights: dense's
    fingerprint = {**run_key, "layers": chosen}
    distiller = Distiller(dense, hybrid, chosen, run_config, pools, work_dir, fingerprint, torch_device,
                          resume=resume, show_progress=show_progress, on_step=on_step, deadline=deadline)
    model = distiller.run()
    section.distillation = {"tokens": config.tokens, "stage1_steps": distiller.plan.stage1_steps,
                            "stage2_steps": distiller.plan.stage2_steps, "tokens_per_step": distiller.plan.tokens_per_step,
                            "stage2_phases": distiller.plan.describe(),
                            "tokens_trained": distiller.plan.tokens_trained,
                            "final_loss_stage1": (distiller.history["stage1"] or [None])[-1],
                            "final_loss_stage2": (distiller.history["stage2"] or [None])[-1],
                            "mean_loss_stage2_last20": _mean_of_last(distiller.history["stage2"], 20),
                            "settings": config.to_dict()}
    model.config.retrofit = section.to_dict()
    if rank == 0:
        save_hybrid(model, tokenizer, out, overwrite=overwrite)
        shutil.rmtree(work_dir, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out
