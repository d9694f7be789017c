"""Run every job on dense and then on each variant, on the same items; collect metrics and tokens/s."""
from __future__ import annotations

from dataclasses import dataclass, field

from retrofit.eval.loglikelihood import Throughput
from retrofit.eval.tasks import Job
from retrofit.variants import Variant, dense


@dataclass
class EvalReport:
    """``results[variant][task][metric]``, ``throughput[variant] = {tokens, seconds, tokens_per_s}``, config."""

    results: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)

    @property
    def variants(self) -> list[str]:
        return list(self.results)

    def to_json(self) -> dict[str, object]:
        return {"results": self.results, "throughput": self.throughput, "config": self.config}


def run_eval(model, tokenizer, jobs: list[Job], variants: list[Variant], batch_size: int = 8,
             config: dict[str, object] | None = None) -> EvalReport:
    """Prepare the jobs once (items/tokenization), then run them under ``dense`` and each variant in turn."""
    for job in jobs:
        job.prepare(model, tokenizer)
    report = EvalReport(config=dict(config or {}))
    for variant in [dense(), *variants]:
        throughput = Throughput()
        with variant.open(model, tokenizer) as evaluated:
            report.results[variant.name] = {job.key: job.run(evaluated, tokenizer, batch_size, throughput)
                                            for job in jobs}
        report.throughput[variant.name] = {"tokens": float(throughput.tokens), "seconds": throughput.seconds,
                                           "tokens_per_s": throughput.tokens_per_second}
    return report
