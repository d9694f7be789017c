"""`retrofit eval`: accuracy of dense and of each variant on the same items, as one Markdown table."""
from __future__ import annotations

import time
from pathlib import Path

import click

from retrofit.cliargs import parse_lengths, parse_pairs, refuse_without
from retrofit.errors import RetrofitError
from retrofit.prefill_defaults import MIN_LENGTH_HELP

EVAL_HELP = """Evaluate MODEL (dense) and each requested variant on the same items; print one Markdown table
(tasks x metrics as rows with their item counts, variants as columns, tokens/s per variant). Each value carries its
standard error (or 95% interval), each variant its paired delta to dense with a 95% interval (* when it excludes 0).
Every item of each file is used unless --limit is given. Sparse decoding changes decode steps only: on tasks scored
by forward passes alone (perplexity, multiple choice, LAMBADA) a sparse variant equals dense by construction: it takes
dense's numbers without running them again, and its cells read "= dense (by construction)".

\b
MODEL: a local model directory, a .gguf file, a hub id, or an alias (smollm2-135m, qwen2.5-0.5b, gemma3-270m).
\b
TASKS (comma-separated; each once: a name given twice is refused):
  wikitext2                 perplexity of wikitext2_test.raw in --data-dir (windows of --seq-len)
  ppl:PATH                  perplexity of any text file
  piqa, arc_easy, hellaswag multiple choice (acc, acc_norm) from --data-dir
  lambada                   last-word accuracy (acc, ppl) from --data-dir
  NAME                      a multiple-choice jsonl bound with --task-file NAME=PATH
  niah_single, niah_multikey, niah_multivalue, vt, cwe, fwe, passkey
                            long-context synthetic tasks at each --context-length
  fidelity, fidelity:PATH   how many of 128 greedy tokens after 16 prompts cut from
                            wikitext2_test.raw (or PATH) agree with dense's
\b
--report instead of --tasks: the conversion report's rows (as `retrofit convert` prints them):
  wikitext2, piqa, arc_easy, passkey and niah_single at 2k,4k,8k with 4 seeds (--context-length,
  --num-seeds to change), fidelity; float32 unless --dtype
\b
VARIANTS (dense always runs first):
  --sparse quest --budget 256 --budget 1024     two variants: quest@256, quest@1024
  --sparse-arg page_size=16                     extra keyword for sparse_decoding
  --variant "quest:budget=256,page_size=16"     the same as a spec string (repeatable)
  --hybrid out/smollm2-gdn                      a hybrid checkpoint (repeatable)
  --prefill xattention --prefill-arg threshold=0.9
                                                block-sparse prefill (repeatable; one variant each)
  --variant "prefill:xattention:threshold=0.9+quest:budget=1024"
                                                sparse prefill and sparse decoding in one session
\b
Examples:
  retrofit eval smollm2-135m --tasks wikitext2,piqa --data-dir data/eval --limit 200
  retrofit eval smollm2-135m --tasks piqa,arc_easy,hellaswag --data-dir data/eval --hybrid out/smollm2-gdn \\
      --json out.json --log-samples samples.jsonl
  retrofit eval smollm2-135m --tasks niah_single,passkey --context-length 2k,4k \\
      --sparse streaming --budget 512 --json out.json --plot out.png
  retrofit eval smollm2-135m --hybrid out/smollm2-gdn --report --data-dir data/eval --json report.json
"""


def refuse_unused_options(context, task_names: list[str], settings) -> None:
    """Options that do nothing for these tasks are refused in one line, not silently ignored."""
    from retrofit.eval.synthetic import SYNTHETIC_TASKS

    synthetic = any(name in SYNTHETIC_TASKS for name in task_names)
    perplexity = any(name == "wikitext2" or name.startswith("ppl:") for name in task_names)
    needs_synthetic = (synthetic, "a synthetic task in --tasks (" + ", ".join(SYNTHETIC_TASKS.names()) + ")")
    refuse_without(context, {"context_length": needs_synthetic, "seed": needs_synthetic,
                             "num_seeds": needs_synthetic, "haystack": needs_synthetic,
                             "seq_len": (perplexity, "a perplexity task in --tasks (wikitext2 or ppl:PATH)")})
    unused = sorted(set(settings.task_files) - set(task_names))
    if unused:
        raise RetrofitError(f"--task-file {unused[0]}=... binds a task that --tasks does not name")
    for option, value in (("--limit", settings.limit), ("--num-seeds", settings.num_seeds)):
        if value is not None and value <= 0:
            raise RetrofitError(f"{option} must be positive, got {value}")


def report_options(context, data_dir: Path | None, seq_len: int, context_length: str,
                   num_seeds: int) -> tuple[str, str, int]:
    """``--report``: (tasks, context lengths, seeds) of the conversion report; --context-length and --num-seeds
    keep the values the user gave. --tasks beside it is refused."""
    from retrofit.cliargs import given
    from retrofit.eval.conversion_report import DEFAULT_CONTEXT_LENGTHS, DEFAULT_SEEDS, EVAL_OPTIONS, ReportSettings

    if given(context, "tasks"):
        raise RetrofitError("--report chooses the tasks: drop --tasks, or drop --report and name every task")
    settings = ReportSettings(data_dir=data_dir, seq_len=seq_len, option=EVAL_OPTIONS)
    lengths = context_length if given(context, "context_length") else ",".join(map(str, DEFAULT_CONTEXT_LENGTHS))
    return ",".join(settings.task_names()), lengths, num_seeds if given(context, "num_seeds") else DEFAULT_SEEDS


def parse_task_files(pairs: tuple[str, ...]) -> dict[str, Path]:
    files = parse_pairs(pairs, "--task-file")
    for name, path in files.items():
        if not path:
            raise RetrofitError(f"--task-file expects NAME=PATH, got {name}=")
    return {name: Path(path) for name, path in files.items()}


@click.command("eval", help=EVAL_HELP)
@click.argument("model")
@click.option("--tasks", "tasks", default=None, help="Comma-separated task names (see above).")
@click.option("--report", "report", is_flag=True,
              help="The conversion report's tasks, context lengths and seeds instead of --tasks (see above).")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None, help="Folder with the evaluation files.")
@click.option("--task-file", "task_files", multiple=True, metavar="NAME=PATH",
              help="Bind NAME to a multiple-choice jsonl file ({query, choices, gold} per line).")
@click.option("--limit", type=int, default=None,
              help="First N items / windows of each task [default: all of them; synthetic tasks: 20 items per seed].")
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Perplexity window in tokens.")
@click.option("--context-length", "context_length", default="4096", show_default=True,
              help="Comma-separated prompt lengths of the synthetic tasks (1k = 1024).")
@click.option("--seed", type=int, default=0, show_default=True, help="First seed of the synthetic tasks.")
@click.option("--num-seeds", type=int, default=1, show_default=True,
              help="Seeds seed..seed+N-1: items pooled into score; score_sd = sample SD of the per-seed scores.")
@click.option("--haystack", type=click.Path(path_type=Path), default=None,
              help="Text file whose sentences replace the noise haystack of the synthetic tasks.")
@click.option("--batch-size", "batch_size", default="auto", show_default=True,
              help="Rows per forward / generate call, or auto: per variant, task and context length the largest "
                   "batch that fits (halved and the task run again if the device runs out of memory; the table's "
                   "last row says what it chose). With --report: the conversion report's 8 unless given.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--dtype", default=None,
              help="float32, bfloat16 or float16 [default: float32 on CPU, bfloat16 on CUDA; float32 with --report]")
@click.option("--sparse", "sparse_methods", multiple=True, metavar="METHOD",
              help="Sparse-decoding method (repeatable); one variant per --budget.")
@click.option("--budget", "budgets", multiple=True, type=int, metavar="N", help="Token budget (repeatable).")
@click.option("--sparse-arg", "sparse_args", multiple=True, metavar="KEY=VALUE",
              help="Extra keyword for the sparse method (repeatable).")
@click.option("--prefill", "prefill_methods", multiple=True, metavar="METHOD",
              help="Sparse prefill method: xattention or vertical_slash (repeatable; one variant each).")
@click.option("--prefill-arg", "prefill_args", multiple=True, metavar="KEY=VALUE",
              help=f"A sparse prefill parameter, e.g. threshold=0.9 or min_length=1024 (repeatable; "
                   f"{MIN_LENGTH_HELP}).")
@click.option("--hybrid", "hybrid_dirs", multiple=True, metavar="DIR", help="Hybrid checkpoint dir (repeatable).")
@click.option("--variant", "variant_specs", multiple=True, metavar="SPEC",
              help='Variant spec: "METHOD:budget=N[,k=v...]", "prefill:METHOD[:k=v,...]", "hybrid:DIR", '
                   '"convert:gdn|kda:LAYERS" (repeatable).')
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the results here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write a PNG chart here.")
@click.option("--log-samples", "samples_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write one JSON line per variant, task and item here (inputs, per-item scores, outputs).")
def eval_command(model: str, tasks: str | None, report: bool, data_dir: Path | None, task_files: tuple[str, ...],
                 limit: int | None, seq_len: int, context_length: str, seed: int, num_seeds: int, haystack: Path | None,
                 batch_size: str, device: str, dtype: str | None, sparse_methods: tuple[str, ...],
                 budgets: tuple[int, ...], sparse_args: tuple[str, ...], prefill_methods: tuple[str, ...],
                 prefill_args: tuple[str, ...], hybrid_dirs: tuple[str, ...], variant_specs: tuple[str, ...],
                 json_path: Path | None, plot_path: Path | None, samples_path: Path | None) -> None:
    from retrofit.atomic import write_json
    from retrofit.devices import default_dtype
    from retrofit.cliargs import given
    from retrofit.eval.batching import parse_batch_size
    from retrofit.eval.conversion_report import REPORT_DTYPE, ReportSettings
    from retrofit.eval.runner import run_eval, write_samples
    from retrofit.eval.table import markdown_table
    from retrofit.eval.tasks import EvalSettings, build_jobs
    from retrofit.load import load
    from retrofit.run_info import library_versions
    from retrofit.variants import variants_from_options

    if report:
        tasks, context_length, num_seeds = report_options(click.get_current_context(), data_dir, seq_len,
                                                          context_length, num_seeds)
        if not given(click.get_current_context(), "batch_size"):  # the conversion report's: its numbers again
            batch_size = str(ReportSettings.batch_size)
    elif tasks is None:
        raise RetrofitError("name the tasks with --tasks (see retrofit eval --help), or --report for the conversion "
                            "report's")
    batch_size = parse_batch_size(batch_size)
    if haystack is not None and not haystack.is_file():
        raise RetrofitError(f"haystack file not found: {haystack}")
    settings = EvalSettings(data_dir=data_dir, limit=limit, seq_len=seq_len,
                            context_lengths=parse_lengths(context_length, "--context-length"), seed=seed,
                            num_seeds=num_seeds, haystack=haystack, task_files=parse_task_files(task_files))
    task_names = [name.strip() for name in tasks.split(",") if name.strip()]
    refuse_unused_options(click.get_current_context(), task_names, settings)
    jobs = build_jobs(task_names, settings)
    variants = variants_from_options(list(sparse_methods), list(budgets), list(sparse_args), list(hybrid_dirs),
                                     list(variant_specs), list(prefill_methods), list(prefill_args))
    dtype = dtype or (REPORT_DTYPE if report else default_dtype(device))
    began = time.perf_counter()
    loaded, tokenizer = load(model, dtype=dtype, device=device)
    for variant in variants:
        variant.describe(loaded)  # a bad variant (e.g. a layer out of range) fails before dense runs
    config = {"model": model, "tasks": task_names, "report": report, "data_dir": str(data_dir) if data_dir else None,
              "task_files": {name: str(path) for name, path in settings.task_files.items()}, "limit": limit,
              "seq_len": seq_len, "context_lengths": list(settings.context_lengths), "seeds": settings.seeds,
              "haystack": str(haystack) if haystack else None, "batch_size": batch_size,
              "device": str(next(loaded.parameters()).device), "dtype": dtype,
              "variants": ["dense"] + [variant.name for variant in variants], "versions": library_versions(),
              "model_kind": "hybrid" if getattr(loaded.config, "retrofit", None) else "dense",
              "log_samples": str(samples_path) if samples_path else None}
    report = run_eval(loaded, tokenizer, jobs, variants, batch_size, config)
    report.config["wall_seconds"] = time.perf_counter() - began
    if json_path is not None:
        write_json(json_path, report.to_json())
    if samples_path is not None:
        write_samples(report, samples_path)
    if plot_path is not None:
        from retrofit.eval.plot import save_plot

        save_plot(report, plot_path)
    click.echo(markdown_table(report))
