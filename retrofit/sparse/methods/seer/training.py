"""Training of the SeerAttention decode gates (``retrofit gates``): base model frozen, gates distilled from it.

For each calibration sequence the model runs dense; at every softmax-attention layer the last ``queries`` query
positions are taken as decode queries. Target: their dense attention, summed per block of ``block_size`` keys and
averaged over the heads of a GQA group. Prediction: the gate's softmax over the same blocks (the newest, partial block
pooled over the keys seen so far, as at decode time). Loss: KL(target || gate), summed over layers.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from retrofit import architecture
from retrofit.atomic import torch_load, torch_save
from retrofit.errors import RetrofitError
from retrofit.textfiles import read_text
from retrofit.sparse.attention_functions import (attention_function, dense_attention, implementation_of,
                                                 softmax_attention_layers)
from retrofit.sparse.methods.seer.method import SeerGate, SeerGates, pool_blocks


def gate_loss(gate: SeerGate, query: torch.Tensor, key: torch.Tensor, block_size: int, queries: int,
              scaling: float) -> torch.Tensor:
    """KL(block-pooled dense attention || gate distribution) for the last ``queries`` positions.

    query [B, Hq, T, D], key [B, Hkv, T, D] (post-RoPE, T a multiple of block_size, queries <= block_size) -> scalar.
    """
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    NB = T // block_size
    q = query[:, :, T - queries :].float().view(B, Hkv, G, queries, D)
    k = key.float()
    t = torch.arange(T - queries, T, device=key.device)
    logits = torch.einsum("bhgqd,bhnd->bhgqn", q, k) * scaling
    logits = logits.masked_fill(torch.arange(T, device=key.device)[None, :] > t[:, None], float("-inf"))
    target = logits.softmax(-1).view(B, Hkv, G, queries, NB, block_size).sum(-1).mean(2)  # [B, Hkv, Q, NB]

    valid = torch.ones(B, T, dtype=torch.bool, device=key.device)
    pooled = pool_blocks(k, valid, block_size)  # [B, Hkv, NB, 3D]
    last = k[:, :, (NB - 1) * block_size :]  # the block holding the queries, pooled causally
    cmax = torch.cummax(last, 2).values[:, :, block_size - queries :]
    cmin = torch.cummin(last, 2).values[:, :, block_size - queries :]
    counts = torch.arange(1, block_size + 1, device=key.device, dtype=torch.float32)[:, None]
    cmean = (torch.cumsum(last, 2) / counts)[:, :, block_size - queries :]
    pooled_last = torch.cat([cmax, cmin, cmean], -1)  # [B, Hkv, Q, 3D]

    gq = gate.query(query[:, :, T - queries :].float().transpose(1, 2).reshape(B * queries, Hq, D))
    gq = gq.view(B, queries, Hkv, -1).transpose(1, 2)  # [B, Hkv, Q, hidden]
    scores = torch.einsum("bhqc,bhnc->bhqn", gq, gate.block_keys(pooled))
    scores_last = (gq * gate.block_keys(pooled_last)).sum(-1)
    scores = torch.cat([scores[..., :-1], scores_last[..., None]], -1)
    log_pred = scores.log_softmax(-1)
    return (target * (torch.log(target.clamp(min=1e-12)) - log_pred)).sum(-1).mean()


@contextmanager
def capture_gate_losses(model, gates: SeerGates, queries: int) -> Iterator[list[torch.Tensor]]:
    """Inside: forward calls run the original attention and append each gated layer's loss to the yielded list."""
    losses: list[torch.Tensor] = []
    original = implementation_of(model)

    def attention(module, query, key, value, attention_mask, **kwargs):
        out = dense_attention(original, module, query, key, value, attention_mask, **kwargs)
        if getattr(module, "layer_idx", None) in gates:
            with torch.enable_grad():
                losses.append(gate_loss(gates[module.layer_idx], query.detach(), key.detach(), gates.block_size,
                                        queries, kwargs.get("scaling") or module.scaling))
        return out

    with attention_function(model, attention, "gates"):
        yield losses


def sequence_lengths(tokens: int, seq_len: int, min_seq_len: int | None, block_size: int, seed: int) -> list[int]:
    """Lengths of the training sequences, covering ``tokens`` tokens: all ``seq_len``, or (``min_seq_len`` below it)
    seeded multiples of ``block_size`` drawn uniformly from [min_seq_len, seq_len]."""
    if min_seq_len is None or min_seq_len >= seq_len:
        return [seq_len] * -(-tokens // seq_len)
    picker = random.Random(seed + 3)
    lengths: list[int] = []
    covered = 0
    while covered < tokens:
        lengths.append(picker.randint(min_seq_len // block_size, seq_len // block_size) * block_size)
        covered += lengths[-1]
    return lengths


def default_seq_lens(config, block_size: int, longest: int = 8192) -> tuple[int, int]:
    """``(seq_len, min_seq_len)`` of ``retrofit gates`` without ``--seq-len``: sequences up to the model's maximum
    length (at most ``longest``) and down to a quarter of it, in whole blocks (the setting measured in
    BENCHMARKS.md: 2048-8192 on SmolLM2)."""
    limit = min(getattr(config, "max_position_embeddings", None) or longest, longest)
    seq_len = max(limit // block_size * block_size, 2 * block_size)
    return seq_len, max(seq_len // 4 // block_size * block_size, 2 * block_size)


def calibration_chunks(tokenizer, files: list[Path], lengths: list[int]) -> list[torch.Tensor]:
    """Token chunks of the given ``lengths`` (in order), cut one after another from the text files (read in order)."""
    paths: list[Path] = []
    for item in files:
        item = Path(item)
        paths.extend(sorted(p for p in item.rglob("*.txt")) if item.is_dir() else [item])
    if not paths:
        raise RetrofitError("--data: no .txt files found")
    chunks: list[torch.Tensor] = []
    for path in paths:
        ids = tokenizer(read_text(path, "calibration file"), return_tensors="pt").input_ids[0]
        start = 0
        while len(chunks) < len(lengths) and start + lengths[len(chunks)] <= len(ids):
            chunks.append(ids[start : start + lengths[len(chunks)]])
            start += chunks[-1].shape[0]
        if len(chunks) == len(lengths):
            break
    if len(chunks) < len(lengths):
        raise RetrofitError(f"--data holds {sum(c.shape[0] for c in chunks)} tokens in whole training sequences; "
                            f"--tokens asks {sum(lengths)}")
    return chunks


def with_repeated_span(chunk: torch.Tensor, span: int, rng: random.Random) -> torch.Tensor:
    """``chunk [T]`` with its last ``span`` tokens replaced by a copy of ``span`` tokens from earlier in it.

    Retrieval-style training data: on natural text the decode queries mostly attend to recent blocks, so gates
    trained only on it rarely learn to find a distant block by content (what needle-in-a-haystack decoding needs).
    Queries inside a repeated span attend (through the model's induction and retrieval heads) to its first copy,
    anywhere in the sequence, which the gate must then learn to locate.
    """
    T = chunk.shape[0]
    if T < 2 * span:
        return chunk
    start = rng.randrange(0, T - 2 * span + 1)
    out = chunk.clone()
    out[T - span :] = chunk[start : start + span]
    return out


def position_offsets_for(lengths: list[int], config, seed: int) -> list[int]:
    """Seeded start positions of the training sequences of these lengths, each in [0, max_position_embeddings -
    length]."""
    picker = random.Random(seed + 2)
    limit = getattr(config, "max_position_embeddings", None)
    return [picker.randint(0, max((limit or length) - length, 0)) for length in lengths]


def train_gates(model, tokenizer, files: list[Path], tokens: int, out: Path, *, seq_len: int = 1024,
                block_size: int = 64, hidden: int = 128, queries: int = 16, lr: float = 1e-3, save_every: int = 20,
                resume: bool = False, seed: int = 0, progress: bool = True,
                retrieval_fraction: float = 0.5, position_offsets: bool = True,
                min_seq_len: int | None = None) -> tuple[SeerGates, list[float]]:
    """Train decode gates for every softmax-attention layer of ``model`` (frozen); save them to ``out``.

    ``retrieval_fraction``: share of the sequences whose last ``2 * queries`` tokens repeat an earlier span
    (``with_repeated_span``; the choice is seeded, so a resumed run sees the same sequences). Measured on the CPU
    (SmolLM2, 262K tokens in sequences of 2048, seer budget 1024, niah_single, 10 seeds): 0.5 keeps 100% of dense at
    2048 and 4096 where 0.0 keeps 90% and 30%.

    ``position_offsets``: shift each sequence's positions by a random offset (seeded) within the model's maximum
    length. The gates read post-RoPE queries and keys, so gates trained at the positions of one sequence length
    learn those rotations and do not carry to others: measured on the CPU, gates trained on sequences of 2048 that
    keep 100% of dense on niah_single@2048 keep 10% when the same prompts sit at positions 5952-8000 (dense 100%);
    trained with offsets they keep 100% there. Prompts much longer than ``seq_len`` still need longer sequences.

    ``min_seq_len``: sequence lengths drawn (seeded) between it and ``seq_len`` instead of all ``seq_len``: with
    offsets, long sequences (the query-to-key distances of long prompts) still start at varied positions. Measured
    on the H200 (3M tokens, bf16, budget 1024, 20 seeds): lengths 2048-8192 keep 94% / 100% of dense on passkey /
    niah_single at 8000 (blocks of 64; 100% / 100% with blocks of 16) where sequences of 4096 kept 72% / 45%.

    Resumable: a checkpoint ``out + ".ckpt"`` (gates, optimiser, step) is written every ``save_every`` steps;
    ``resume=True`` continues from it. Returns the gates and the per-step losses of this run.
    """
    if seq_len % block_size or seq_len < 2 * block_size:
        raise RetrofitError(f"--seq-len {seq_len} must be a multiple of --block-size {block_size} and at least two blocks")
    if min_seq_len is not None and (min_seq_len % block_size or not 2 * block_size <= min_seq_len <= seq_len):
        raise RetrofitError(f"--min-seq-len {min_seq_len} must be a multiple of --block-size {block_size}, at least two "
                            f"blocks and at most --seq-len {seq_len}")
    if not 1 <= queries <= block_size:
        raise RetrofitError(f"--queries {queries} must be between 1 and --block-size {block_size}")
    if tokens <= 0:
        raise RetrofitError(f"--tokens {tokens} must be positive")
    if not 0.0 <= retrieval_fraction <= 1.0:
        raise RetrofitError(f"--retrieval-fraction {retrieval_fraction} must be between 0 and 1")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = out.with_name(out.name + ".ckpt")
    config = model.config.get_text_config(decoder=True)
    layers = list(softmax_attention_layers(model))
    if not layers:
        raise RetrofitError(f"{type(model).__name__} has no softmax-attention layer to train gates for")
    arch = architecture.of(config)
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    random.seed(seed)
    gates = SeerGates(layers, arch.num_heads(config), arch.num_kv_heads(config), arch.head_dim(config), hidden,
                      block_size)
    gates.to(device)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=lr)
    start = 0
    if resume:
        if not checkpoint.is_file():
            raise RetrofitError(f"--resume: no checkpoint at {str(checkpoint)!r}")
        state = torch_load(checkpoint, "a gate-training checkpoint", map_location=device,
                           advice="start again without --resume")
        if not isinstance(state, dict) or "config" not in state:
            raise RetrofitError(f"--resume: {str(checkpoint)!r} is not a gate-training checkpoint")
        if state["config"] != gates.config:
            raise RetrofitError(f"--resume: checkpoint {str(checkpoint)!r} was made with other gate settings")
        gates.load_state_dict(state["gates"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    lengths = sequence_lengths(tokens, seq_len, min_seq_len, block_size, seed)
    chunks = calibration_chunks(tokenizer, files, lengths)
    if retrieval_fraction > 0:
        picker = random.Random(seed + 1)
        chunks = [with_repeated_span(c, 2 * queries, picker) if picker.random() < retrieval_fraction else c
                  for c in chunks]
    offsets = position_offsets_for(lengths, config, seed) if position_offsets else [0] * len(chunks)
    model.eval().requires_grad_(False)
    losses: list[float] = []
    bar = tqdm(total=len(chunks), initial=start, desc="gates", disable=not progress)
    try:
        for step in range(start, len(chunks)):
            with capture_gate_losses(model, gates, queries) as layer_losses, torch.no_grad():
                ids = chunks[step][None].to(device)
                positions = torch.arange(offsets[step], offsets[step] + ids.shape[1], device=device)[None]
                model(ids, position_ids=positions, use_cache=False)
            loss = torch.stack(layer_losses).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item() / len(layer_losses))
            bar.set_postfix(kl=f"{losses[-1]:.4f}", refresh=False)
            bar.update()
            if (step + 1) % save_every == 0 or step + 1 == len(chunks):
                torch_save({"config": gates.config, "gates": gates.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step + 1}, checkpoint)
    except BaseException:
        bar.leave = False  # a run that stops (out of memory, Ctrl-C) leaves no half-drawn bar above its error line
        raise
    finally:
        bar.close()
    gates.cpu().save(out)
    return gates, losses
