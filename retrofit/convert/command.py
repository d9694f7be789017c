"""``retrofit convert`` and ``retrofit select`` (click commands; cli.py adds them to the ``retrofit`` group)."""
from __future__ import annotations

import click

from retrofit.convert.select_settings import SelectSettings
from retrofit.errors import RetrofitError

CONVERT_EXAMPLES = """
\b
Examples:
  retrofit convert smollm2-135m --to gdn --layers every:4 --data ../shared/data/calib --tokens 2000000 --out hyb/
  retrofit convert smollm2-135m --recipe smollm2-135m/cpu-small --data ../shared/data/calib --out hyb/
  retrofit convert smollm2-135m --recipe recipes/smollm2-135m/kda-8of30-50m-b16.yaml --data calib/ --out hyb/ --resume
  torchrun --nproc-per-node 2 -m retrofit.convert.command convert MODEL --recipe R.yaml --data D --out O
  torchrun --nproc-per-node 8 -m retrofit.convert.command convert MODEL --recipe R.yaml --data D --out O --parallel fsdp
  retrofit convert llama3-8b --to gdn --layers not:every:4 --seq-len 8192 --batch-size 1 --frozen-dtype bfloat16 \
      --checkpoint-activations-from auto --device cuda --device-memory 80GiB --dry-run
"""


def _required_unless_dry_run(ctx: click.Context, param: click.Parameter, value):
    """``--out`` is required unless ``--dry-run`` is given. Click processes the options given on the command line
    before the others, so a given ``--dry-run`` is known here; one not given is not, and then ``--out`` is needed."""
    if value is None and not ctx.params.get("dry_run"):
        raise click.MissingParameter(ctx=ctx, param=param)
    return value


@click.command("convert", epilog=CONVERT_EXAMPLES)
@click.argument("model")
@click.option("--to", "to", default=None, help="Layer type of the converted layers: gdn (Gated DeltaNet) or kda.")
@click.option("--layers", default=None,
              help="Which layers: 0,2,4 | 3-6 | every:K[:OFFSET] (layers K-1, 2K-1, ...) | sliding (the "
                   "sliding-window layers) | fraction:F (scored).")
@click.option("--data", multiple=True, help="Calibration text file or folder (repeatable).")
@click.option("--tokens", type=int, default=None, help="Calibration token budget (both stages together).")
@click.option("--out", type=click.Path(), callback=lambda ctx, param, value: _required_unless_dry_run(ctx, param, value),
              help="Output directory of the hybrid checkpoint (required unless --dry-run).")
@click.option("--recipe", default=None, help="YAML recipe (file, or shipped name like smollm2-135m/cpu-small).")
@click.option("--seq-len", type=int, default=None, help="Tokens per training window.")
@click.option("--batch-size", type=int, default=None, help="Windows per micro-batch per GPU/process.")
@click.option("--grad-accum", type=int, default=None, help="Micro-batches per optimizer step.")
@click.option("--stage1-fraction", type=float, default=None, help="Share of the tokens spent on layer-wise alignment.")
@click.option("--stage2-lengths", default=None, metavar="LEN:SHARE,...",
              help="Stage 2's curriculum of window lengths and token shares, e.g. 1024:0.5,4096:0.3,8192:0.2 "
                   "(default: all on --seq-len windows).")
@click.option("--checkpoint-activations-from", default=None, metavar="TOKENS|auto",
              help="Recompute the student's layer activations in the backward pass for windows of at least this many "
                   "tokens (0 = never; auto = from the first window whose plan would not fit the device otherwise).")
@click.option("--frozen-dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
              help="dtype of the dense weights, held once for teacher and student (bfloat16 needs bf16 autocast: on "
                   "CUDA by default). What trains stays float32.")
@click.option("--lr-stage1", type=float, default=None, help="Learning rate of the new layers in stage 1.")
@click.option("--lr-stage2", type=float, default=None, help="Learning rate of the new layers in stage 2.")
@click.option("--lr-lora", type=float, default=None, help="Learning rate of LoRA in stage 2.")
@click.option("--lora-rank", type=int, default=None, help="LoRA rank (0 disables LoRA).")
@click.option("--ce-weight", type=float, default=None, help="Weight of the cross-entropy added to the KL loss.")
@click.option("--copy-share", type=float, default=None, metavar="SHARE",
              help="Share of stage 2's windows that repeat spans of their own text further on, one per 1,024 tokens, "
                   "so the loss covers long-range copying (0 = off).")
@click.option("--checkpoint-every", type=int, default=None, help="Optimizer steps between training checkpoints.")
@click.option("--seed", type=int, default=None, help="Seed of data order and LoRA init.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), default=None,
              help="Engine under torchrun: ddp (default) or fsdp (FSDP2: trained parameters, gradients and optimizer "
                   "state sharded across processes).")
@click.option("--dry-run", is_flag=True,
              help="Print the memory plan (frozen weights, trained parameters, optimizer state, activations per "
                   "micro-batch at each window length) and whether it fits the device, and stop: no weight is loaded. "
                   "MODEL may also name a configuration (llama3-8b, qwen2.5-7b, smollm2-135m); --device need not be "
                   "present; the processes are WORLD_SIZE's. A plan that cannot fit ends in one line, exit code 2.")
@click.option("--device-memory", default=None, metavar="SIZE",
              help="Memory of the device to plan for, e.g. 80GiB or 80GB (default: the device's). A run whose plan "
                   "does not fit it is refused before the model loads.")
@click.option("--resume", is_flag=True, help="Continue from the last training checkpoint of this --out.")
@click.option("--max-minutes", type=float, default=None,
              help="Checkpoint and stop after this many minutes (exit code 3); rerun with --resume to continue.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out directory.")
@click.option("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def convert_command(model, to, layers, data, tokens, out, recipe, seq_len, batch_size, grad_accum, stage1_fraction,
                    stage2_lengths, checkpoint_activations_from, lr_stage1, lr_stage2, lr_lora, lora_rank, ce_weight,
                    frozen_dtype, copy_share, checkpoint_every, seed, parallel, dry_run, device_memory, resume,
                    max_minutes, overwrite, device, quiet):
    """Convert attention layers of MODEL to Gated DeltaNet / KDA, distil, and save a hybrid checkpoint."""
    import time

    from retrofit.convert.distill import TrainingPaused
    from retrofit.memory import is_out_of_memory, out_of_memory, peak_memory_so_far
    from retrofit.convert.parts import PartsSoFar, parts_so_far, record_parts
    from retrofit.devices import is_first_process
    from retrofit.convert.pipeline import convert, plan

    options = dict(seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, stage1_fraction=stage1_fraction,
                   stage2_lengths=stage2_lengths, checkpoint_activations_from=checkpoint_activations_from,
                   lr_stage1=lr_stage1, lr_stage2=lr_stage2, lr_lora=lr_lora, lora_rank=lora_rank,
                   ce_weight=ce_weight, frozen_dtype=frozen_dtype, copy_share=copy_share,
                   checkpoint_every=checkpoint_every, seed=seed, parallel=parallel)
    if dry_run:
        memory_plan = plan(model, to=to, layers=layers, tokens=tokens, recipe=recipe, device=device,
                           device_memory=device_memory, **options)
        if memory_plan.refusal():
            raise RetrofitError(memory_plan.refusal())
        click.echo(memory_plan.table())
        return
    if not quiet and is_first_process():  # what the run will hold, before any weight loads (--dry-run's table)
        click.echo(plan(model, to=to, layers=layers, tokens=tokens, recipe=recipe, device=device,
                        device_memory=device_memory, **options).table() + "\n")
    start = time.time()
    earlier = parts_so_far(out) if resume and out else PartsSoFar()
    failure = None
    try:
        path = convert(model, to=to, layers=layers, data=list(data) or None, out=out, tokens=tokens, recipe=recipe,
                       resume=resume, overwrite=overwrite, device=device, show_progress=not quiet,
                       max_minutes=max_minutes, device_memory=device_memory, **options)
    except TrainingPaused as paused:
        if is_first_process():
            record_parts(out, earlier.plus(time.time() - start, *peak_memory_so_far()))
        click.echo(f"retrofit: {paused}", err=True)
        raise SystemExit(3)
    except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not is_out_of_memory(error):
            raise
        failure = out_of_memory(error, "converting")
    if failure is not None:  # outside the except: what the failed step held is free by now
        if is_first_process():
            record_parts(out, earlier.plus(time.time() - start, *peak_memory_so_far()))
        raise stopped_out_of_memory(failure, out)
    if is_first_process():
        import json

        section = json.loads((path / "config.json").read_text())["retrofit"]
        parts = earlier.plus(time.time() - start, *peak_memory_so_far())
        click.echo("| hybrid | layer type | converted layers | tokens | minutes (all parts) | peak memory (GiB, "
                   "the largest part's) |")
        click.echo("|---|---|---|---:|---:|---:|")
        click.echo(f"| {path} | {section['layer_type']} | {','.join(map(str, section['layers']))} | "
                   f"{section['distillation'].get('tokens')} | {parts.seconds / 60:.1f} | "
                   f"{parts.peak_memory_bytes / 2 ** 30:.2f} |")
        click.echo(f"peak memory: {parts.peak_memory_measure}")


def stopped_out_of_memory(failure, out):
    """``failure`` (an :class:`~retrofit.memory.OutOfMemory` of a conversion to ``out``) told with what survives:
    the last training checkpoint, which ``--resume`` continues from, or that there is none yet."""
    from pathlib import Path

    from retrofit.convert.checkpoint import saved_position, work_dir_for

    work_dir = work_dir_for(out)
    position = saved_position(work_dir)
    if position is None:
        failure.what = f"converting to {Path(out)} (no training checkpoint was written yet: a rerun starts over)"
    else:
        stage, step = position
        failure.what = (f"converting to {Path(out)}; its last checkpoint (stage {stage}, step {step}) is kept in "
                        f"{work_dir}, and the same command with --resume continues from it")
    failure.advice = ("--resume where more memory is free, or start over with a smaller --batch-size (a larger "
                      "--grad-accum keeps the tokens per step), a shorter --seq-len, --checkpoint-activations-from, "
                      "or another --device")
    return failure


SELECT_EXAMPLES = """
\b
Examples:
  retrofit select smollm2-135m --fraction 0.25 --data ../shared/data/calib
  retrofit select smollm2-135m --fraction 0.5 --data calib/ --probe-context 2048,4096 --retrieval-weight 2
  retrofit select smollm2-135m --fraction 0.25 --data calib/ --retrieval-weight 0 --retrieval-probes 0   # KL only
  retrofit select smollm2-135m --fraction 0.75 --data calib/ --copy-weight 0.5 --max-run 3   # a quarter softmax
"""


@click.command("select", epilog=SELECT_EXAMPLES)
@click.argument("model")
@click.option("--fraction", type=float, required=True, help="Fraction of layers to convert (0 < F <= 1).")
@click.option("--data", multiple=True, required=True, help="Calibration text file or folder (repeatable).")
@click.option("--to", "to", default="gdn", show_default=True, help="Layer type used for the probe: gdn or kda.")
@click.option("--tokens", type=int, default=None, help="Calibration tokens for the probe (default: what the steps need).")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per window.")
@click.option("--align-steps", type=int, default=SelectSettings.align_steps, show_default=True,
              help="Alignment steps (all layers at once).")
@click.option("--batch-size", type=int, default=SelectSettings.batch_size, show_default=True,
              help="Windows per alignment step.")
@click.option("--probe-windows", type=int, default=SelectSettings.probe_windows, show_default=True,
              help="Held-out windows for the KL probe.")
@click.option("--retrieval-weight", type=float, default=SelectSettings.retrieval_weight, show_default=True,
              help="w in cost = KL/mean(KL) + w * needle mass/mean(needle mass); 0 ranks by KL alone.")
@click.option("--copy-weight", type=float, default=SelectSettings.copy_weight, show_default=True,
              help="c in a third term, + c * copy rate/mean(copy rate): keeps the heads that copy a needle softmax.")
@click.option("--retrieval-probes", type=int, default=SelectSettings.retrieval_probes, show_default=True,
              help="Needle probes per context length (0: no retrieval probe).")
@click.option("--probe-context", default=",".join(map(str, SelectSettings.probe_context)), show_default=True,
              help="Context lengths of the needle probes in tokens, comma-separated (e.g. 2048,4096).")
@click.option("--seed", type=int, default=SelectSettings.seed, show_default=True,
              help="Seed of the needle probes (haystacks, numbers, depths).")
@click.option("--max-run", type=int, default=SelectSettings.max_run, show_default=True,
              help="At most this many converted layers in a row (0: no bound): the cheapest such set is chosen.")
@click.option("--device", default=None, help="cpu | cuda (default: cuda when available).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def select_command(model, fraction, data, to, tokens, seq_len, align_steps, batch_size, probe_windows,
                   retrieval_weight, copy_weight, retrieval_probes, probe_context, seed, max_run, device, quiet):
    """Rank MODEL's layers by the cost of converting each one (short-window KL and long-context retrieval), print
    the ranking, the chosen --layers and what the scoring cost (seconds, peak memory)."""
    from retrofit.convert.data import token_windows
    from retrofit.convert.selection import choose, explain_choice, parse_layer_spec, rank_layers, ranking_table
    from retrofit.devices import parse_device
    from retrofit.layers import LAYER_TYPES
    from retrofit.load import load
    from retrofit.model_info import attention_layout

    LAYER_TYPES.get(to)
    parse_layer_spec(f"fraction:{fraction}", 1)
    if tokens is not None and tokens <= 0:
        raise RetrofitError(f"--tokens must be > 0, got {tokens}")
    settings = SelectSettings(align_steps=align_steps, batch_size=batch_size, probe_windows=probe_windows,
                              retrieval_weight=retrieval_weight, copy_weight=copy_weight,
                              retrieval_probes=retrieval_probes,
                              probe_context=probe_context, seed=seed, max_run=max_run)
    torch_device = parse_device(device)
    dense, tokenizer = load(model, dtype="float32", device=torch_device)
    layout = attention_layout(dense)
    needed = align_steps * batch_size + probe_windows
    count = needed if tokens is None else max(probe_windows + 1, tokens // seq_len)
    windows = token_windows(tokenizer, list(data), count, seq_len, show_progress=not quiet)
    ranking = rank_layers(dense, tokenizer, windows, list(data), to, settings, device=torch_device,
                          show_progress=not quiet)
    chosen = choose(ranking.scores, fraction, layout.num_layers, max_run)
    click.echo(ranking_table(ranking.scores, chosen))
    click.echo(f"\n{ranking.summary()}")
    click.echo(explain_choice(ranking.scores, chosen, layout.num_layers, retrieval_weight, copy_weight, fraction,
                              max_run))
    click.echo(f"\n--layers {','.join(map(str, chosen))}")


@click.group()
def _standalone():
    """Entry for ``python -m retrofit.convert.command`` (torchrun)."""


_standalone.add_command(convert_command)
_standalone.add_command(select_command)

if __name__ == "__main__":
    try:
        _standalone(standalone_mode=True)
    except RetrofitError as err:
        click.echo(f"error: {err}", err=True)
        raise SystemExit(2)
