"""Prefill and decode latency, tokens/s, peak memory and cache bytes of one (context, batch) point.

Both phases run through the model's own ``generate`` (greedy, a fixed number of new tokens), so a variant that
patches generation (sparse decoding installs its cache there) is the path that is timed. A logits processor
stamps the time after every step (after a device synchronize): the first stamp ends the prefill, the following
``decode_tokens`` stamps are single-token decode steps.
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


class _StepClock:
    """A logits processor that records ``time.perf_counter()`` after each generation step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_point(model, variant: str, context: int, batch: int, decode_tokens: int, seed: int = 0) -> BenchPoint:
    """Greedy-generate ``decode_tokens`` tokens after a random prompt ``[batch, context]``; see module doc."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    input_ids = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    attention_mask = torch.ones_like(input_ids)
    clock = _StepClock(device)
    _synchronize(device)
    with MemoryProbe(device) as probe:
        began = time.perf_counter()
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1,
                                logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=True,
                                pad_token_id=0, temperature=None, top_p=None, top_k=None)
    cache = output.cache if "cache" in output else output.get("past_key_values")  # renamed in transformers 5
    cache_bytes = tensor_bytes(cache)
    del cache
    del output
    prefill = clock.stamps[0] - began
    decode = (clock.stamps[-1] - clock.stamps[0]) / decode_tokens if decode_tokens else float("nan")
    return BenchPoint(variant, context, batch, decode_tokens, prefill, decode, probe.result.peak,
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
    from retrofit.eval.variants import dense

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
