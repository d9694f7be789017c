"""Batch sizes of an evaluation: a fixed ``--batch-size N``, or ``auto`` (the default), the largest batch that fits
for each variant, task and context length.

``auto`` starts each job at a first guess: the bytes the device has free (:func:`retrofit.memory.available_bytes`,
less a headroom) over an estimate of the bytes one row holds (:func:`row_bytes`: a generation row's static cache and
one prefill chunk's activations, or a scored row's activations and logits), the estimate scaled by what the device
reported for this variant's earlier jobs (their measured peak per row over their estimate, the largest such ratio
seen). If the device runs out of memory all the same, the batch is halved and the job runs again from its first
item, down to one row. A job's scores are therefore exactly those of a fixed batch of the size it ended with, the
size the summary states.

On the CPU an allocation that does not fit rarely fails cleanly (the kernel overcommits, then ends the process), so
the first guess keeps half of the free memory in reserve there; on CUDA a tenth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from retrofit.errors import RetrofitError
from retrofit.eval.loglikelihood import Throughput
from retrofit.generation import cache_capacity
from retrofit.generation.engine import DEFAULT_PREFILL_CHUNK, text_config
from retrofit.memory import MemoryProbe, OutOfMemory, available_bytes, is_out_of_memory, out_of_memory, release_memory
from retrofit.model_info import attention_layout, model_device

AUTO = "auto"
MAX_AUTO_BATCH = 64  # lm-evaluation-harness's default ceiling for its own --batch_size auto
HEADROOM = {"cuda": 0.9, "cpu": 0.5}  # the share of the free bytes a first guess may plan to use
UNSIZED_FIRST_GUESS = 8  # a job that cannot say how large its rows are starts here (and halves if need be)


def parse_batch_size(text: str | int) -> int | str:
    """``--batch-size``: ``"auto"`` or a positive number of rows; anything else is a one-line user error."""
    if isinstance(text, int) or str(text).strip().isdigit():
        value = int(text)
        if value <= 0:
            raise RetrofitError(f"--batch-size must be positive or auto, got {value}")
        return value
    if str(text).strip().lower() == AUTO:
        return AUTO
    raise RetrofitError(f"--batch-size must be a positive number of rows or auto, got {text!r}")


@dataclass(frozen=True)
class RowShape:
    """What one row of a job's batches holds: ``rows`` rows in all, each of at most ``tokens`` prompt (or scored)
    tokens and ``new_tokens`` generated ones (0: scored by one forward pass)."""

    rows: int
    tokens: int
    new_tokens: int = 0


def row_bytes(model, shape: RowShape) -> int:
    """An estimate of the bytes one row of a batch holds at its peak, from the model's shapes and dtype.

    Generation (``new_tokens`` > 0, through :func:`retrofit.generate`): the static KV cache of ``tokens +
    new_tokens`` positions (rounded up to the cache bucket) and one prefill chunk's activations: the hidden states
    and MLP activations of ``[chunk, hidden]`` / ``[chunk, intermediate]``, the chunk's attention mask
    ``[chunk, positions]`` (booleans, and the attention's float copy of it) and the last position's logits. Scoring
    (``new_tokens`` = 0): the same activations over all ``tokens`` without a cache, and the logits ``[tokens, vocab]``
    (in the model's dtype, and a float32 copy of a row's)."""
    config = text_config(model)
    element = next(model.parameters()).element_size()
    hidden, vocab = config.hidden_size, config.vocab_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    if shape.new_tokens > 0:
        positions = cache_capacity(shape.tokens + shape.new_tokens)
        chunk = min(shape.tokens, DEFAULT_PREFILL_CHUNK)
        cache = attention_layout(model).kv_bytes_per_token(element) * positions
        logits = vocab * (element + 4)
    else:
        positions = chunk = shape.tokens
        cache = 0
        logits = shape.tokens * vocab * (element + 4)
    activations = chunk * (8 * hidden + 3 * intermediate) * element
    mask = chunk * positions * (1 + element)
    return cache + activations + mask + logits


@dataclass
class BatchSizes:
    """The batch size of every job of an evaluation: ``fixed`` rows, or ``auto`` (see the module docstring).
    ``chosen[variant][job]`` records the size each job ran at."""

    fixed: int | None = None
    scale: dict[str, float] = field(default_factory=dict)  # variant -> measured bytes per row / estimate (max seen)
    chosen: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, batch_size: int | str) -> "BatchSizes":
        parsed = parse_batch_size(batch_size)
        return cls(fixed=None if parsed == AUTO else parsed)

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def first_guess(self, model, variant: str, shape: RowShape | None) -> int:
        """The batch a job starts at: ``fixed``, or auto's guess from the free bytes and the estimated row."""
        if not self.auto:
            return self.fixed
        if shape is None:
            return UNSIZED_FIRST_GUESS
        device = model_device(model)
        free = available_bytes(device)
        ceiling = max(1, min(shape.rows, MAX_AUTO_BATCH))
        if free is None:
            return min(ceiling, UNSIZED_FIRST_GUESS)
        per_row = row_bytes(model, shape) * self.scale.get(variant, 1.0)
        return max(1, min(ceiling, int(free * HEADROOM.get(device.type, 0.5) // per_row)))

    def run(self, job, variant: str, model, tokenizer, throughput: Throughput, forget_attempt=None):
        """``job.run`` at this job's batch size: on running out of memory under ``auto``, the batch is halved and the
        job runs again from its first item (``forget_attempt()``, when given, is called first: what the failed
        attempt recorded outside the job, a sparse prefill's calls, is dropped with it); a fixed batch (or auto at
        one row) that does not fit is an :class:`~retrofit.memory.OutOfMemory` naming the variant, the job and the
        batch."""
        shape = job.shape() if job.shape is not None else None
        batch = self.first_guess(model, variant, shape)
        device = model_device(model)
        while True:
            attempt = Throughput()
            failure: OutOfMemory | None = None
            try:
                with MemoryProbe(device) as probe:
                    outcome = job.run(model, tokenizer, batch, attempt)
            except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
                if not is_out_of_memory(error):
                    raise
                failure = out_of_memory(error, f"evaluating {variant} on {job.key} at batch {batch}", device=device)
            if failure is None:
                break
            release_memory(device)  # outside the except: the failed attempt's tensors are unreachable now
            if not self.auto or batch == 1:
                if self.auto:
                    failure.advice = "a shorter --context-length, --dtype bfloat16, or another --device"
                raise failure
            batch //= 2
            if forget_attempt is not None:
                forget_attempt()
        throughput.add(attempt)
        self.chosen.setdefault(variant, {})[job.key] = batch
        if self.auto and shape is not None and probe.result.delta > 0:
            measured = probe.result.delta / batch / row_bytes(model, shape)
            self.scale[variant] = max(self.scale.get(variant, 1.0), measured)
        return outcome


def described(sizes: dict[str, int]) -> str:
    """The batch sizes one variant's jobs ran at, for the table: ``"32"`` when every job ran at one size, else
    ``"passkey@8000 32, niah_single@8000 16"``."""
    distinct = set(sizes.values())
    if len(distinct) == 1:
        return str(distinct.pop())
    return ", ".join(f"{job} {size}" for job, size in sizes.items())
