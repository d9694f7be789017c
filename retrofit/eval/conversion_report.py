"""The conversion report: dense beside the new hybrid on data the conversion never saw, and what the conversion cost.

``retrofit convert`` ends with it (:mod:`retrofit.eval.convert_command`); ``retrofit eval MODEL --hybrid DIR
--report`` makes the same table for any existing hybrid. Tasks (names of :mod:`retrofit.eval.tasks`):

- perplexity of a held-out text: ``wikitext2`` (``wikitext2_test.raw`` in the data folder) or ``ppl:TEXT``;
- multiple choice: ``piqa``, ``arc_easy`` unless other tasks are named;
- ``passkey`` and ``niah_single`` at 2K, 4K and 8K tokens, seeds 0-3;
- generation fidelity: ``fidelity`` / ``fidelity:TEXT``, 128 greedy tokens after 16 prompts cut from the same text,
  compared with dense's (:mod:`retrofit.eval.fidelity`).

Every file the report reads is checked against the calibration files before any model work
(:mod:`retrofit.eval.held_out`). ``OUT/report.json`` has ``retrofit eval``'s JSON layout
(``results[variant][task][metric]``, ``dense`` first) and ``config["conversion"]``: wall seconds of the conversion
(all parts of a resumed one), tokens trained, peak memory (the CUDA allocator's peak on a GPU, the process's max RSS
on the CPU), converted layers, recipe.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from retrofit.cliargs import parse_lengths
from retrofit.convert.parts import PartsSoFar
from retrofit.devices import peak_rss_bytes
from retrofit.errors import RetrofitError
from retrofit.eval.runner import EvalReport
from retrofit.eval.tasks import DATA_FILES, FILE_TASKS, EvalSettings, Job, build_jobs, resolve_task, task_data_files
from retrofit.memory import peak_memory_so_far

DEFAULT_TASKS = ("piqa", "arc_easy")
LONG_CONTEXT_TASKS = ("passkey", "niah_single")
DEFAULT_CONTEXT_LENGTHS = (2048, 4096, 8192)
DEFAULT_SEEDS = 4
REPORT_DTYPE = "float32"  # the accuracy reference's dtype, on the CPU and on the GPU (evaluation.md)
REPORT_FILE = "report.json"
# The options that set each ReportSettings field, as messages name them: on `retrofit convert` and on `retrofit eval`.
CONVERT_OPTIONS = {"data_dir": "--report-data-dir", "text": "--report-text", "tasks": "--report-tasks",
                   "limit": "--report-limit", "num_seeds": "--report-seeds", "seq_len": "--report-seq-len",
                   "batch_size": "--report-batch-size", "context_lengths": "--report-context", "skip": "--no-report"}
EVAL_OPTIONS = {"data_dir": "--data-dir", "text": "--tasks ppl:PATH", "tasks": "--tasks", "limit": "--limit",
                "num_seeds": "--num-seeds", "seq_len": "--seq-len", "batch_size": "--batch-size",
                "context_lengths": "--context-length", "skip": "--tasks instead of --report"}


def parse_task_list(text: str) -> tuple[str, ...]:
    """``"piqa,arc_easy"`` -> ``("piqa", "arc_easy")``; ``"none"`` (or nothing) -> ``()``."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    return () if names == ("none",) else names


@dataclass
class ReportSettings:
    """What the report runs. ``text``: the held-out text of perplexity and fidelity (default ``wikitext2_test.raw``
    in ``data_dir``); ``tasks``: the tasks besides the text's two and the long-context ones (default PIQA, ARC-easy);
    ``limit``: first N items / windows / prompts of each task (synthetic tasks: N items per seed)."""

    data_dir: Path | None = None
    text: Path | None = None
    tasks: tuple[str, ...] = DEFAULT_TASKS
    context_lengths: tuple[int, ...] = DEFAULT_CONTEXT_LENGTHS
    num_seeds: int = DEFAULT_SEEDS
    limit: int | None = None
    seq_len: int = 1024
    batch_size: int = 8
    dtype: str = REPORT_DTYPE
    option: dict[str, str] = field(default_factory=lambda: dict(CONVERT_OPTIONS), repr=False, compare=False)

    def __post_init__(self):
        for name, value in (("num_seeds", self.num_seeds), ("batch_size", self.batch_size), ("limit", self.limit)):
            if value is not None and value <= 0:
                raise RetrofitError(f"{self.option[name]} must be positive, got {value}")
        if self.seq_len < 2:
            raise RetrofitError(f"{self.option['seq_len']} must be at least 2, got {self.seq_len}")
        fixed = {"wikitext2", "fidelity", *LONG_CONTEXT_TASKS}
        repeated = sorted({name for name in self.tasks if self.tasks.count(name) > 1})
        if repeated:
            raise RetrofitError(f"{self.option['tasks']} names {', '.join(repeated)} more than once")
        for name in self.tasks:
            if name in fixed or name.startswith(tuple(FILE_TASKS)):
                raise RetrofitError(f"{self.option['tasks']}: {name} is in every report already (perplexity and "
                                    f"fidelity of {self.option['text']}, {', '.join(LONG_CONTEXT_TASKS)}); name the "
                                    "other tasks")
            try:
                resolve_task(name, self.eval_settings())
            except RetrofitError as error:
                raise RetrofitError(f"{self.option['tasks']}: {error}") from None
        if self.data_dir is None and self.text is None:
            raise RetrofitError(f"the conversion report needs the evaluation data: pass {self.option['data_dir']} DIR "
                                f"(the folder with {', '.join(self.files_from_data_dir())}), or {self.option['skip']}")
        if self.data_dir is None and self.files_from_data_dir():
            raise RetrofitError(f"{self.option['tasks']} {','.join(self.tasks)} read "
                                f"{', '.join(self.files_from_data_dir())}: pass {self.option['data_dir']} DIR")

    def files_from_data_dir(self) -> list[str]:
        names = [name for name in self.task_names() if name in DATA_FILES]
        return list(dict.fromkeys(DATA_FILES[name] for name in names))

    def task_names(self) -> list[str]:
        """Perplexity of the text, the other tasks, the long-context tasks, fidelity: the rows of the report."""
        perplexity, fidelity = ("wikitext2", "fidelity") if self.text is None else (f"ppl:{self.text}",
                                                                                   f"fidelity:{self.text}")
        return [perplexity, *self.tasks, *LONG_CONTEXT_TASKS, fidelity]

    def eval_settings(self) -> EvalSettings:
        return EvalSettings(data_dir=self.data_dir, limit=self.limit, seq_len=self.seq_len,
                            context_lengths=self.context_lengths, seed=0, num_seeds=self.num_seeds)

    def config(self) -> dict[str, object]:
        """The facts ``retrofit eval`` records in its JSON config, for this report."""
        settings = self.eval_settings()
        return {"tasks": self.task_names(), "data_dir": str(self.data_dir) if self.data_dir else None,
                "text": str(self.text) if self.text else None, "limit": self.limit, "seq_len": self.seq_len,
                "context_lengths": list(self.context_lengths), "seeds": settings.seeds,
                "batch_size": self.batch_size, "dtype": self.dtype}


def report_settings(data_dir: Path | None, text: Path | None, tasks: str, context: str, seeds: int,
                    limit: int | None, seq_len: int, batch_size: int, dtype: str) -> ReportSettings:
    """ReportSettings from command-line strings (``--report-context 2k,4k``, ``--report-tasks piqa,arc_easy``)."""
    from retrofit.devices import parse_dtype

    parse_dtype(dtype)
    return ReportSettings(data_dir=data_dir, text=text, tasks=parse_task_list(tasks),
                          context_lengths=parse_lengths(context, "--report-context"), num_seeds=seeds, limit=limit,
                          seq_len=seq_len, batch_size=batch_size, dtype=dtype)


def model_directory(model: str) -> Path | None:
    """The directory holding ``model``'s config.json and tokenizer without loading it (an alias or a local model
    directory); None where only loading tells (a .gguf file, a hub id)."""
    from retrofit.load import ALIASES, reference_checkpoint

    if model in ALIASES:
        return Path(reference_checkpoint(model))
    directory = Path(model).expanduser()
    return directory if directory.is_dir() else None


def check_lengths(settings: ReportSettings, model: str) -> None:
    """Context lengths and the perplexity window within ``model``'s positions, and the shortest context long
    enough for a long-context prompt (the tokenizer measures it), when the model's files tell without loading it."""
    from transformers import AutoTokenizer

    from retrofit.eval.synthetic import generate_items
    from retrofit.model_files import read_config

    directory = model_directory(model)
    if directory is None:
        return
    positions = read_config(directory).get("max_position_embeddings")
    longest = max([*settings.context_lengths, settings.seq_len])
    if positions and longest > int(positions):
        option = settings.option["context_lengths" if longest in settings.context_lengths else "seq_len"]
        raise RetrofitError(f"{option} {longest} is over {model}'s limit of {positions} positions "
                            "(max_position_embeddings)")
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    for task in LONG_CONTEXT_TASKS:
        try:
            generate_items(task, tokenizer, min(settings.context_lengths), [0], 1)
        except RetrofitError as error:  # worded for `retrofit eval`: name this command's option
            raise RetrofitError(str(error).replace("--context-length", settings.option["context_lengths"])) \
                from None


def prepare_report(settings: ReportSettings, model: str, calibration: list[Path]) -> list[Job]:
    """Check everything the report will need, before any model work, and build its jobs: task names and files,
    context lengths that fit the model, and no evaluation file in the ``calibration`` files."""
    from retrofit.eval.held_out import check_held_out

    evaluation = settings.eval_settings()
    names = settings.task_names()
    jobs = build_jobs(names, evaluation)
    check_lengths(settings, model)
    files = list(dict.fromkeys(path for name in names for path in task_data_files(name, evaluation)))
    text = settings.text or Path(settings.data_dir) / DATA_FILES["wikitext2"]
    check_held_out(files, [text], calibration)
    return jobs


@dataclass
class ConversionCost:
    """Wall seconds and peak memory of a conversion (filled in when :func:`measure_conversion` exits).

    ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated`` of the converting device on CUDA, else the process's
    maximum resident set size (which includes the Python runtime and libraries, ~0.5 GB)."""

    device: torch.device
    seconds: float = 0.0
    peak_memory_bytes: int = 0
    peak_memory_measure: str = ""
    peak_rss_bytes: int = 0


@contextlib.contextmanager
def measure_conversion(device: torch.device) -> Iterator[ConversionCost]:
    """Time the block and record its peak memory on ``device`` (see :class:`ConversionCost`)."""
    cost = ConversionCost(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    yield cost
    cost.seconds = time.perf_counter() - began
    cost.peak_rss_bytes = peak_rss_bytes()
    cost.peak_memory_bytes, cost.peak_memory_measure = peak_memory_so_far(device)


def conversion_facts(out: Path, cost: ConversionCost, earlier: PartsSoFar, model: str, recipe: str | None,
                     calibration: list[Path]) -> dict[str, object]:
    """``config["conversion"]``: the saved hybrid's retrofit section (layers, distillation) with the cost of all
    its parts (``earlier``: the paused parts before this one; seconds added, the largest peak)."""
    from retrofit.model_files import read_config

    section = read_config(out)["retrofit"]
    distillation = dict(section.get("distillation") or {})
    stage1, stage2, per_step = (distillation.get(key) for key in ("stage1_steps", "stage2_steps", "tokens_per_step"))
    counted = all(isinstance(value, int) for value in (stage1, stage2, per_step))
    trained = distillation.get("tokens_trained")  # every phase at its own tokens per step
    if trained is None and counted:  # a hybrid saved before stage 2 had phases: one tokens-per-step for both stages
        trained = (stage1 + stage2) * per_step
    parts = earlier.plus(cost.seconds, cost.peak_memory_bytes, cost.peak_memory_measure)
    return {"model": model, "recipe": recipe, "out": str(out), "layer_type": section.get("layer_type"),
            "layers": section.get("layers"), "calibration_files": [str(path) for path in calibration],
            "seconds": parts.seconds, "seconds_this_part": cost.seconds,
            "tokens": trained, "token_budget": distillation.get("tokens"),
            "peak_memory_bytes": parts.peak_memory_bytes, "peak_memory_measure": parts.peak_memory_measure,
            "peak_memory_bytes_this_part": cost.peak_memory_bytes,
            "peak_rss_bytes": cost.peak_rss_bytes, "device": str(cost.device), "distillation": distillation}


def run_report(model: str, hybrid_dir: Path, settings: ReportSettings, jobs: list[Job], device: torch.device,
               conversion: dict[str, object] | None = None) -> EvalReport:
    """Load ``model`` (dense) and the saved hybrid (``hybrid:DIR``: this also proves the checkpoint loads), run the
    report's ``jobs`` on both, and write ``hybrid_dir/report.json`` atomically."""
    from retrofit.atomic import write_json
    from retrofit.eval.runner import run_eval
    from retrofit.load import load
    from retrofit.run_info import library_versions
    from retrofit.variants import hybrid

    began = time.perf_counter()
    variant = hybrid(str(hybrid_dir))
    dense, tokenizer = load(model, dtype=settings.dtype, device=device)
    config = {"model": model, **settings.config(), "device": str(next(dense.parameters()).device),
              "variants": ["dense", variant.name], "versions": library_versions(), "model_kind": "dense",
              "hybrid": str(hybrid_dir), "conversion": conversion}
    report = run_eval(dense, tokenizer, jobs, [variant], settings.batch_size, config)
    report.config["wall_seconds"] = time.perf_counter() - began
    write_json(Path(hybrid_dir) / REPORT_FILE, report.to_json())
    return report


def cost_line(conversion: dict[str, object]) -> str:
    """One line: ``conversion: 2 gdn layers (13,22), 20,480 tokens in 1.9 min, peak memory 2.31 GiB (max RSS ...)``."""
    layers = conversion.get("layers") or []
    tokens = conversion.get("tokens")
    trained = f"{tokens:,} tokens" if tokens is not None else f"a budget of {conversion.get('token_budget')} tokens"
    plural = "" if len(layers) == 1 else "s"
    return (f"conversion: {len(layers)} {conversion.get('layer_type')} layer{plural} ({','.join(map(str, layers))}), "
            f"{trained} in {float(conversion['seconds']) / 60:.1f} min, peak memory "
            f"{int(conversion['peak_memory_bytes']) / 2 ** 30:.2f} GiB ({conversion['peak_memory_measure']})")


