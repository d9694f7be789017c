"""``retrofit gates``: train SeerAttention decode gates on calibration text (cli.py adds it to the group)."""
from __future__ import annotations

from pathlib import Path

import click
import torch

from retrofit.errors import RetrofitError


@click.command("gates")
@click.argument("model")
@click.option("--data", "data", multiple=True, required=True, type=click.Path(exists=True, path_type=Path),
              help="Text file(s) or folder(s) of .txt files (e.g. ../shared/data/calib). Repeatable.")
@click.option("--tokens", type=int, default=262_144, show_default=True, help="Calibration tokens to train on.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Gate file to write (atomically).")
@click.option("--seq-len", type=int, default=None,
              help="Longest training sequence; at least the prompt lengths you decode. Default: the model's maximum "
                   "length up to 8192, with --min-seq-len a quarter of it.")
@click.option("--min-seq-len", type=int, default=None,
              help="Draw each sequence's length between this and --seq-len (default with --seq-len given: all "
                   "--seq-len).")
@click.option("--block-size", type=int, default=64, show_default=True, help="Tokens per gated KV block.")
@click.option("--hidden", type=int, default=128, show_default=True, help="Gate hidden size.")
@click.option("--queries", type=int, default=16, show_default=True, help="Decode queries per sequence (last positions).")
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--retrieval-fraction", type=float, default=0.5, show_default=True,
              help="Share of sequences ending in a repeat of an earlier span (retrieval-style training; 0: none).")
@click.option("--position-offsets/--no-position-offsets", default=True, show_default=True,
              help="Start each training sequence at a random position (gates then carry to other positions).")
@click.option("--save-every", type=int, default=20, show_default=True, help="Checkpoint every N steps.")
@click.option("--resume", is_flag=True, help="Continue from OUT.ckpt.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--dtype", default="float32", show_default=True, help="Dtype of the frozen base model.")
def gates_command(model, data, tokens, out, seq_len, min_seq_len, block_size, hidden, queries, lr, retrieval_fraction,
                  position_offsets, save_every, resume, device, dtype):
    """Train SeerAttention decode gates for MODEL (frozen) on calibration text.

    \b
    Example:
      retrofit gates smollm2-135m --data ../shared/data/calib --tokens 65536 --out runs/smol.gates
      retrofit generate smollm2-135m --sparse seer --budget 512 --sparse-arg gate_path=runs/smol.gates ...
    """
    from retrofit.load import load
    from retrofit.memory import is_out_of_memory, out_of_memory
    from retrofit.sparse.methods.seer.training import default_seq_lens, train_gates

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint = out.with_name(out.name + ".ckpt")
    if resume and not checkpoint.is_file():
        raise RetrofitError(f"--resume: no checkpoint at {str(checkpoint)!r}")
    lm, tokenizer = load(model, dtype=dtype, device=device)
    if seq_len is None:
        seq_len, default_min = default_seq_lens(lm.config.get_text_config(decoder=True), block_size)
        min_seq_len = min_seq_len or min(default_min, seq_len)
    failure = None
    try:
        _, losses = train_gates(lm, tokenizer, list(data), tokens, out, seq_len=seq_len, block_size=block_size,
                                hidden=hidden, queries=queries, lr=lr, save_every=save_every, resume=resume,
                                retrieval_fraction=retrieval_fraction, position_offsets=position_offsets,
                                min_seq_len=min_seq_len)
    except Exception as error:  # re-raised unless the device ran out of memory
        if not is_out_of_memory(error):
            raise
        failure = out_of_memory(error, f"training gates for {out}", device=device)
    if failure is not None:  # outside the except: the failed step's tensors are freed first
        raise stopped_out_of_memory(failure, checkpoint)
    if losses:
        click.echo(f"gates saved to {out} (KL per layer: first step {losses[0]:.4f}, last step {losses[-1]:.4f})")
    else:
        click.echo(f"gates saved to {out} (nothing left to train after resume)")


def stopped_out_of_memory(failure, checkpoint: Path):
    """``failure`` (an :class:`~retrofit.memory.OutOfMemory` of gate training) told with what survives: the
    ``checkpoint`` of the last ``--save-every`` step, which ``--resume`` continues from, or that there is none yet
    (the gate file itself is written only at the end, so none is left half-written)."""
    from retrofit.atomic import torch_load

    if not checkpoint.is_file():
        failure.what += " (no checkpoint was written yet: a rerun starts over)"
        return failure
    step = torch_load(checkpoint, "a gate-training checkpoint")["step"]
    failure.what += (f"; its last checkpoint (step {step}) is kept in {checkpoint}, and the same command with --resume "
                     "continues from it")
    failure.advice = ("--resume where more memory is free, or start over with a shorter --seq-len, fewer --queries, "
                      "--dtype bfloat16, or another --device")
    return failure
