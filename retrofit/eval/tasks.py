"""The task registry: a task name -> the evaluation jobs it contributes (one per context length for the
long-context tasks). Items are prepared once, before any variant runs, so every variant sees the same items.

Names: ``wikitext2`` (``wikitext2_test.raw`` in ``--data-dir``), ``ppl:PATH`` (perplexity of any text file),
``piqa``, ``arc_easy``, ``hellaswag``, ``lambada``, a name bound with ``--task-file NAME=PATH`` (multiple-choice
jsonl), the synthetic tasks ``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``vt``, ``cwe``, ``fwe``,
``passkey`` (one result per ``--context-length``, keyed ``TASK@LENGTH``), and ``fidelity`` / ``fidelity:PATH``
(greedy tokens after prompts cut from ``wikitext2_test.raw`` or any text file, compared with dense's:
:mod:`retrofit.eval.fidelity`).
"""
from __future__ import annotations

import difflib

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from retrofit.errors import RetrofitError
from retrofit.eval import cpu_time, fidelity, lambada, multiple_choice, perplexity, synthetic
from retrofit.eval.batching import RowShape
from retrofit.eval.generation import greedy_generate
from retrofit.eval.loglikelihood import Throughput
from retrofit.eval.outcome import MeanMetric, TaskOutcome
from retrofit.model_info import max_model_length
from retrofit.registry import Registry


@dataclass
class EvalSettings:
    """What the jobs need besides the model: data location, limits, lengths, seeds."""

    data_dir: Path | None = None
    limit: int | None = None
    seq_len: int = 1024
    context_lengths: tuple[int, ...] = (4096,)
    seed: int = 0
    num_seeds: int = 1
    haystack: Path | None = None
    task_files: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self):
        if self.limit is not None and self.limit <= 0:
            raise RetrofitError(f"--limit must be a positive number of items, got {self.limit}")
        if self.seq_len < 2:
            raise RetrofitError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.num_seeds <= 0:
            raise RetrofitError(f"--num-seeds must be positive, got {self.num_seeds}")
        for length in self.context_lengths:
            if length <= 0:
                raise RetrofitError(f"--context-length must be positive, got {length}")

    @property
    def seeds(self) -> list[int]:
        return [self.seed + offset for offset in range(self.num_seeds)]

    def data_file(self, task: str, name: str) -> Path:
        if self.data_dir is None:
            raise RetrofitError(f"task {task} reads {name}: pass --data-dir DIR (the folder holding {name})")
        path = Path(self.data_dir) / name
        if not path.is_file():
            raise RetrofitError(f"task {task}: data file not found: {path}")
        return path


@dataclass
class Job:
    """One task result (a task, or a synthetic task at one context length): ``prepare(model, tokenizer)`` once,
    then ``run(model, tokenizer, batch_size, throughput)`` per variant, returning a :class:`TaskOutcome` (per-item
    values: stderr and paired deltas) or a plain ``{metric: value}``.

    ``prefill_only``: the task is scored from forward passes alone (perplexity, multiple choice, LAMBADA), never a
    decode step, so a variant that changes decode steps only (sparse decoding) gives dense's numbers by
    construction and is not run on it.

    ``shape`` (after ``prepare``): how many rows the job batches and how long the longest is, for ``--batch-size
    auto``'s first guess (:mod:`retrofit.eval.batching`); None: no guess, auto starts small."""

    key: str
    run: Callable[..., TaskOutcome | dict[str, float]]
    prepare: Callable[[object, object], None] = lambda model, tokenizer: None
    prefill_only: bool = False
    shape: Callable[[], RowShape] | None = None


@dataclass(frozen=True)
class TaskSpec:
    """A named task: ``check(settings)`` validates files early; ``jobs(settings)`` builds the jobs."""

    name: str
    jobs: Callable[[str, EvalSettings], list[Job]]
    check: Callable[[str, EvalSettings], None] = lambda name, settings: None


TASKS: Registry[TaskSpec] = Registry("task")
# The file each built-in task reads from --data-dir.
DATA_FILES = {"wikitext2": "wikitext2_test.raw", "fidelity": "wikitext2_test.raw", "piqa": "piqa.jsonl",
              "arc_easy": "arc_easy.jsonl", "hellaswag": "hellaswag_val.txt.bz2", "lambada": "lambada_openai.jsonl"}


def _perplexity_jobs(name: str, path_of: Callable[[EvalSettings], Path]):
    def jobs(task: str, settings: EvalSettings) -> list[Job]:
        path = path_of(settings)
        state: dict[str, object] = {}

        def prepare(model, tokenizer):
            if settings.seq_len > max_model_length(model):
                raise RetrofitError(f"--seq-len {settings.seq_len} is over the model's limit of "
                                    f"{max_model_length(model)} positions (max_position_embeddings)")
            state["windows"] = perplexity.token_windows(tokenizer, perplexity.read_text(path), settings.seq_len,
                                                        settings.limit)

        def run(model, tokenizer, batch_size: int, throughput: Throughput) -> TaskOutcome:
            nlls = perplexity.window_nlls(model, state["windows"], batch_size, desc=task, throughput=throughput)
            return perplexity.perplexity_outcome(nlls, settings.seq_len)

        def shape() -> RowShape:
            return RowShape(len(state["windows"]), settings.seq_len)

        return [Job(task, run, prepare, prefill_only=True, shape=shape)]
    return jobs


def _fidelity_jobs(name: str, path_of: Callable[[EvalSettings], Path]):
    def jobs(task: str, settings: EvalSettings) -> list[Job]:
        path = path_of(settings)
        run = fidelity.FidelityJob([], task)

        def prepare(model, tokenizer):
            needed = fidelity.PROMPT_TOKENS + fidelity.NEW_TOKENS
            if needed > max_model_length(model):
                raise RetrofitError(f"task {task}: a prompt of {fidelity.PROMPT_TOKENS} tokens and "
                                    f"{fidelity.NEW_TOKENS} new ones are over the model's limit of "
                                    f"{max_model_length(model)} positions")
            run.prompts = fidelity.cut_prompts(tokenizer, perplexity.read_text(path),
                                               settings.limit or fidelity.DEFAULT_PROMPTS)

        def shape() -> RowShape:
            return RowShape(len(run.prompts), fidelity.PROMPT_TOKENS, fidelity.NEW_TOKENS)

        return [Job(task, run, prepare, shape=shape)]
    return jobs


def _multiple_choice_jobs(loader: Callable[[Path, int | None], list], path_of: Callable[[EvalSettings], Path]):
    def jobs(task: str, settings: EvalSettings) -> list[Job]:
        items = loader(path_of(settings), settings.limit)

        def run(model, tokenizer, batch_size: int, throughput: Throughput) -> TaskOutcome:
            _, scores = multiple_choice.evaluate_multiple_choice(model, tokenizer, items, batch_size, task, throughput)
            return multiple_choice.outcome_from_scores(items, scores)

        def shape() -> RowShape:  # characters bound tokens from above: a guess on the safe side
            return RowShape(sum(len(item.choices) for item in items),
                            max(len(item.query) + 1 + len(choice) for item in items for choice in item.choices))

        return [Job(task, run, prefill_only=True, shape=shape)]
    return jobs


def _lambada_jobs(task: str, settings: EvalSettings) -> list[Job]:
    items = lambada.load_lambada(settings.data_file(task, "lambada_openai.jsonl"), settings.limit)

    def run(model, tokenizer, batch_size: int, throughput: Throughput) -> TaskOutcome:
        return lambada.lambada_outcome(items, lambada.score_lambada(model, tokenizer, items, batch_size, task,
                                                                    throughput))

    def shape() -> RowShape:  # characters bound tokens from above: a guess on the safe side
        return RowShape(len(items), max(len(item.context) + 1 + len(item.continuation) for item in items))

    return [Job(task, run, prefill_only=True, shape=shape)]


def _synthetic_jobs(task: str, settings: EvalSettings) -> list[Job]:
    haystack = synthetic.Haystack(settings.haystack)
    num_items = settings.limit or synthetic.ITEMS_PER_SEED
    jobs = []
    for length in settings.context_lengths:
        state: dict[str, list] = {}

        def prepare(model, tokenizer, length=length, state=state):
            limit = max_model_length(model)
            if length > limit:
                raise RetrofitError(f"--context-length {length} is over the model's limit of {limit} positions "
                                    "(max_position_embeddings)")
            cpu_time.refuse_hours_on_cpu(model, f"{task} at {length:,} tokens", length, num_items * len(settings.seeds))
            state["items"] = synthetic.generate_items(task, tokenizer, length, settings.seeds, num_items, haystack)

        def run(model, tokenizer, batch_size: int, throughput: Throughput, length=length, state=state):
            items = state["items"]
            outputs = greedy_generate(model, tokenizer, [list(item.prompt_ids) for item in items],
                                      items[0].max_new_tokens, batch_size, f"{task}@{length}", throughput)
            return _synthetic_outcome(task, items, outputs, settings.num_seeds > 1)

        def shape(state=state) -> RowShape:
            items = state["items"]
            return RowShape(len(items), max(len(item.prompt_ids) for item in items), items[0].max_new_tokens)

        jobs.append(Job(f"{task}@{length}", run, prepare, shape=shape))
    return jobs


def _synthetic_outcome(task: str, items: list, outputs: list[str], with_seed_spread: bool) -> TaskOutcome:
    """``score`` (0/1 per item: Wilson interval) and ``partial`` per item; ``score_sd`` across seeds when asked."""
    per_item = synthetic.item_scores(task, items, outputs)
    metrics: dict = {name: MeanMetric(values, wilson=name == "score") for name, values in per_item.items()}
    if with_seed_spread:
        metrics["score_sd"] = synthetic.seed_spread(task, items, outputs)
    samples = [{"seed": item.seed, "index": item.index, "context_length": item.context_length,
                "prompt_tokens": len(item.prompt_ids), "answers": list(item.answers), "output": output,
                **{name: values[position] for name, values in per_item.items()}}
               for position, (item, output) in enumerate(zip(items, outputs))]
    return TaskOutcome(metrics, samples)


def _builtin_file(name: str, file_name: str) -> Callable[[EvalSettings], Path]:
    return lambda settings: settings.data_file(name, file_name)


def _register_builtins() -> None:
    def check_file(name):
        return lambda task, settings: settings.data_file(task, DATA_FILES[name])

    TASKS.register("wikitext2")(TaskSpec("wikitext2", _perplexity_jobs("wikitext2", _builtin_file(
        "wikitext2", DATA_FILES["wikitext2"])), check_file("wikitext2")))
    for name in ("piqa", "arc_easy"):
        TASKS.register(name)(TaskSpec(name, _multiple_choice_jobs(multiple_choice.load_jsonl, _builtin_file(
            name, DATA_FILES[name])), check_file(name)))
    TASKS.register("hellaswag")(TaskSpec("hellaswag", _multiple_choice_jobs(multiple_choice.load_hellaswag,
                                         _builtin_file("hellaswag", DATA_FILES["hellaswag"])), check_file("hellaswag")))
    TASKS.register("lambada")(TaskSpec("lambada", _lambada_jobs, check_file("lambada")))
    TASKS.register("fidelity")(TaskSpec("fidelity", _fidelity_jobs("fidelity", _builtin_file(
        "fidelity", DATA_FILES["fidelity"])), check_file("fidelity")))
    for name in synthetic.SYNTHETIC_TASKS.names():
        TASKS.register(name)(TaskSpec(name, _synthetic_jobs))


_register_builtins()
# Task names that carry their text file (``ppl:PATH``, ``fidelity:PATH``): prefix -> its jobs.
FILE_TASKS = {"ppl:": _perplexity_jobs, "fidelity:": _fidelity_jobs}


def _named_file(task: str, path: Path) -> Callable[[EvalSettings], Path]:
    """The path of a file named on the command line (``ppl:PATH``, ``--task-file NAME=PATH``), checked to exist."""
    def path_of(settings: EvalSettings) -> Path:
        if not path.is_file():
            raise RetrofitError(f"task {task}: data file not found: {path}")
        return path

    return path_of


def resolve_task(name: str, settings: EvalSettings) -> TaskSpec:
    """The TaskSpec for ``name``: ``ppl:PATH``, ``fidelity:PATH``, a ``--task-file`` name, or a registered task
    (did-you-mean)."""
    for prefix, jobs_of in FILE_TASKS.items():
        if name.startswith(prefix):
            path_of = _named_file(name, Path(name[len(prefix):]))
            return TaskSpec(name, jobs_of(name, path_of), lambda task, settings: path_of(settings) and None)
    if name in settings.task_files:
        task_file = _named_file(name, settings.task_files[name])
        return TaskSpec(name, _multiple_choice_jobs(multiple_choice.load_jsonl, task_file),
                        lambda task, settings: task_file(settings) and None)
    if name not in TASKS:
        choices = TASKS.names() + sorted(settings.task_files)
        close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RetrofitError(f"unknown task {name!r}{hint}; choose from: {', '.join(choices)}, ppl:PATH, "
                            "fidelity:PATH, or a name bound with --task-file NAME=PATH")
    return TASKS.get(name)


def task_data_files(name: str, settings: EvalSettings) -> list[Path]:
    """The files task ``name`` reads (none for the synthetic tasks without ``--haystack``), checked to exist:
    what a conversion must not have calibrated on."""
    resolve_task(name, settings).check(name, settings)
    prefix = next((prefix for prefix in FILE_TASKS if name.startswith(prefix)), None)
    if prefix is not None:
        return [Path(name[len(prefix):])]
    if name in settings.task_files:
        return [settings.task_files[name]]
    if name in DATA_FILES:
        return [settings.data_file(name, DATA_FILES[name])]
    return [settings.haystack] if settings.haystack is not None else []


def build_jobs(task_names: list[str], settings: EvalSettings) -> list[Job]:
    """Validate every name and data file first (before any model is loaded), then build the jobs in order."""
    if not task_names:
        raise RetrofitError("--tasks is empty; choose from: " + ", ".join(TASKS.names()) + ", ppl:PATH")
    repeated = sorted({name for name in task_names if task_names.count(name) > 1})
    if repeated:
        raise RetrofitError(f"--tasks names {', '.join(repeated)} more than once: each task runs once, name it once")
    specs = [resolve_task(name, settings) for name in task_names]
    for name, spec in zip(task_names, specs):
        spec.check(name, settings)
    return [job for name, spec in zip(task_names, specs) for job in spec.jobs(name, settings)]
