"""`retrofit lm-eval` (lm-evaluation-harness's own command line, with the ``retrofit`` model registered and
retrofit's task YAMLs included) and `retrofit lm-eval-task` (a synthetic long-context task written for it).

Importing this module imports neither lm-eval nor torch: ``cli.py`` loads every command at start-up."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import click

from retrofit.cliargs import parse_lengths
from retrofit.errors import RetrofitError

LM_EVAL_HELP = """Run lm-evaluation-harness's command line (lm-eval run, ls, validate) with the model
"retrofit" registered and retrofit's task YAMLs on the include path; every option is lm-eval's own.

\b
--model retrofit --model_args pretrained=MODEL[,sparse=METHOD,budget=N,KEY=VALUE...]
    MODEL: an alias (smollm2-135m), a model or hybrid checkpoint directory, a .gguf file or a hub id.
    Sparse decoding applies to generate_until requests; log-likelihood requests stay dense (prefill).
Tasks shipped with retrofit (need --metadata data_dir=DIR, the folder of piqa.jsonl, ...):
    retrofit_piqa, retrofit_arc_easy, retrofit_hellaswag, retrofit_lambada
\b
Examples:
  HF_DATASETS_OFFLINE=1 retrofit lm-eval --model retrofit --model_args pretrained=smollm2-135m \\
      --tasks retrofit_piqa --metadata data_dir=../shared/data/eval --limit 200 --device cpu
  retrofit lm-eval-task passkey smollm2-135m --context-length 2k --out tasks/
  retrofit lm-eval --model retrofit --model_args pretrained=smollm2-135m,sparse=streaming,budget=256 \\
      --include_path tasks/ --tasks retrofit_passkey_2048 --log_samples --output_path out/
"""


def lm_eval_available() -> None:
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as error:
        raise RetrofitError(f"retrofit lm-eval needs lm-evaluation-harness with its HF model ({error}): "
                            "pip install \"retrofit[harness]\"") from None


def parse_lm_eval_args(argv: list[str]):
    """lm-eval's own parser on ``argv`` (``run`` inserted when no sub-command is named, as ``lm-eval`` does)."""
    from lm_eval._cli import HarnessCLI

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli = HarnessCLI()
        return cli, cli.parse_args()
    finally:
        sys.argv = saved


def include_shipped_tasks(args) -> None:
    """Put retrofit's task folder on the include path, before the user's (a later path overrides an earlier)."""
    from retrofit.harness import TASKS_DIR

    if not hasattr(args, "include_path"):
        return
    user = args.include_path
    args.include_path = [str(TASKS_DIR)] + ([user] if user else [])


def check_before_loading(args) -> None:
    """Fail in one line, before any model is loaded, on bad retrofit model_args or a missing data folder."""
    from retrofit.harness.datasets import FILES, data_file

    model_args = dict(getattr(args, "model_args", None) or {})
    if getattr(args, "model", None) == "retrofit":
        from retrofit.harness.model import _HFLM_OPTIONS, sparse_decoding_variant

        if "pretrained" not in model_args:
            raise RetrofitError("--model retrofit needs --model_args pretrained=MODEL (an alias, a directory, a .gguf)")
        from retrofit.load import check_source

        check_source(model_args["pretrained"])
        retrofit_keys = {"pretrained", "sparse", "budget", "dtype", "device"}
        sparse_decoding_variant(model_args.get("sparse"), model_args.get("budget"),
                                {k: v for k, v in model_args.items() if k not in retrofit_keys | _HFLM_OPTIONS})
    metadata = model_args | dict(getattr(args, "metadata", None) or {})  # lm-eval merges them the same way
    for task in getattr(args, "tasks", None) or []:
        for name in str(task).split(","):
            if name in FILES:
                data_file(name, metadata.get("data_dir"))


@contextmanager
def included_tasks_only_when_they_hold_every_task(args):
    """Within the block, lm-eval indexes only the include paths when every task named in ``args.tasks`` is found
    there (retrofit's shipped tasks, the user's --include_path): its own ~14,000 task files take about 15 s of a CPU
    core to index before any name is looked up. Any other request (a built-in task, a group, no --tasks) runs as
    lm-eval runs it."""
    from lm_eval import tasks as lm_eval_tasks
    from lm_eval.tasks._index import TaskIndex

    requested = [name for task in getattr(args, "tasks", None) or [] for name in str(task).split(",") if name]
    include_paths = [Path(path) for path in getattr(args, "include_path", None) or []]
    found = TaskIndex().build(include_paths) if requested and include_paths else {}
    if not requested or not all(name in found for name in requested):
        yield
        return
    every_task_manager = lm_eval_tasks.TaskManager

    class IncludedTasksOnly(every_task_manager):
        def __init__(self, *args, include_defaults: bool = False, **kwargs):
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    lm_eval_tasks.TaskManager = IncludedTasksOnly  # lm-eval's run command imports the name when it builds one
    try:
        yield
    finally:
        lm_eval_tasks.TaskManager = every_task_manager


def run_lm_eval(argv: list[str]) -> None:
    """``lm-eval ARGV`` in this process, with the ``retrofit`` model and the shipped tasks available."""
    lm_eval_available()
    import retrofit.harness
    from lm_eval.utils import setup_logging

    if not retrofit.harness.register():
        raise RetrofitError("lm-evaluation-harness is installed without the model registry retrofit needs "
                            "(lm_eval.api.registry, 0.4.x): pip install \"retrofit[harness]\"")
    cli, args = parse_lm_eval_args(argv)
    include_shipped_tasks(args)
    check_before_loading(args)
    setup_logging()
    try:
        with included_tasks_only_when_they_hold_every_task(args), git_hash_read_quietly():
            cli.execute(args)
    except (ValueError, KeyError, FileNotFoundError) as error:  # lm-eval's own refusals: unknown tasks, bad options
        message = " ".join(str(error).split()) or type(error).__name__
        raise RetrofitError(f"lm-eval: {message}") from None


@contextmanager
def git_hash_read_quietly():
    """lm-eval records the git commit of the working directory by running ``git describe``, whose complaint outside
    a repository ("fatal: not a git repository") reaches the user's terminal: while inside, the same read with git's
    stderr discarded (the result, a hash or None, is lm-eval's)."""
    import os
    import subprocess

    import lm_eval.evaluator as evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:  # an lm-eval that records no git hash this way
        yield
        return

    def quiet_git_commit_hash():
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    evaluator.get_git_commit_hash = quiet_git_commit_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


@click.command("lm-eval", help=LM_EVAL_HELP, add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def lm_eval_command(ctx: click.Context, args: tuple[str, ...]) -> None:
    if args in ((), ("-h",), ("--help",)):
        click.echo(ctx.get_help())
        click.echo("\nlm-eval's own options: retrofit lm-eval run --help")
        return
    run_lm_eval(list(args))


@click.command("lm-eval-task",
               help="Write the long-context synthetic TASK (passkey, niah_single, niah_multikey, niah_multivalue, vt, "
                    "cwe, fwe) as lm-eval tasks, one per --context-length: OUT/retrofit_TASK_LENGTH.jsonl (the "
                    "prompts of `retrofit eval`, rendered with MODEL's tokenizer and chat template) and its YAML. "
                    "Run them with `retrofit lm-eval --include_path OUT --tasks retrofit_TASK_LENGTH`.\n\n"
                    "\b\nExample:\n  retrofit lm-eval-task passkey smollm2-135m --context-length 2k --num-seeds 4 "
                    "--out tasks/")
@click.argument("task")
@click.argument("model")
@click.option("--context-length", "context_length", default="4096", show_default=True,
              help="Comma-separated prompt lengths in tokens (1k = 1024).")
@click.option("--seed", type=int, default=0, show_default=True, help="First seed.")
@click.option("--num-seeds", type=click.IntRange(min=1), default=1, show_default=True, help="Seeds seed..seed+N-1.")
@click.option("--limit", "items_per_seed", type=click.IntRange(min=1), default=20, show_default=True,
              help="Items per seed: the first N of `retrofit eval`'s (20 sweep the needle over 0-100% of the "
                   "haystack; fewer spread over it).")
@click.option("--haystack", type=click.Path(path_type=Path), default=None,
              help="Text file whose sentences replace the noise haystack.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder for the task files.")
def lm_eval_task_command(task: str, model: str, context_length: str, seed: int, num_seeds: int,
                         items_per_seed: int, haystack: Path | None, out_dir: Path) -> None:
    from retrofit.eval.synthetic import SYNTHETIC_TASKS, Haystack
    from retrofit.harness.synthetic import write_synthetic_task
    from retrofit.load import load
    from retrofit.model_info import max_model_length

    SYNTHETIC_TASKS.get(task)  # an unknown task fails before the model loads
    lengths = parse_lengths(context_length, "--context-length")
    filler = Haystack(haystack) if haystack is not None else None
    loaded, tokenizer = load(model, dtype="float32", device="cpu")  # the tokenizer and the position limit only
    limit = max_model_length(loaded)
    for length in lengths:
        if length > limit:
            raise RetrofitError(f"--context-length {length} is over the model's limit of {limit} positions")
    seeds = [seed + offset for offset in range(num_seeds)]
    for length in lengths:
        written = write_synthetic_task(task, tokenizer, length, seeds, items_per_seed, out_dir, filler)
        click.echo(f"{written.name}: {written.items} items -> {written.yaml_path}")
