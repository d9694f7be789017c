"""Which layers to convert: an explicit list (``0,2,4`` or ``3-6``), every k-th layer (``every:4``), the complement
of either (``not:every:4``: all layers but every 4th, i.e. 3 of 4 layers converted), or a scored fraction
(``fraction:0.5``).

The scored selector ranks layers by what converting each one alone costs the whole model, at short and at long
context:

- *short-window KL* (:mod:`retrofit.convert.layer_probe`): every layer gets a GDN/KDA replacement initialised from
  its attention and briefly aligned to that attention's output (all layers at once, as in distillation stage 1);
  then each aligned layer is swapped in alone and the KL divergence of the model's next-token distribution from
  the dense model's is measured on held-out calibration windows. This accounts for both how well linear attention
  can mimic a layer and how much the rest of the network depends on it, but only within one window;
- *retrieval* (:mod:`retrofit.convert.retrieval_probe`): on needle prompts of 2K-8K tokens built from the
  calibration text, how much of its attention each layer's best head puts on the planted number while the dense
  model reads it back. A linear-attention layer cannot keep such exact long-range recall, which is what every
  converted hybrid lost.

The ranking cost is ``KL / mean(KL) + retrieval_weight * retrieval / mean(retrieval) + copy_weight * copy rate /
mean(copy rate)`` (:class:`SelectSettings`); the layers of least cost are converted. Both weights 0 give the KL-only
ranking.

At aggressive ratios (a quarter of the layers kept softmax) the cheapest layers by that cost come in long runs: on
SmolLM2 at 22 of 30 the last six layers and layers 8-13 are all converted, so the tokens pass six linear layers in a
row with no exact recall between them, where the industry's hybrids (Qwen3-Next, Kimi Linear) keep one softmax layer
in every four. ``max_run`` (``select: max_run``, ``retrofit select --max-run``) bounds the converted layers in a row:
the choice is then the set of least summed cost among those whose runs are at most that long (an exact search over
the layers), and the output says which layers it kept softmax in place of cheaper ones. Without it the output still
names the longest run and why each kept layer stays softmax (which cost term dominates its cost).
"""
from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass

import torch

from retrofit.convert.retrieval_probe import RetrievalScores
from retrofit.convert.select_settings import SelectSettings
from retrofit.errors import RetrofitError
from retrofit.memory import peak_memory_so_far


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


def parse_layer_spec(spec: str, num_layers: int, sliding: tuple[int, ...] = ()) -> LayerSpec:
    """Parse ``0,2,4`` / ``3-6`` / ``every:K[:OFFSET]`` / ``sliding`` / ``not:SPEC`` / ``fraction:F``, raising
    RetrofitError on bad input.

    ``sliding`` converts the model's sliding-window layers (``sliding``: their indices, :func:`sliding_layers_of`),
    the natural first candidates of Gemma 2/3 and Cohere2: their softmax already forgets past its window, and the
    global layers that keep the far context stay softmax.

    ``every:K`` converts layers K-1, 2K-1, ... (every K-th layer counting from 1, so layer 0 stays dense);
    ``every:K:OFFSET`` starts at OFFSET instead. ``not:SPEC`` converts every layer that the list or ``every`` SPEC
    does not name: ``not:every:4`` keeps layers 3, 7, 11, ... softmax and converts the other three in four.
    At least one softmax attention layer must remain: transformers' decoder (masks, generation) reads the sequence
    length from an attention layer of the cache.
    """
    parsed = _parse_layer_spec(spec, num_layers, tuple(sliding))
    if len(parsed.indices) >= num_layers:
        raise RetrofitError(f"--layers {spec!r} converts all {num_layers} layers: keep at least one softmax attention "
                            "layer (transformers reads the sequence length from one)")
    return parsed


def _parse_layer_spec(spec: str, num_layers: int, sliding: tuple[int, ...]) -> LayerSpec:
    text = str(spec).strip().replace(" ", "")
    if not text:
        raise RetrofitError("--layers is empty; use e.g. 0,2,4 or every:4 or not:every:4 or fraction:0.5")
    if text.startswith("not:"):
        return _complement(spec, text[len("not:"):], num_layers, sliding)
    if text == "sliding":
        if not sliding:
            raise RetrofitError(f"--layers {spec!r}: the model has no sliding-window attention layers; name the "
                                "layers (0,2,4, every:K) or a scored fraction:F")
        return LayerSpec("explicit", tuple(sorted(sliding)))
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
        raise RetrofitError(f"bad --layers {spec!r}: use a list like 0,2,4 (ranges 3-6 allowed), every:K, sliding, "
                            "not:SPEC or fraction:F")
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


def _complement(spec: str, inner: str, num_layers: int, sliding: tuple[int, ...]) -> LayerSpec:
    """``not:INNER``: the layers of ``0..num_layers-1`` that the list or ``every`` spec INNER leaves out."""
    if not inner:
        raise RetrofitError(f"bad --layers {spec!r}: expected not:SPEC, e.g. not:every:4 or not:0,5")
    if inner.startswith(("not:", "fraction:")):
        raise RetrofitError(f"bad --layers {spec!r}: in not:SPEC, SPEC must be a list or every:K, got {inner!r}")
    excluded = set(_parse_layer_spec(inner, num_layers, sliding).indices)
    kept = tuple(i for i in range(num_layers) if i not in excluded)
    if not kept:
        raise RetrofitError(f"bad --layers {spec!r}: it leaves no layer to convert (the model has {num_layers})")
    return LayerSpec("complement", kept)


def sliding_layers_of(config) -> tuple[int, ...]:
    """Indices of the sliding-window softmax layers of a model's config, as its family's record describes them."""
    from retrofit import architecture

    text = architecture.text_config(config)
    return tuple(layer.index for layer in architecture.of(config).layers(text) if layer.window is not None)


def layer_count(fraction: float, num_layers: int) -> int:
    """Layers converted for a fraction: round(F * L), at least 1, at most L - 1 (one softmax layer stays)."""
    return max(1, min(num_layers - 1, round(fraction * num_layers)))


@dataclass
class LayerScore:
    """What converting one layer costs. ``kl``: KL(dense || dense with only this layer converted), nats per token;
    ``align_error``: relative MSE of the aligned layer against its attention; ``retrieval``: needle mass of the
    layer's best head and ``copy_rate`` its best head's copy rate (:mod:`retrofit.convert.retrieval_probe`; None when
    not probed); ``cost``: the ranking cost (:class:`SelectSettings`, ``retrieval_weight`` and ``copy_weight``)."""

    layer: int
    kl: float
    align_error: float
    retrieval: float | None = None
    copy_rate: float | None = None
    cost: float = 0.0


def score_layers(dense, windows: torch.Tensor, layer_type: str = "gdn", align_steps: int = 30,
                 batch_size: int = 4, probe_windows: int = 8, lr: float = 1e-3, device=None,
                 show_progress: bool = True, aligned: dict | None = None, retrieval: RetrievalScores | None = None,
                 retrieval_weight: float = 0.0, copy_weight: float = 0.0,
                 seconds: dict | None = None) -> list[LayerScore]:
    """Score every layer of ``dense`` (see the module docstring) -> scores sorted from cheapest to costliest.

    windows: ``[N, L]`` calibration tokens; the last ``probe_windows`` are held out for the KL probe and the rest
    feed the alignment (``align_steps`` steps of ``batch_size`` windows). ``retrieval``: the dense model's retrieval
    scores (:func:`retrofit.convert.retrieval_probe.retrieval_head_scores`), combined into the cost with
    ``retrieval_weight`` and ``copy_weight`` (:func:`combined_costs`). If ``aligned`` is a dict, it receives layer index -> the aligned
    replacement layer; if ``seconds`` is a dict, it receives phase -> wall seconds.

    Memory (:mod:`retrofit.convert.layer_probe`): the weights, the replacements with their gradients and AdamW
    state, every layer's attention input and output for one alignment batch, one layer's autograd graph, and per
    KL pass every layer's input and the dense log-probabilities for 1024 tokens (or one longer window) plus 512 rows
    of the swapped model's logits; nothing grows with ``probe_windows`` or ``align_steps``. SmolLM2-135M on the CPU
    with the defaults (``retrofit select smollm2-135m --fraction 0.25``, 8 needle probes of 2048 tokens included)
    peaks at 3.15 GiB of process RSS, weights and tokenizer included, where it peaked at 12.96 GiB before this bound
    (measured 2026-12-02); ``tests/test_select.py`` holds a small budget under 2.3 GiB.
    """
    from retrofit.convert.layer_probe import align_every_layer, alignment_errors, swap_kl

    device = device or next(dense.parameters()).device
    if windows.shape[0] <= probe_windows:
        raise RetrofitError(f"need more than {probe_windows} calibration windows to score layers; "
                            f"got {windows.shape[0]} (raise --tokens)")
    if (retrieval_weight > 0 or copy_weight > 0) and retrieval is None:
        raise RetrofitError("retrieval_weight or copy_weight > 0 needs the retrieval scores of the dense model")
    train, probe = windows[:-probe_windows], windows[-probe_windows:].to(device)
    with _timed(seconds, "alignment"):
        replacements = align_every_layer(dense, train, layer_type, align_steps, batch_size, lr, device, show_progress)
    with _timed(seconds, "alignment error"):
        errors = alignment_errors(dense, replacements, probe)
    with _timed(seconds, "KL probe"):
        kls = swap_kl(dense, replacements, probe, show_progress)
    if aligned is not None:
        aligned.update(replacements)
    return order_scores(kls, errors, retrieval, retrieval_weight, copy_weight)


def order_scores(kls: dict[int, float], errors: dict[int, float], retrieval: RetrievalScores | None,
                 retrieval_weight: float, copy_weight: float = 0.0) -> list[LayerScore]:
    """Layer -> KL and layer -> alignment error, with the retrieval scores (or None) -> :class:`LayerScore` list
    from cheapest to costliest by :func:`combined_costs` (ties: lower KL, then lower index). With both weights 0
    this is the KL-only order, exactly."""
    layers = sorted(kls)
    needle = retrieval.layer_scores() if retrieval is not None else None
    copies = retrieval.layer_copy_rates() if retrieval is not None else None
    costs = combined_costs([kls[i] for i in layers], needle, retrieval_weight, copies, copy_weight)
    scores = [LayerScore(i, kls[i], errors[i], needle[i] if needle else None, copies[i] if copies else None, cost)
              for i, cost in zip(layers, costs)]
    return sorted(scores, key=lambda s: (s.cost, s.kl, s.layer))


def combined_costs(kl: list[float], retrieval: list[float] | None, weight: float,
                   copy_rate: list[float] | None = None, copy_weight: float = 0.0) -> list[float]:
    """Per layer ``kl / mean(kl) + weight * retrieval / mean(retrieval) + copy_weight * copy_rate /
    mean(copy_rate)`` (a term whose mean is 0 adds nothing).

    Each term is divided by its mean over the layers so that the terms are comparable whatever their units; with
    both weights 0 the cost orders the layers exactly as ``kl`` does (ties broken by ``kl`` in the sort).
    """
    costs = _relative_to_mean(kl, 1.0)
    for values, term_weight in ((retrieval, weight), (copy_rate, copy_weight)):
        if values is not None and term_weight != 0:
            costs = [c + t for c, t in zip(costs, _relative_to_mean(values, term_weight))]
    return costs


def _relative_to_mean(values: list[float], weight: float) -> list[float]:
    """``weight * value / mean(values)`` per value; all 0 where the mean is not positive."""
    mean = sum(values) / len(values)
    return [weight * v / mean if mean > 0 else 0.0 for v in values]


@dataclass
class Ranking:
    """A scored ranking and what it cost: ``scores`` (cheapest first), the dense model's ``retrieval`` scores (None
    when not probed), the ``settings``, wall ``seconds`` per phase and the ``peak_bytes`` of memory (CUDA:
    allocated tensors during scoring; CPU: the process's peak RSS, model loading included)."""

    scores: list[LayerScore]
    retrieval: RetrievalScores | None
    settings: SelectSettings
    seconds: dict[str, float]
    peak_bytes: int
    peak_kind: str

    def summary(self) -> str:
        """Lines under the ranking table: the cost formula, the retrieval probe's sanity numbers, the scoring cost."""
        cost = f"cost = KL / mean(KL) + {self.settings.retrieval_weight:g} x needle mass / mean(needle mass)"
        if self.settings.copy_weight:
            cost += f" + {self.settings.copy_weight:g} x copy rate / mean(copy rate)"
        lines = [cost]
        if self.retrieval is not None:
            probes = self.settings.retrieval_probes
            lines.append(f"retrieval probes: {probes} per context of {', '.join(map(str, self.retrieval.contexts))} "
                         f"tokens; dense answer-token accuracy {100 * self.retrieval.answer_accuracy:.0f}%; a uniform "
                         f"spread would put {self.retrieval.uniform_mass:.4f} on the needle")
        phases = ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items())
        lines.append(f"scoring cost: {sum(self.seconds.values()):.1f} s ({phases}); peak memory "
                     f"{self.peak_bytes / 2 ** 30:.2f} GiB ({self.peak_kind})")
        return "\n".join(lines)


def rank_layers(dense, tokenizer, windows: torch.Tensor, data: list[str], layer_type: str,
                settings: SelectSettings, device=None, show_progress: bool = True,
                aligned: dict | None = None) -> Ranking:
    """Retrieval probes (from the calibration ``data``, when ``settings.retrieval_probes`` > 0), then
    :func:`score_layers` on ``windows [N, L]`` with ``settings`` -> :class:`Ranking`."""
    from retrofit.convert.retrieval_probe import needle_probes, retrieval_head_scores

    device = device or next(dense.parameters()).device
    limit = getattr(dense.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if settings.retrieval_probes and limit and settings.probe_context[-1] > limit:
        raise RetrofitError(f"probe_context {settings.probe_context[-1]} exceeds the model's {limit} positions")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds: dict[str, float] = {}
    retrieval = None
    if settings.retrieval_probes:
        with _timed(seconds, "retrieval probe"):
            probes = [probe for context in settings.probe_context
                      for probe in needle_probes(tokenizer, data, context, settings.retrieval_probes, settings.seed)]
            retrieval = retrieval_head_scores(dense, probes, show_progress)
    scores = score_layers(dense, windows, layer_type=layer_type, align_steps=settings.align_steps,
                          batch_size=settings.batch_size, probe_windows=settings.probe_windows, lr=settings.lr,
                          device=device, show_progress=show_progress, aligned=aligned, retrieval=retrieval,
                          retrieval_weight=settings.retrieval_weight, copy_weight=settings.copy_weight,
                          seconds=seconds)
    peak, kind = peak_memory_so_far(device)
    return Ranking(scores, retrieval, settings, seconds, peak, kind)


@contextlib.contextmanager
def _timed(seconds: dict | None, phase: str):
    """Adds the block's wall seconds to ``seconds[phase]`` (nothing when ``seconds`` is None)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def ranking_table(scores: list[LayerScore], chosen: list[int] | None = None) -> str:
    """Markdown table of the ranking (cheapest first): KL, alignment error, retrieval (needle mass and copy rate of
    the layer's best head; ``-`` when not probed), the ranking cost and the layers chosen for conversion."""
    chosen = set(chosen or [])
    lines = ["| rank | layer | KL if converted (nats/token) | aligned rel. MSE | needle mass (best head) "
             "| copy rate (best head) | cost | converted |",
             "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for rank, s in enumerate(scores, 1):
        lines.append(f"| {rank} | {s.layer} | {s.kl:.4f} | {s.align_error:.4f} | {_optional(s.retrieval)} | "
                     f"{_optional(s.copy_rate)} | {s.cost:.3f} | {'x' if s.layer in chosen else ''} |")
    return "\n".join(lines)


def _optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def choose(scores: list[LayerScore], fraction: float, num_layers: int, max_run: int = 0) -> list[int]:
    """The ``round(fraction * L)`` cheapest layers, sorted by index; with ``max_run`` > 0, the set of that many
    layers of least summed cost among those with at most ``max_run`` converted layers in a row (ties: the one
    nearest the ranking's order). RetrofitError if no such set exists."""
    count = layer_count(fraction, num_layers)
    if max_run <= 0:
        return sorted(s.layer for s in scores[:count])
    kept = num_layers - count
    if count > (kept + 1) * max_run:
        raise RetrofitError(f"max_run {max_run}: {count} converted layers of {num_layers} cannot be split into runs "
                            f"of at most {max_run} by {kept} softmax layers (at most {(kept + 1) * max_run})")
    rank = {s.layer: position for position, s in enumerate(scores)}
    cost = {s.layer: s.cost for s in scores}
    # states after each layer: (converted so far, current run) -> ((summed cost, summed rank), converted layers)
    best: dict[tuple[int, int], tuple[tuple[float, int], tuple[int, ...]]] = {(0, 0): ((0.0, 0), ())}
    for layer in range(num_layers):
        following: dict[tuple[int, int], tuple[tuple[float, int], tuple[int, ...]]] = {}

        def offer(state, value):
            if state not in following or value[0] < following[state][0]:
                following[state] = value

        for (converted, run), (total, layers) in best.items():
            offer((converted, 0), (total, layers))  # the layer stays softmax
            if converted < count and run < max_run:
                offer((converted + 1, run + 1),
                      ((total[0] + cost[layer], total[1] + rank[layer]), layers + (layer,)))
        best = following
    return list(min(value for (converted, _), value in best.items() if converted == count)[1])


def longest_run(converted: list[int], num_layers: int) -> tuple[int, int, int]:
    """The longest run of consecutive converted layers: ``(length, first layer, last layer)`` (``(0, -1, -1)``
    when none)."""
    chosen, found, start = set(converted), (0, -1, -1), None
    for layer in range(num_layers + 1):
        if layer < num_layers and layer in chosen:
            start = layer if start is None else start
        elif start is not None:
            if layer - start > found[0]:
                found = (layer - start, start, layer - 1)
            start = None
    return found


def cost_terms(scores: list[LayerScore], retrieval_weight: float, copy_weight: float) -> dict[int, dict[str, float]]:
    """Layer -> its ranking cost split into its terms (:func:`combined_costs`): ``KL``, ``needle mass`` and ``copy
    rate`` (the last two only where probed and weighted)."""
    layers = [s.layer for s in scores]
    terms = {layer: {} for layer in layers}
    columns = [("KL", [s.kl for s in scores], 1.0)]
    if all(s.retrieval is not None for s in scores):
        columns += [("needle mass", [s.retrieval for s in scores], retrieval_weight),
                    ("copy rate", [s.copy_rate for s in scores], copy_weight)]
    for name, values, weight in columns:
        if weight:
            for layer, value in zip(layers, _relative_to_mean(values, weight)):
                terms[layer][name] = value
    return terms


def explain_choice(scores: list[LayerScore], chosen: list[int], num_layers: int, retrieval_weight: float,
                   copy_weight: float, fraction: float, max_run: int = 0) -> str:
    """Lines saying why the layers kept softmax stay so: each one's largest cost term, the longest run of converted
    layers, and what ``max_run`` changed against the plain cheapest choice."""
    terms = cost_terms(scores, retrieval_weight, copy_weight)
    by_layer = {s.layer: s for s in scores}
    kept = [layer for layer in range(num_layers) if layer not in set(chosen)]
    reasons = []
    for layer in kept:
        term, value = max(terms[layer].items(), key=lambda item: item[1])
        score = by_layer[layer]
        shown = {"KL": f"KL {score.kl:.3f}", "needle mass": f"needle mass {score.retrieval:.3f}",
                 "copy rate": f"copy rate {score.copy_rate:.3f}"}[term]
        reasons.append(f"{layer} ({shown})")
    lines = [f"kept softmax, {len(kept)} of {num_layers}, each by its largest cost term: {', '.join(reasons)}"]
    length, first, last = longest_run(chosen, num_layers)
    lines.append(f"longest run of converted layers: {length} ({first}-{last})" if length > 1 else
                 "no two converted layers in a row")
    if max_run > 0:
        plain = choose(scores, fraction, num_layers)
        if plain != chosen:
            cost = {s.layer: s.cost for s in scores}
            instead = sorted(set(plain) - set(chosen))
            moved = sorted(set(chosen) - set(plain))
            lines.append(f"max_run {max_run}: layers {_listed(instead)} stay softmax and {_listed(moved)} are "
                         f"converted in their place (the cheapest choice with at most {max_run} converted in a row; "
                         f"summed cost {sum(cost[i] for i in chosen):.3f} against {sum(cost[i] for i in plain):.3f})")
        else:
            lines.append(f"max_run {max_run}: the cheapest layers already have no longer run")
    elif length > 3 and len(kept) <= num_layers // 2:
        lines.append(f"a run of {length} linear layers has no exact recall between them; select: max_run (or "
                     "--max-run) bounds it")
    return "\n".join(lines)


def _listed(layers: list[int]) -> str:
    return ", ".join(map(str, layers))
