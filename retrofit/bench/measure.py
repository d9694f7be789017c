"""Prefill and decode latency, tokens/s, peak memory and cache bytes of one (context, batch) point.

Both phases run through ``retrofit.generation`` (the prefill, then greedy single-token decode steps), the loop
``retrofit generate`` and eval use, on the model as the variant opened it (sparse decoding installs its cache and
attention on the model's forward), so the timed path is the one users run. The device is synchronised after the
prefill and after every decode step, and each is timed on its own.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch

from retrofit.bench.memory import MemoryProbe, tensor_bytes


@dataclass
class BenchPoint:
    """One measurement. Times in seconds, memory in bytes."""

    variant: str
    context: int
    batch: int
    decode_tokens: int
    prefill_s: float
    decode_s_per_token: float
    peak_bytes: int
    peak_delta_bytes: int
    cache_bytes: int
    memory_kind: str
    error: str | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.context / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch / self.decode_s_per_token if self.decode_s_per_token > 0 else float("nan")

    def to_json(self) -> dict[str, object]:
        record = asdict(self)
        record["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        record["decode_tokens_per_s"] = self.decode_tokens_per_s
        return record


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_point(model, variant: str, context: int, batch: int, decode_tokens: int, seed: int = 0) -> BenchPoint:
    """Prefill a random prompt ``[batch, context]``, then ``decode_tokens`` greedy decode steps; see module doc."""
    from retrofit.generation import decode_step, greedy, prefill

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    input_ids = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    _synchronize(device)
    with MemoryProbe(device) as probe:
        began = time.perf_counter()
        logits, state = prefill(model, input_ids)
        tokens = greedy(logits)
        _synchronize(device)
        prefilled = time.perf_counter()
        for _ in range(decode_tokens):
            tokens = greedy(decode_step(model, tokens, state))
        _synchronize(device)
        decoded = time.perf_counter()
    cache_bytes = tensor_bytes(state.cache)
    del state
    decode = (decoded - prefilled) / decode_tokens if decode_tokens else float("nan")
    return BenchPoint(variant, context, batch, decode_tokens, prefilled - began, decode, probe.result.peak,
                      probe.result.delta, cache_bytes, probe.result.kind)


def failed_point(variant: str, context: int, batch: int, decode_tokens: int, error: str) -> BenchPoint:
    nan = float("nan")
    return BenchPoint(variant, context, batch, decode_tokens, nan, nan, 0, 0, 0, "", error)


def warm_up(model) -> None:
    """One tiny generate so that kernel selection and allocator growth are not billed to the first point."""
    measure_point(model, "warm-up", context=16, batch=1, decode_tokens=2)


def run_bench(model, variants, tokenizer, contexts: list[int], batches: list[int], decode_tokens: int
              ) -> list[BenchPoint]:
    """Every (variant, context, batch) point, dense first; an out-of-memory point is recorded, not fatal.

    Variants run one at a time: whatever a variant built (a converted model's new layers) is released, and on CUDA
    the allocator's cache emptied, before the next one opens."""
    from retrofit.variants import dense

    points = []
    device = next(model.parameters()).device
    for variant in [dense(), *variants]:
        points += _measure_variant(model, variant, tokenizer, contexts, batches, decode_tokens, device)
        gc.collect()  # the variant's model is unreachable once _measure_variant returned
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return points


def _measure_variant(model, variant, tokenizer, contexts: list[int], batches: list[int], decode_tokens: int,
                     device: torch.device) -> list[BenchPoint]:
    points = []
    with variant.open(model, tokenizer) as measured:
        warm_up(measured)
        for context in contexts:
            for batch in batches:
                try:
                    points.append(measure_point(measured, variant.name, context, batch, decode_tokens))
                except torch.OutOfMemoryError as error:
                    points.append(failed_point(variant.name, context, batch, decode_tokens,
                                               f"out of memory: {str(error).splitlines()[0][:120]}"))
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return points
