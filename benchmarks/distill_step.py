"""What one distillation step costs: host synchronisations and aten operations per optimizer step (counted, CPU), and
milliseconds per step (timed, CUDA), for stage 1 and for stage 2 at each window length of a long-window recipe.

The setting is the one of `recipes/smollm2-135m/kda-8of30-*.yaml`: SmolLM2-135M with layers 11, 12 and 24-29 turned
into KDA, micro-batches of 8 windows of 1,024 tokens (stage 2 keeps the tokens per micro-batch: 2 windows of 4,096,
1 of 8,192), 2 micro-batches a step, bf16 autocast on CUDA. The calibration windows are random tokens: what a step
costs does not depend on the text.

    python benchmarks/distill_step.py                              # CPU: counts per step, the real SmolLM2, 64-token
                                                                   # windows (the counts do not depend on the length)
    python benchmarks/distill_step.py --device cuda --random       # H200: ms per step at 1K/4K/8K, random weights of
                                                                   # SmolLM2-135M's shapes, + kernel launches per step
    ... --batch-size 16 --grad-accum 1                             # the same tokens per step in one micro-batch
    ... --layers 3-6,9,11-13,16,24-29 --layer-type kda             # another hybrid (here kda-15of30's layers)
    ... --retrofit-from DIR                                        # import retrofit from DIR (an older checkout), to
                                                                   # measure a change side by side
    ... --model qwen2.5-0.5b --layers 2,5,8,11,14,17               # another model: an alias or a model directory;
                                                                   # with --random only its config.json is read, so a
                                                                   # directory holding that file alone will do (a GPU
                                                                   # machine without the checkpoint)

A step is timed over ``--steps`` steps after ``--warmup`` (the device synchronised only at both ends, so a loop that
keeps the host ahead of the device is timed as it runs). Counted steps run inside a ``DispatchCount``
(``retrofit.bench.overhead``): ``syncs`` are host reads of tensor values (``.item()``, ``float(tensor)``, copies to
the host). On a GPU a read of a device value stalls the host until the device has finished everything queued; on the
CPU the count also holds reads of values a GPU run keeps on the host (the off-CUDA AdamW's step counters, one per
trained tensor; the sampler's permutation), so there it bounds the GPU's count from above. A copy of a batch from
ordinary (pageable) host memory to the GPU also waits for the device, which a CPU count cannot see: the loop pins
batches and copies them without blocking. On CUDA, ``--profile`` counts the kernels and copies a step launches
(torch.profiler): with a model this small the step is bound by the host's launches, so those set its time. Results
in BENCHMARKS.md, "Current figures > Conversion".
"""
from __future__ import annotations

import argparse
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
from retrofit.hybrid import HybridSection  # noqa: E402

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


def one_stage(dense, args, device: torch.device, stage: int, window: int) -> dict:
    """Runs ``warmup + steps`` optimizer steps of ``stage`` (stage 2 on windows of ``window`` tokens) and returns the
    clock's figures for the measured steps."""
    seq_len = args.seq_len
    per_step = args.batch_size * args.grad_accum * seq_len
    steps = args.warmup + args.steps
    config = DistillConfig(tokens=steps * per_step * (1 if stage == 1 else 2), seq_len=seq_len,
                           batch_size=args.batch_size, grad_accum=args.grad_accum,
                           stage1_fraction=1.0 if stage == 1 else 0.5, stage2_lengths=f"{window}:1",
                           lr_stage2=1e-3, lr_lora=6e-4, lora_rank=16, lora_alpha=32, checkpoint_every=0, seed=2)
    generator = torch.Generator().manual_seed(0)
    vocab = dense.config.vocab_size
    per_micro = max(1, args.batch_size * seq_len // window)
    pools = {seq_len: torch.randint(vocab, (args.batch_size * args.grad_accum * steps, seq_len), generator=generator),
             window: torch.randint(vocab, (per_micro * args.grad_accum * steps, window), generator=generator)}
    layers = list(parse_layer_spec(args.layers, dense.config.num_hidden_layers).indices)
    section = HybridSection(layers=layers, layer_type=args.layer_type, base_model_type=dense.config.model_type)
    hybrid = to_hybrid(dense, section, share_weights=False)
    clock = StepClock(device, args.warmup, args.steps, count=args.count)
    distiller = Distiller(dense, hybrid, layers, config, pools, Path(args.work_dir), {"benchmark": True}, device,
                          show_progress=False, on_step=clock)
    if stage == 1:
        distiller.stage1()
    else:  # no stage 1: stage 2 straight from the attention-initialised layers
        distiller.stage2()
    del distiller, hybrid
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return clock.results[stage]


def random_model(name: str, device: torch.device):
    """Random float32 weights of the shapes of ``name``: a config of ``retrofit.bench.configs`` (SmolLM2's), else the
    config.json of a model directory or of an alias's cached checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from retrofit.bench.configs import MODEL_CONFIGS, build_random_model
    from retrofit.load import ALIASES, reference_checkpoint

    if name in MODEL_CONFIGS:
        return build_random_model(name, torch.float32, device)
    config = AutoConfig.from_pretrained(reference_checkpoint(name) if name in ALIASES else name)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def kernel_launches(dense, args, device: torch.device, window: int) -> float:
    """CUDA kernels and copies per stage-2 optimizer step (torch.profiler's device events over 3 steps, the model's
    building and the setup of the optimizer included: a few hundred, against tens of thousands a step)."""
    from torch.profiler import ProfilerActivity, profile

    short = argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 2, "count": False})
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_stage(dense, short, device, 2, window)
    return sum(1 for event in prof.events() if event.device_type.name == "CUDA") / 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m",
                        help="an alias or a model directory (with --random, only its config.json is read)")
    parser.add_argument("--random", action="store_true", help="random weights of the model's shapes")
    parser.add_argument("--windows", default="1024,4096,8192", help="stage 2's window lengths")
    parser.add_argument("--seq-len", type=int, default=None, help="stage 1's window (default 1024; 64 on the CPU)")
    parser.add_argument("--layers", default=LAYERS, help="the converted layers (retrofit convert's --layers forms)")
    parser.add_argument("--layer-type", default="kda", help="gdn or kda")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
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
    windows = [int(w) for w in args.windows.split(",")] if device.type == "cuda" else [args.seq_len * 2]
    if args.random:
        dense = random_model(args.model, device)
    else:
        from retrofit.load import load

        dense, _ = load(args.model, dtype="float32", device=device)
    import retrofit

    rows = [{"stage": "stage 1", "window": args.seq_len, **one_stage(dense, args, device, 1, args.seq_len)}]
    for window in windows:
        rows.append({"stage": "stage 2", "window": window, **one_stage(dense, args, device, 2, window)})
        if args.profile and device.type == "cuda":
            rows[-1]["kernel_launches"] = kernel_launches(dense, args, device, window)
    tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
    header = (f"retrofit from {Path(retrofit.__file__).parent.parent}; {device}; {args.layer_type} at layers "
              f"{args.layers}; micro-batch {args.batch_size} x "
              f"{args.seq_len} tokens, {args.grad_accum} per step ({tokens_per_step} tokens); {args.steps} steps after "
              f"{args.warmup}")
    print(header)
    print("| stage | window | ms/step | tokens/s | aten ops | kernels | host syncs | kernel launches (CUDA) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        rate = tokens_per_step / row["ms_per_step"] * 1000
        syncs = "" if "syncs" not in row else f"{row['syncs']:.1f} " + json.dumps(row["sync_names"])
        print(f"| {row['stage']} | {row['window']} | {row['ms_per_step']:.1f} | {rate:,.0f} | "
              f"{row.get('ops', float('nan')):.0f} | {row.get('kernels', float('nan')):.0f} | {syncs} | "
              f"{row.get('kernel_launches', float('nan')):.0f} |")
    if args.json:
        write_json(args.json, {"setting": header, "rows": rows})  # temp file, then rename


if __name__ == "__main__":
    main()
