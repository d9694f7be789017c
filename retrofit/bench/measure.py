"""Prefill and decode latency, tokens/s, peak memory, cache bytes and the bytes floor of one (context, batch) point.

Four engines time the same random prompt:

- ``retrofit`` (default): ``retrofit.generate``'s engine: a static cache, the decode step captured as a CUDA graph
  on CUDA (eager elsewhere, and for methods whose step cannot be captured: RetrievalAttention), the supported decoder
  layers fused where the kernels run on Triton (:mod:`retrofit.generation.fused_layers`);
- ``retrofit-unfused``: the same engine with ``fuse_layers=False``: the model's own decoder layers (what the fused
  layers save, side by side with ``retrofit``);
- ``transformers``: ``model.generate`` with its growing cache; a logits processor stamps the time after every step
  (after a device synchronize): the first stamp ends the prefill;
- ``transformers-compile``: ``model.generate`` with transformers' own static cache and ``torch.compile`` of the
  forward (the path a user would pick instead); refused for sparse variants, which need their own cache.

Each point runs ``warmup`` untimed generations, then ``repeats`` timed ones, and reports the medians with their
spread (``(max - min) / median``): a single sample swings several times on a loaded machine. The device is
synchronised around each timed phase. Decode time is per step (one token for each of the ``batch`` rows). Prefill time
is the prompt's forward and the choice of the first token; time to first token adds that token's copy to the host.
Under a sparse prefill (``retrofit.sparse.sparse_prefill``) each point also records the share of the causal blocks
each layer computed in its first timed run.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from retrofit.bench.floor import floor_seconds
from retrofit.bench.memory import tensor_bytes
from retrofit.memory import MemoryProbe, allocation_detail, is_out_of_memory, release_memory

ENGINES = ("retrofit", "retrofit-unfused", "transformers", "transformers-compile")


@dataclass
class BenchPoint:
    """One measurement. Times in seconds (medians over ``repeats``), memory in bytes."""

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
    engine: str = "retrofit"
    repeats: int = 1
    prefill_spread: float = float("nan")
    decode_spread: float = float("nan")
    floor_s_per_token: float = float("nan")
    captured: bool | None = None
    ttft_s: float = float("nan")
    blocks_computed: dict[int, float] | None = None
    prefill_sparse: bool | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.context / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch / self.decode_s_per_token if self.decode_s_per_token > 0 else float("nan")

    @property
    def floor_ratio(self) -> float:
        """Measured decode step over the bytes floor (1.0 = at the floor)."""
        return self.decode_s_per_token / self.floor_s_per_token if self.floor_s_per_token > 0 else float("nan")

    def to_json(self) -> dict[str, object]:
        record = asdict(self)
        record["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        record["decode_tokens_per_s"] = self.decode_tokens_per_s
        record["floor_ratio"] = self.floor_ratio
        return record


@dataclass
class Sample:
    """One timed generation: prefill seconds, decode seconds per step, the cache it left, whether it was graphed,
    the time to first token (the prefill and the first token on the host)."""

    prefill_s: float
    decode_s_per_token: float
    cache: object
    captured: bool | None = None
    ttft_s: float = float("nan")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_prompt(model, context: int, batch: int, seed: int) -> torch.Tensor:
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (batch, context), generator=generator).to(device)


# steps run (untimed) before the timed decode steps: the first runs eagerly, the second captures the graph
SETTLE_STEPS = 2


def time_retrofit(model, input_ids: torch.Tensor, decode_tokens: int, fuse_layers: bool = True) -> Sample:
    """Prefill, settle (first step, capture), then ``decode_tokens`` timed steps of retrofit's engine (with its
    fused decoder layers, or the model's own)."""
    from retrofit.generation import DecodeLoop, SamplingOptions, StaticGeneration
    from retrofit.generation.generate import graphs_wanted
    from retrofit.generation.sampling import TokenChooser

    device = input_ids.device
    generation = StaticGeneration(model, input_ids, torch.ones_like(input_ids), decode_tokens + SETTLE_STEPS + 1,
                                  TokenChooser(SamplingOptions(), device), eos=[], pad=0, fuse_layers=fuse_layers)
    use_graph = graphs_wanted(generation, None)
    loop = DecodeLoop(generation, use_graph=use_graph)
    with generation.installed():
        _synchronize(device)
        began = time.perf_counter()
        generation.prefill()
        _synchronize(device)
        prefilled = time.perf_counter()
        generation.out[:, :1].cpu()  # the first token, where a caller reads it
        first_token = time.perf_counter()
        loop.run(SETTLE_STEPS, stop_at_end=False)
        _synchronize(device)
        settled = time.perf_counter()
        loop.run(decode_tokens, stop_at_end=False)
        _synchronize(device)
        decoded = time.perf_counter()
    return Sample(prefilled - began, (decoded - settled) / decode_tokens, generation.cache, use_graph,
                  first_token - began)


class _StepClock:
    """A logits processor that records ``time.perf_counter()`` after each generation step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def time_transformers(model, input_ids: torch.Tensor, decode_tokens: int, compiled: bool = False) -> Sample:
    """``model.generate`` of ``decode_tokens + 1`` tokens, stamped after every step; ``compiled``: with transformers'
    static cache and ``torch.compile`` (its own automatic compilation of the decode forward)."""
    from transformers import CompileConfig, LogitsProcessorList

    device = input_ids.device
    clock = _StepClock(device)
    options = {}
    if compiled:
        compile_config = CompileConfig()
        # transformers compiles the decode forward of a static cache by itself on CUDA; elsewhere only when asked
        compile_config._compile_all_devices = device.type != "cuda"
        options = {"cache_implementation": "static", "compile_config": compile_config}
    _synchronize(device)
    began = time.perf_counter()
    output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1,
                            logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=True,
                            pad_token_id=0, temperature=None, top_p=None, top_k=None, **options)
    cache = output.cache if "cache" in output else output.get("past_key_values")  # renamed in transformers 5
    decode = (clock.stamps[-1] - clock.stamps[0]) / decode_tokens
    return Sample(clock.stamps[0] - began, decode, cache, None, clock.stamps[0] - began)


def refusal(model, engine: str) -> str | None:
    """Why ``engine`` cannot time this model, or None."""
    from retrofit.sparse.patch import active_session

    if engine == "transformers-compile" and active_session(model) is not None:
        return ("refused: transformers' static cache and torch.compile cannot run sparse decoding (its own cache "
                "and attention); use --engine retrofit or transformers")
    return None


def _spread(values: list[float]) -> float:
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else float("nan")


@torch.no_grad()
def measure_point(model, variant: str, context: int, batch: int, decode_tokens: int, seed: int = 0,
                  engine: str = "retrofit", repeats: int = 1, warmup: int = 0,
                  bandwidth: float | None = None) -> BenchPoint:
    """``warmup`` + ``repeats`` generations of ``decode_tokens`` after a random prompt ``[batch, context]`` with
    ``engine``; the medians, their spread, the first timed run's peak memory, the cache bytes and (with the copy
    ``bandwidth`` in bytes/s) the bytes floor of a step. See the module docstring."""
    reason = refusal(model, engine)
    if reason is not None:
        return failed_point(variant, context, batch, decode_tokens, reason, engine)
    from retrofit.sparse.prefill import active_prefill, blocks_computed

    device = next(model.parameters()).device
    input_ids = _random_prompt(model, context, batch, seed)
    prefill = active_prefill(model)

    def timed() -> Sample:
        if engine in ("retrofit", "retrofit-unfused"):
            return time_retrofit(model, input_ids, decode_tokens, fuse_layers=engine == "retrofit")
        return time_transformers(model, input_ids, decode_tokens, compiled=engine == "transformers-compile")

    try:
        for _ in range(warmup + (1 if engine == "transformers-compile" else 0)):  # compiling is not timed
            timed()
    except Exception as error:  # noqa: BLE001 - transformers' compiled path fails on models it does not support
        if engine != "transformers-compile" or is_out_of_memory(error):
            raise
        first = (str(error).strip().splitlines() or [""])[0][:120]
        return failed_point(variant, context, batch, decode_tokens,
                            f"transformers-compile failed here: {type(error).__name__}: {first}", engine)
    samples = []
    if prefill is not None:
        prefill.take_calls()  # the warm-up's
    with MemoryProbe(device) as probe:
        samples.append(timed())
    calls = prefill.take_calls() if prefill is not None else []
    for _ in range(repeats - 1):
        samples[-1].cache = None  # keep one cache alive at a time
        gc.collect()
        samples.append(timed())
    cache = samples[-1].cache
    floor = (floor_seconds(model, cache, context + decode_tokens // 2, bandwidth) if bandwidth
             else float("nan"))
    point = BenchPoint(variant, context, batch, decode_tokens,
                       statistics.median(s.prefill_s for s in samples),
                       statistics.median(s.decode_s_per_token for s in samples),
                       probe.result.peak, probe.result.delta, tensor_bytes(cache), probe.result.kind,
                       engine=engine, repeats=repeats, prefill_spread=_spread([s.prefill_s for s in samples]),
                       decode_spread=_spread([s.decode_s_per_token for s in samples]), floor_s_per_token=floor,
                       captured=samples[-1].captured, ttft_s=statistics.median(s.ttft_s for s in samples),
                       blocks_computed=blocks_computed(calls) if calls else None,
                       prefill_sparse=any(call.sparse for call in calls) if calls else None)
    del samples, cache
    return point


OUT_OF_MEMORY = "out of memory"  # how a point that did not fit begins its error


def failed_point(variant: str, context: int, batch: int, decode_tokens: int, error: str,
                 engine: str = "retrofit") -> BenchPoint:
    nan = float("nan")
    return BenchPoint(variant, context, batch, decode_tokens, nan, nan, 0, 0, 0, "", error, engine=engine)


def warm_up(model, engine: str = "retrofit") -> None:
    """One tiny generation so that kernel selection and allocator growth are not billed to the first point."""
    if refusal(model, engine) is None:
        measure_point(model, "warm-up", context=16, batch=1, decode_tokens=2, engine=engine)


def run_bench(model, variants, tokenizer, contexts: list[int], batches: list[int], decode_tokens: int,
              engine: str = "retrofit", repeats: int = 1, warmup: int = 0, bandwidth: float | None = None,
              on_point: Callable[[list[BenchPoint]], None] | None = None) -> list[BenchPoint]:
    """Every (variant, context, batch) point, dense first; an out-of-memory point is recorded, not fatal.

    on_point(points so far) runs after every point, so that a run cut short (a time limit, a crash in a later
    variant) still leaves what it measured.

    Variants run one at a time: whatever a variant built (a converted model's new layers) is released, and on CUDA
    the allocator's cache emptied, before the next one opens."""
    from retrofit.variants import dense

    points = []
    device = next(model.parameters()).device
    settings = dict(engine=engine, repeats=repeats, warmup=warmup, bandwidth=bandwidth)

    def record(point: BenchPoint) -> None:
        points.append(point)
        if on_point is not None:
            on_point(points)

    for variant in [dense(), *variants]:
        _measure_variant(model, variant, tokenizer, contexts, batches, decode_tokens, device, settings, record)
        release_memory(device)  # the variant's model is unreachable once _measure_variant returned
    return points


def _measure_variant(model, variant, tokenizer, contexts: list[int], batches: list[int], decode_tokens: int,
                     device: torch.device, settings: dict, record: Callable[[BenchPoint], None]) -> None:
    with variant.open(model, tokenizer) as measured:
        warm_up(measured, settings["engine"])
        for context in contexts:
            for batch in batches:
                try:
                    point = measure_point(measured, variant.name, context, batch, decode_tokens, **settings)
                except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
                    if not is_out_of_memory(error):
                        raise
                    point = failed_point(variant.name, context, batch, decode_tokens,
                                         f"{OUT_OF_MEMORY} ({allocation_detail(error)[1]})", settings["engine"])
                release_memory(device)  # what the point held (or the failed attempt) is unreachable by now
                record(point)
