"""Which layers to convert: an explicit list (``0,2,4`` or ``3-6``), every k-th layer (``every:4``), the complement
of either (``not:every:4``: all layers but every 4th, i.e. 3 of 4 layers converted), or a scored fraction
(``fraction:0.5``).

The scored selector ranks layers by what converting each one alone costs the whole model: every layer gets a GDN/KDA
replacement initialised from its attention and briefly aligned to that attention's output (all layers at once, from
one teacher pass per batch, as in distillation stage 1); then each aligned layer is swapped in alone and the KL
divergence of the model's next-token distribution from the dense model's is measured on held-out calibration
windows. Layers whose swap costs the least KL are converted. The probe accounts for both how well linear attention
can mimic a layer and how much the rest of the network depends on it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from retrofit.errors import RetrofitError


@dataclass
class LayerSpec:
    """A parsed ``--layers`` value: ``explicit`` indices, ``every`` k (offset), their ``complement`` (indices), or a
    scored ``fraction``."""

    kind: str
    indices: tuple[int, ...] = ()
    every: int = 0
    offset: int = 0
    fraction: float = 0.0

    @property
    def needs_scoring(self) -> bool:
        return self.kind == "fraction"


def parse_layer_spec(spec: str, num_layers: int) -> LayerSpec:
    """Parse ``0,2,4`` / ``3-6`` / ``every:K[:OFFSET]`` / ``not:SPEC`` / ``fraction:F``, raising RetrofitError on
    bad input.

    ``every:K`` converts layers K-1, 2K-1, ... (every K-th layer counting from 1, so layer 0 stays dense);
    ``every:K:OFFSET`` starts at OFFSET instead. ``not:SPEC`` converts every layer that the list or ``every`` SPEC
    does not name: ``not:every:4`` keeps layers 3, 7, 11, ... softmax and converts the other three in four.
    At least one softmax attention layer must remain: transformers' decoder (masks, generation) reads the sequence
    length from an attention layer of the cache.
    """
    parsed = _parse_layer_spec(spec, num_layers)
    if len(parsed.indices) >= num_layers:
        raise RetrofitError(f"--layers {spec!r} converts all {num_layers} layers: keep at least one softmax attention "
                            "layer (transformers reads the sequence length from one)")
    return parsed


def _parse_layer_spec(spec: str, num_layers: int) -> LayerSpec:
    text = str(spec).strip().replace(" ", "")
    if not text:
        raise RetrofitError("--layers is empty; use e.g. 0,2,4 or every:4 or not:every:4 or fraction:0.5")
    if text.startswith("not:"):
        return _complement(spec, text[len("not:"):], num_layers)
    if text.startswith("every:"):
        parts = text.split(":")
        try:
            k = int(parts[1])
            offset = int(parts[2]) if len(parts) > 2 else k - 1
        except (ValueError, IndexError):
            raise RetrofitError(f"bad --layers {spec!r}: expected every:K or every:K:OFFSET with integers") from None
        if k < 1 or len(parts) > 3:
            raise RetrofitError(f"bad --layers {spec!r}: K must be >= 1")
        if not 0 <= offset < num_layers:
            raise RetrofitError(f"bad --layers {spec!r}: offset {offset} is outside 0..{num_layers - 1}")
        return LayerSpec("every", tuple(range(offset, num_layers, k)), every=k, offset=offset)
    if text.startswith("fraction:"):
        try:
            fraction = float(text.split(":", 1)[1])
        except ValueError:
            raise RetrofitError(f"bad --layers {spec!r}: expected fraction:F with 0 < F <= 1") from None
        if not 0 < fraction <= 1:
            raise RetrofitError(f"bad --layers {spec!r}: the fraction must be in (0, 1]")
        return LayerSpec("fraction", fraction=fraction)
    if not re.fullmatch(r"[0-9,\-]+", text):
        raise RetrofitError(f"bad --layers {spec!r}: use a list like 0,2,4 (ranges 3-6 allowed), every:K, not:SPEC "
                            "or fraction:F")
    indices: list[int] = []
    for part in filter(None, text.split(",")):
        if "-" in part:
            lo, _, hi = part.partition("-")
            if not lo or not hi or int(hi) < int(lo):
                raise RetrofitError(f"bad --layers {spec!r}: bad range {part!r}")
            indices.extend(range(int(lo), int(hi) + 1))
        else:
            indices.append(int(part))
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise RetrofitError(f"layer index {bad[0]} is out of range: the model has {num_layers} layers (0..{num_layers - 1})")
    if not indices:
        raise RetrofitError(f"bad --layers {spec!r}: no layer index in it")
    return LayerSpec("explicit", tuple(sorted(set(indices))))


def _complement(spec: str, inner: str, num_layers: int) -> LayerSpec:
    """``not:INNER``: the layers of ``0..num_layers-1`` that the list or ``every`` spec INNER leaves out."""
    if not inner:
        raise RetrofitError(f"bad --layers {spec!r}: expected not:SPEC, e.g. not:every:4 or not:0,5")
    if inner.startswith(("not:", "fraction:")):
        raise RetrofitError(f"bad --layers {spec!r}: in not:SPEC, SPEC must be a list or every:K, got {inner!r}")
    excluded = set(_parse_layer_spec(inner, num_layers).indices)
    kept = tuple(i for i in range(num_layers) if i not in excluded)
    if not kept:
        raise RetrofitError(f"bad --layers {spec!r}: it leaves no layer to convert (the model has {num_layers})")
    return LayerSpec("complement", kept)


def layer_count(fraction: float, num_layers: int) -> int:
    """Layers converted for a fraction: round(F * L), at least 1, at most L - 1 (one softmax layer stays)."""
    return max(1, min(num_layers - 1, round(fraction * num_layers)))


@dataclass
class LayerScore:
    layer: int
    kl: float  # KL(dense || dense with only this layer converted), nats per token
    align_error: float  # relative MSE of the aligned layer against its attention output


def score_layers(dense, windows: torch.Tensor, layer_type: str = "gdn", align_steps: int = 30,
                 batch_size: int = 4, probe_windows: int = 8, lr: float = 1e-3, device=None,
                 show_progress: bool = True, aligned: dict | None = None) -> list[LayerScore]:
    """Score every layer of ``dense`` (see the module docstring) -> scores sorted from cheapest to costliest.

    windows: ``[N, L]`` calibration tokens; the last ``probe_windows`` are held out for the KL probe and the rest
    feed the alignment (``align_steps`` steps of ``batch_size`` windows). If ``aligned`` is a dict, it receives
    layer index -> the aligned replacement layer.
    """
    from retrofit.convert.build import to_hybrid
    from retrofit.convert.data import BatchSampler
    from retrofit.convert.objectives import AttentionCapture, LayerAligner, kl_loss, warmup_cosine
    from retrofit.hybrid import HybridSection
    from retrofit.model_info import attention_layout

    layout = attention_layout(dense)
    num_layers = layout.num_layers
    device = device or next(dense.parameters()).device
    if windows.shape[0] <= probe_windows:
        raise RetrofitError(f"need more than {probe_windows} calibration windows to score layers; "
                            f"got {windows.shape[0]} (raise --tokens)")
    train, probe = windows[:-probe_windows], windows[-probe_windows:].to(device)
    everything = list(range(num_layers))
    section = HybridSection(layers=everything, layer_type=layer_type, base_model_type=dense.config.model_type)
    candidates = to_hybrid(dense, section)
    replacements = {i: candidates.model.layers[i].self_attn for i in everything}
    aligner = LayerAligner(replacements).train()
    aligner.requires_grad_(True)
    dense.requires_grad_(False)
    opt = torch.optim.AdamW(aligner.parameters(), lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(align_steps, 0.1))
    sampler = BatchSampler(train, batch_size, seed=12345)
    capture = AttentionCapture(dense, everything)
    bar = range(align_steps)
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc="scoring: align every layer", unit="step")
    try:
        for step in bar:
            records = capture.run(dense, sampler.batch(step).to(device))
            loss = aligner(records)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(aligner.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if show_progress:
                bar.set_postfix(rel_mse=f"{float(loss.detach()):.4f}")
        aligner.eval().requires_grad_(False)
        with torch.no_grad():
            records = capture.run(dense, probe)
            errors = {}
            for i in everything:
                rec = records[i]
                out = replacements[i](hidden_states=rec["hidden_states"], position_embeddings=rec["position_embeddings"],
                                      attention_mask=rec["attention_mask"])[0]
                target = rec["target"].float()
                errors[i] = float(((out.float() - target) ** 2).mean() / target.pow(2).mean().clamp_min(1e-12))
    finally:
        capture.remove()
    scores = []
    with torch.no_grad():
        reference = dense(input_ids=probe, use_cache=False).logits
        layers_iter = everything
        if show_progress:
            from tqdm import tqdm

            layers_iter = tqdm(everything, desc="scoring: KL probe per layer", unit="layer")
        for i in layers_iter:
            block = dense.model.layers[i]
            original = block.self_attn
            block.self_attn = replacements[i]
            try:
                logits = dense(input_ids=probe, use_cache=False).logits
            finally:
                block.self_attn = original
            scores.append(LayerScore(i, float(kl_loss(logits, reference)), errors[i]))
    if aligned is not None:
        aligned.update(replacements)
    return sorted(scores, key=lambda s: (s.kl, s.layer))


def ranking_table(scores: list[LayerScore], chosen: list[int] | None = None) -> str:
    """Markdown table of the ranking (cheapest first)."""
    chosen = set(chosen or [])
    lines = ["| rank | layer | KL if converted (nats/token) | aligned rel. MSE | selected |",
             "|---:|---:|---:|---:|:---:|"]
    for rank, s in enumerate(scores, 1):
        lines.append(f"| {rank} | {s.layer} | {s.kl:.4f} | {s.align_error:.4f} | {'x' if s.layer in chosen else ''} |")
    return "\n".join(lines)


def choose(scores: list[LayerScore], fraction: float, num_layers: int) -> list[int]:
    """The ``round(fraction * L)`` cheapest layers, sorted by index."""
    return sorted(s.layer for s in scores[: layer_count(fraction, num_layers)])
