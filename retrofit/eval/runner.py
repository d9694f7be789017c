"""Run every job on dense and then on each variant, on the same items; collect metrics with their uncertainty, the
paired deltas to dense, per-item records and tokens/s."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from retrofit.atomic import write_text

from retrofit.eval.batching import BatchSizes
from retrofit.eval.loglikelihood import Throughput
from retrofit.eval.outcome import UNITS, TaskOutcome, as_outcome, summarize, summarize_against
from retrofit.eval.progress import variant_running
from retrofit.eval.tasks import Job
from retrofit.generation import release
from retrofit.memory import release_memory
from retrofit.model_info import model_device
from retrofit.sparse.prefill import active_prefill, share_computed
from retrofit.variants import Variant, dense


@dataclass
class EvalReport:
    """``results[variant][task][metric]`` (names and units: :mod:`retrofit.eval.outcome`),
    ``throughput[variant] = {tokens, seconds, tokens_per_s}``, ``config``, ``dense_by_construction[variant]`` (the
    tasks on which the variant cannot differ from dense: a decode-only variant on a task scored by forward passes
    alone, which takes dense's outcome there instead of running again) and ``samples[variant][task]`` (one record
    per item, for ``--log-samples``); ``blocks_computed[variant][task]``: under a sparse prefill, the share of the
    causal key blocks its prefill calls computed (every layer and call of the task pooled; calls that ran dense,
    under ``min_length``, count every block)."""

    results: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)
    dense_by_construction: dict[str, list[str]] = field(default_factory=dict)
    samples: dict[str, dict[str, list[dict]]] = field(default_factory=dict)
    batch_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    batch_auto: bool = False
    blocks_computed: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def variants(self) -> list[str]:
        return list(self.results)

    def to_json(self) -> dict[str, object]:
        return {"results": self.results, "dense_by_construction": self.dense_by_construction, "units": UNITS,
                "throughput": self.throughput, "config": self.config, "prefill_blocks_computed": self.blocks_computed}


def run_eval(model, tokenizer, jobs: list[Job], variants: list[Variant], batch_size: int | str = 8,
             config: dict[str, object] | None = None) -> EvalReport:
    """Prepare the jobs once (items/tokenization), then run them under ``dense`` and each variant in turn.

    ``batch_size``: rows per forward / generate call, or ``"auto"``: per variant and job the largest batch that fits
    (:mod:`retrofit.eval.batching`; ``report.batch_sizes`` says what each job ran at). Each variant's kept engine
    state is freed before the next variant allocates its own (:func:`retrofit.generation.release`).

    A variant's results carry the paired delta to dense per metric. A ``decode_only`` variant (sparse decoding) on
    a ``prefill_only`` job takes dense's outcome (sparse decoding leaves every forward pass over a prompt
    bit-identical: tests/test_sparse_decoding.py holds every method to it) and is listed in
    ``report.dense_by_construction``; the table says "dense by construction" there, and the variant's tokens/s
    counts the tasks it ran."""
    for job in jobs:
        job.prepare(model, tokenizer)
    report = EvalReport(config=dict(config or {}))
    batches = BatchSizes.of(batch_size)
    dense_outcomes: dict[str, TaskOutcome] = {}
    for variant in [dense(), *variants]:
        throughput = Throughput()
        results: dict[str, dict[str, float]] = {}
        samples: dict[str, list[dict]] = {}
        blocks: dict[str, float] = {}
        with variant.open(model, tokenizer) as evaluated, variant_running(variant.name):
            prefill = active_prefill(evaluated)
            try:
                for job in jobs:
                    if variant.decode_only and job.prefill_only:  # no decode step: dense's numbers, by construction
                        outcome = dense_outcomes[job.key]
                    else:
                        outcome = as_outcome(batches.run(job, variant.name, evaluated, tokenizer, throughput,
                                                         forget_attempt=None if prefill is None else prefill.take_calls))
                    if variant.name == "dense":
                        dense_outcomes[job.key] = outcome
                        results[job.key] = summarize(outcome)
                    else:
                        results[job.key] = summarize_against(outcome, dense_outcomes[job.key])
                    samples[job.key] = outcome.samples
                    share = share_computed(prefill.take_calls()) if prefill is not None else None
                    if share is not None:
                        blocks[job.key] = share
            finally:
                # the engine state kept for the variant's model (its static cache and captured step) is freed while
                # the variant is still open, so that none of it is alive when the next variant allocates its own
                release(evaluated)
        del evaluated  # a variant's own model (a loaded hybrid) is unreachable from here on
        release_memory(model_device(model))
        report.results[variant.name] = results
        report.samples[variant.name] = samples
        if blocks:
            report.blocks_computed[variant.name] = blocks
        unchanged = [job.key for job in jobs if variant.decode_only and job.prefill_only]
        if unchanged:
            report.dense_by_construction[variant.name] = unchanged
        report.throughput[variant.name] = {"tokens": float(throughput.tokens), "seconds": throughput.seconds,
                                           "tokens_per_s": throughput.tokens_per_second}
    report.batch_sizes, report.batch_auto = batches.chosen, batches.auto
    report.config["batch_sizes"] = batches.chosen
    return report


def write_samples(report: EvalReport, path: Path) -> Path:
    """``--log-samples``: one JSON line per variant, task and item (``{"variant", "task", "item", ...record}``),
    written atomically (a reader sees the whole file or none of it)."""
    lines = [json.dumps({"variant": variant, "task": task, "item": index, **record})
             for variant, tasks in report.samples.items() for task, records in tasks.items()
             for index, record in enumerate(records)]
    return write_text(path, "\n".join(lines) + "\n" if lines else "")
