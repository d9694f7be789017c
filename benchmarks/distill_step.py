"""What one distillation step costs: milliseconds per step, tokens per second, peak memory and model FLOPs utilisation
(timed), and host synchronisations and aten operations per optimizer step (counted, CPU), for stage 1 and for stage 2
at each window length of a long-window recipe, for the reference model or any named configuration's shapes.

The default setting is the one of `recipes/smollm2-135m/kda-8of30-*.yaml`: SmolLM2-135M with layers 11, 12 and 24-29
turned into KDA, micro-batches of 8 windows of 1,024 tokens (stage 2 keeps the tokens per micro-batch: 2 windows of
4,096, 1 of 8,192), 2 micro-batches a step, bf16 autocast on CUDA. The calibration windows are random tokens: what a
step costs does not depend on the text. The student holds the dense model's frozen weights (in ``--frozen-dtype``:
bfloat16 on CUDA by default) and trains float32 layers and adapters, as ``retrofit convert`` does.

    python benchmarks/distill_step.py                              # CPU: counts per step, the real SmolLM2, 64-token
                                                                   # windows (the counts do not depend on the length)
    python benchmarks/distill_step.py --device cuda --random       # H200: ms per step at 1K/4K/8K, random weights of
                                                                   # SmolLM2-135M's shapes, + kernel launches per step
    python benchmarks/distill_step.py --device cuda --model llama3-8b --layer-type gdn --batch-size 4 --grad-accum 1 \
        --windows 4096,8192                                        # Llama-3-8B's shapes, 3 of 4 layers (not:every:4)
    ... --batch-size 16 --grad-accum 1                             # the same tokens per step in one micro-batch
    ... --layers 3-6,9,11-13,16,24-29 --layer-type kda             # another hybrid (here kda-15of30's layers)
    ... --retrofit-from DIR                                        # import retrofit from DIR (an older checkout), to
                                                                   # measure a change side by side
    ... --model qwen2.5-0.5b --layers 2,5,8,11,14,17               # another model: an alias or a model directory;
                                                                   # with --random only its config.json is read, so a
                                                                   # directory holding that file alone will do (a GPU
                                                                   # machine without the checkpoint)

``--model`` takes a named configuration (``llama3-8b``, ``qwen2.5-7b``, ``smollm2-135m``: random weights of its
shapes) or anything ``retrofit.load`` loads (the reference model's alias, a directory); ``--random`` gives random
weights of the reference model's shapes. ``--layers`` defaults to the recipe's layers for SmolLM2 and to 3 of 4
layers (``not:every:4``) elsewhere. ``--checkpoint-activations-from`` (default ``auto``: by the memory plan, against
the device's memory) is reported per row.

A step is timed over ``--steps`` steps after ``--warmup`` (the device synchronised only at both ends, so a loop that
keeps the host ahead of the device is timed as it runs). Peak memory is CUDA's ``max_memory_allocated`` since the
stage started, or on the CPU the process's peak resident set since then (reset through ``/proc/self/clear_refs``),
beside the memory plan's peak for that stage and window (``retrofit.convert.memory``). Model FLOPs per token are
the matrix products of the step: the teacher's forward (2 FLOPs per weight), the student's forward and backward
from its first converted layer (4 per weight: the backward's input gradients), the weight gradients of what trains
(2 per trained weight), a recomputed forward under activation checkpointing (2 per weight), softmax attention's
scores and values (causal: 2 T d per head and layer forward, twice that backward) and the LM heads; the linear
attention's recurrence (O(T d^2) per head) is not counted. MFU divides them by ``--peak-tflops`` (default: 989 for
H100 / H200 bf16 dense, the data sheets'; none on the CPU).

Counted steps run inside a ``DispatchCount`` (``retrofit.bench.overhead``): ``syncs`` are host reads of tensor values
(``.item()``, ``float(tensor)``, copies to the host). On a GPU a read of a device value stalls the host until the
device has finished everything queued; on the CPU the count also holds reads of values a GPU run keeps on the host
(the off-CUDA AdamW's step counters, one per trained tensor; the sampler's permutation), so there it bounds the
GPU's count from above. A copy of a batch from ordinary (pageable) host memory to the GPU also waits for the device,
which a CPU count cannot see: the loop pins batches and copies them without blocking. On CUDA, ``--profile`` counts
the kernels and copies a step launches (torch.profiler): with a model this small the step is bound by the host's
launches, so those set its time. Results in BENCHMARKS.md, "Current figures > Conversion".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch


def _import_path(argv: list[str]) -> Path:
    """The folder to import retrofit from: ``--retrofit-from DIR`` or this checkout (read before argparse, because
    the imports below must come from it)."""
    if "--retrofit-from" in argv:
        return Path(argv[argv.index("--retrofit-from") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(_import_path(sys.argv)))

from retrofit.atomic import write_json  # noqa: E402
from retrofit.bench.overhead import DispatchCount  # noqa: E402
from retrofit.convert.build import to_hybrid  # noqa: E402
from retrofit.convert.distill import Distiller  # noqa: E402
from retrofit.convert.plan import DistillConfig  # noqa: E402
from retrofit.convert.selection import parse_layer_spec  # noqa: E402
from retrofit.bench.configs import MODEL_CONFIGS  # noqa: E402
from retrofit.hybrid import HybridSection  # noqa: E402
from retrofit.memory import peak_memory_so_far, reset_peak_memory  # noqa: E402

LAYERS = "11,12,24-29"  # what the scored selector chose for the kda-8of30* recipes


class StepClock:
    """``on_step`` callback: synchronises and reads the clock after step ``warmup - 1`` and after the last measured
    step of each stage; with ``count`` the steps in between run inside a ``DispatchCount``."""

    def __init__(self, device: torch.device, warmup: int, steps: int, count: bool):
        self.device, self.warmup, self.steps, self.count = device, warmup, steps, count
        self.results: dict[int, dict] = {}
        self._start: float | None = None
        self._counter: DispatchCount | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, stage: int, step: int) -> None:
        if step == self.warmup - 1:
            self._sync()
            self._start = time.perf_counter()
            if self.count:
                self._counter = DispatchCount()
                self._counter.__enter__()
        elif step == self.warmup + self.steps - 1:
            if self._counter is not None:
                self._counter.__exit__(None, None, None)
            self._sync()
            seconds = time.perf_counter() - self._start
            result = {"ms_per_step": 1000 * seconds / self.steps}
            if self._counter is not None:
                result.update(ops=self._counter.ops / self.steps, kernels=self._counter.kernels / self.steps,
                              syncs=self._counter.syncs / self.steps, sync_names={
                                  k: v / self.steps for k, v in self._counter.sync_names.items()})
                self._counter = None
            self.results[stage] = result


def _hybrid(dense, section):
    """The student as ``retrofit convert`` builds it: the dense model's frozen tensors shared, float32 converted
    layers (an older checkout, ``--retrofit-from``: the copy it built)."""
    try:
        return to_hybrid(dense, section, share_weights=True, layer_dtype=torch.float32)
    except TypeError:
        return to_hybrid(dense, section, share_weights=False)


def one_stage(dense, args, device: torch.device, stage: int, window: int) -> dict:
    """Runs ``warmup + steps`` optimizer steps of ``stage`` (stage 2 on windows of ``window`` tokens) and returns the
    clock's figures for the measured steps, with the peak memory of the stage."""
    seq_len = args.seq_len
    per_step = args.batch_size * args.grad_accum * seq_len
    steps = args.warmup + args.steps
    config = DistillConfig(tokens=steps * per_step * (1 if stage == 1 else 2), seq_len=seq_len,
                           batch_size=args.batch_size, grad_accum=args.grad_accum,
                           stage1_fraction=1.0 if stage == 1 else 0.5, stage2_lengths=f"{window}:1",
                           lr_stage2=1e-3, lr_lora=6e-4, lora_rank=16, lora_alpha=32, checkpoint_every=0, seed=2,
                           checkpoint_activations_from=args.checkpoint_from, **args.precision)
    planned = _planned_row(dense, args, config, device, stage, window)
    if planned is not None:
        config = dataclasses.replace(config, checkpoint_activations_from=planned.window if planned.checkpointed else 0)
    generator = torch.Generator().manual_seed(0)
    vocab = dense.config.vocab_size
    per_micro = max(1, args.batch_size * seq_len // window)
    pools = {seq_len: torch.randint(vocab, (args.batch_size * args.grad_accum * steps, seq_len), generator=generator),
             window: torch.randint(vocab, (per_micro * args.grad_accum * steps, window), generator=generator)}
    layers = list(parse_layer_spec(args.layers, dense.config.num_hidden_layers).indices)
    section = HybridSection(layers=layers, layer_type=args.layer_type, base_model_type=dense.config.model_type)
    reset_peak_memory(device)
    hybrid = _hybrid(dense, section)
    clock = StepClock(device, args.warmup, args.steps, count=args.count)
    distiller = Distiller(dense, hybrid, layers, config, pools, Path(args.work_dir), {"benchmark": True}, device,
                          show_progress=False, on_step=clock)
    if stage == 1:
        distiller.stage1()
    else:  # no stage 1: stage 2 straight from the attention-initialised layers
        distiller.stage2()
    peak, _ = peak_memory_so_far(device)
    del distiller, hybrid
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {**clock.results[stage], "peak_memory_bytes": peak, "windows_per_micro_batch": per_micro if stage == 2 else
            args.batch_size, "checkpointed": bool(planned and planned.checkpointed),
            "planned_peak_bytes": planned.peak if planned is not None else None,
            "model_flops_per_step": step_flops(dense, layers, config, stage, window, bool(planned and
                                                                                   planned.checkpointed))}


def _planned_row(dense, args, config, device: torch.device, stage: int, window: int):
    """The memory plan's row of this stage and window (None from a checkout without the plan, ``--retrofit-from``)."""
    try:
        from retrofit.convert.memory import device_memory_of, plan_memory
        from retrofit.layers import LinearAttentionSpec
    except ImportError:
        return None
    layers = list(parse_layer_spec(args.layers, dense.config.num_hidden_layers).indices)
    memory = plan_memory(dense.config, layers, args.layer_type, LinearAttentionSpec(), config, 1, device,
                         device_memory_of(device))
    wanted = "stage 1" if stage == 1 else "stage 2"
    return next(row for row in memory.rows if row.stage == wanted and (stage == 1 or row.window == window))


def _linear_weights(module: torch.nn.Module) -> int:
    """Weights of the matrix products of ``module`` (its ``nn.Linear`` layers)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def step_flops(dense, layers: list[int], config, stage: int, window: int, checkpointed: bool) -> float:
    """Model FLOPs of one optimizer step (the module docstring says what is counted): per token, 2 per weight of a
    forward, 2 per weight for a backward's input gradients and 2 more for its weight gradients, on the dense model's
    shapes (a converted layer's products are about its attention's: q, k, v, o plus its gates)."""
    from retrofit.convert.objectives import lora_target_names
    from retrofit.layers.spec import AttentionShape

    shape = AttentionShape.from_config(dense.config)
    blocks = dense.model.layers
    head = dense.lm_head.weight.numel()
    attention = 2 * window * shape.head_dim * shape.num_heads  # causal QK^T and AV of one token, forward, one layer
    if stage == 1:
        tokens = config.batch_size * config.seq_len * config.grad_accum
        last = max(layers)
        teacher = 2 * sum(_linear_weights(blocks[i]) for i in range(last + 1)) + attention * (last + 1)
        converted = sum(_linear_weights(blocks[i].self_attn) for i in layers)
        return float(tokens * (teacher + 4 * converted))  # forward and weight gradients (the inputs are recorded)
    per_micro = max(1, config.batch_size * config.seq_len // window)
    tokens = per_micro * window * config.grad_accum
    first = min(layers)
    tail = range(first, len(blocks))
    tail_weights = sum(_linear_weights(blocks[i]) for i in tail)
    tail_softmax = sum(1 for i in tail if i not in layers)
    converted = sum(_linear_weights(blocks[i].self_attn) for i in layers)
    adapters = [dense.get_submodule(name) for name in lora_target_names(dense, layers, config.lora_target_groups())]
    lora = config.lora_rank * sum(m.in_features + m.out_features for m in adapters)
    teacher = 2 * sum(_linear_weights(block) for block in blocks) + attention * len(blocks) + 2 * head
    student = 4 * tail_weights + 2 * converted + 6 * lora + 3 * attention * tail_softmax + 4 * head
    if checkpointed:  # the tail's forward once more, in the backward
        student += 2 * tail_weights + 2 * lora + attention * tail_softmax
    return float(tokens * (teacher + student))


def random_model(name: str, dtype: torch.dtype, device: torch.device):
    """Random weights in ``dtype`` of the shapes of ``name``: a named configuration (``retrofit.model_configs``),
    else the config.json of a model directory or of an alias's cached checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from retrofit.bench.configs import MODEL_CONFIGS, build_random_model
    from retrofit.load import ALIASES, reference_checkpoint

    if name in MODEL_CONFIGS:
        return build_random_model(name, dtype, device)
    config = AutoConfig.from_pretrained(reference_checkpoint(name) if name in ALIASES else name)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def kernel_launches(dense, args, device: torch.device, window: int) -> float:
    """CUDA kernels and copies per stage-2 optimizer step (torch.profiler's device events over 3 steps, the model's
    building and the setup of the optimizer included: a few hundred, against tens of thousands a step)."""
    from torch.profiler import ProfilerActivity, profile

    short = argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 2, "count": False})
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_stage(dense, short, device, 2, window)
    return sum(1 for event in prof.events() if event.device_type.name == "CUDA") / 3


PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}  # bf16 dense matrix throughput of the SXM data sheets


def _peak_tflops(args, device: torch.device) -> float | None:
    if args.peak_tflops is not None or device.type != "cuda":
        return args.peak_tflops
    name = torch.cuda.get_device_name(device)
    return next((value for chip, value in PEAK_TFLOPS.items() if chip in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m",
                        help="a named configuration (llama3-8b, qwen2.5-7b, smollm2-135m: random weights of its "
                             "shapes, unless retrofit.load also loads the name) or anything retrofit.load loads "
                             "(an alias or a model directory; with --random only its config.json is read)")
    parser.add_argument("--random", action="store_true", help="random weights of --model's shapes")
    parser.add_argument("--windows", default="1024,4096,8192", help="stage 2's window lengths")
    parser.add_argument("--seq-len", type=int, default=None, help="stage 1's window (default 1024; 64 on the CPU)")
    parser.add_argument("--layers", default=None, help="the converted layers (retrofit convert's --layers forms; "
                                                       f"default {LAYERS} for SmolLM2, else not:every:4)")
    parser.add_argument("--layer-type", default="kda", help="gdn or kda")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--frozen-dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on CUDA)")
    parser.add_argument("--checkpoint-activations-from", dest="checkpoint_from", default="auto",
                        help="window length, 0 (never) or auto (by the memory plan against the device's memory)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak matrix TFLOP/s for MFU (default: 989.4 on H100 / H200)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--count", action="store_true", help="count ops and syncs (default on the CPU)")
    parser.add_argument("--profile", action="store_true", help="CUDA: kernel launches per stage-2 step")
    parser.add_argument("--retrofit-from", default=None, help="import retrofit from this folder")
    parser.add_argument("--work-dir", default="/tmp/distill_step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:  # the clock starts when the last warm-up step ends
        print("distill_step.py: error: --warmup and --steps need at least 1 step each", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(args.device)
    args.count = args.count or device.type == "cpu"
    if args.seq_len is None:
        args.seq_len = 1024 if device.type == "cuda" else 64
    args.frozen_dtype = args.frozen_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.precision = {} if args.frozen_dtype == "float32" else {"frozen_dtype": args.frozen_dtype}
    windows = [int(w) for w in args.windows.split(",")] if device.type == "cuda" else [args.seq_len * 2]
    from retrofit.load import ALIASES

    random_weights = args.random or args.model not in ALIASES and args.model in MODEL_CONFIGS
    if random_weights:
        dense = random_model(args.model, getattr(torch, args.frozen_dtype), device)
    else:
        from retrofit.load import load

        dense, _ = load(args.model, dtype=args.frozen_dtype, device=device)
    if args.layers is None:
        args.layers = LAYERS if dense.config.num_hidden_layers == 30 and args.model == "smollm2-135m" else "not:every:4"
    import retrofit

    rows = [{"stage": "stage 1", "window": args.seq_len, **one_stage(dense, args, device, 1, args.seq_len)}]
    for window in windows:
        rows.append({"stage": "stage 2", "window": window, **one_stage(dense, args, device, 2, window)})
        if args.profile and device.type == "cuda":
            rows[-1]["kernel_launches"] = kernel_launches(dense, args, device, window)
    peak_tflops = _peak_tflops(args, device)
    header = (f"retrofit from {Path(retrofit.__file__).parent.parent}; {device}; {args.model}"
              f"{' (random weights)' if random_weights else ''}; frozen weights {args.frozen_dtype}; {args.layer_type} at layers {args.layers}; micro-batch "
              f"{args.batch_size} x {args.seq_len} tokens, {args.grad_accum} per step; {args.steps} steps after "
              f"{args.warmup}; MFU against {peak_tflops or '?'} TFLOP/s")
    print(header)
    print("| stage | window | windows x tokens per step | checkpointed | ms/step | tokens/s | peak memory (GiB) | "
          "planned peak (GiB) | model TFLOP/step | MFU | aten ops | kernels | host syncs | kernel launches (CUDA) |")
    print("|---|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        row["tokens_per_step"] = row["windows_per_micro_batch"] * row["window"] * args.grad_accum
        row["tokens_per_second"] = row["tokens_per_step"] / row["ms_per_step"] * 1000
        flops_per_second = row["model_flops_per_step"] / row["ms_per_step"] * 1000
        row["mfu"] = flops_per_second / (peak_tflops * 1e12) if peak_tflops else None
        syncs = "" if "syncs" not in row else f"{row['syncs']:.1f} " + json.dumps(row["sync_names"])
        planned = "-" if row["planned_peak_bytes"] is None else f"{row['planned_peak_bytes'] / 2 ** 30:.2f}"
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        print(f"| {row['stage']} | {row['window']} | {row['windows_per_micro_batch'] * args.grad_accum} x "
              f"{row['window']} | {'yes' if row['checkpointed'] else 'no'} | {row['ms_per_step']:.1f} | "
              f"{row['tokens_per_second']:,.0f} | {row['peak_memory_bytes'] / 2 ** 30:.2f} | {planned} | "
              f"{row['model_flops_per_step'] / 1e12:.2f} | {mfu} | {row.get('ops', float('nan')):.0f} | "
              f"{row.get('kernels', float('nan')):.0f} | {syncs} | {row.get('kernel_launches', float('nan')):.0f} |")
    if args.json:
        write_json(args.json, {"setting": header, "rows": rows})  # temp file, then rename


if __name__ == "__main__":
    main()
