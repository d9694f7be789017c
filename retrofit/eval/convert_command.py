"""``retrofit convert``: the conversion (``retrofit.convert.command.convert_command``, its options unchanged) and then
the conversion report (:mod:`retrofit.eval.conversion_report`).

The two are composed here, in the evaluation layer, because the conversion stage imports nothing of evaluation.
``python -m retrofit.convert.command convert ...`` still runs the conversion alone; ``python -m retrofit convert``
and ``torchrun -m retrofit convert`` run this command (under torchrun, rank 0 alone runs the report).
"""
from __future__ import annotations

from pathlib import Path

import click

from retrofit.cliargs import refuse_without
from retrofit.convert.command import convert_command as conversion_command
from retrofit.eval.conversion_report import DEFAULT_SEEDS, DEFAULT_TASKS, REPORT_DTYPE

REPORT_HELP = """After the conversion, the conversion report: dense beside the saved hybrid (reloaded from --out) on
data the conversion never saw, printed as retrofit eval's table and written to OUT/report.json in retrofit eval's JSON
layout, with the conversion's seconds, tokens and peak memory in its config. Rows: perplexity of the held-out text
(wikitext2_test.raw, or --report-text), multiple choice (--report-tasks), passkey and niah_single at each
--report-context over --report-seeds seeds, and generation fidelity (how many of 128 greedy tokens after held-out
prompts agree with dense's). Every report file is checked before the conversion starts: one whose content is in the
calibration data (--data) is refused. --report-data-dir is needed unless --no-report. `retrofit eval MODEL --hybrid
DIR --report` makes the same report for an existing hybrid."""

CONVERT_EXAMPLES = """
\b
Examples:
  retrofit convert smollm2-135m --recipe smollm2-135m/kda-8of30-50m-b16 --data ../shared/data/calib --out hyb/ \\
      --device cuda --report-data-dir ../shared/data/eval
  retrofit convert smollm2-135m --recipe smollm2-135m/cpu-small --data ../shared/data/calib --out hyb/ \\
      --report-data-dir ../shared/data/eval --report-context 2k --report-seeds 2 --report-limit 4
  retrofit convert smollm2-135m --to gdn --layers every:4 --data calib/ --tokens 2000000 --out hyb/ --no-report
  torchrun --nproc-per-node 2 -m retrofit convert MODEL --recipe R.yaml --data D --out O --report-data-dir E
"""

REPORT_OPTIONS = [
    click.Option(["--report/--no-report"], default=True, show_default=True,
                 help="End with the conversion report (needs --report-data-dir)."),
    click.Option(["--report-data-dir"], type=click.Path(path_type=Path), default=None,
                 help="Folder with the evaluation files (wikitext2_test.raw, piqa.jsonl, arc_easy.jsonl, ...)."),
    click.Option(["--report-text"], type=click.Path(path_type=Path), default=None,
                 help="Held-out text of the perplexity and fidelity rows [default: wikitext2_test.raw in "
                      "--report-data-dir]."),
    click.Option(["--report-tasks"], default=",".join(DEFAULT_TASKS), show_default=True,
                 help="Tasks besides perplexity, passkey, niah_single and fidelity: retrofit eval task names, or "
                      "none."),
    click.Option(["--report-context"], default="2k,4k,8k", show_default=True,
                 help="Context lengths of passkey and niah_single (1k = 1024)."),
    click.Option(["--report-seeds"], type=int, default=DEFAULT_SEEDS, show_default=True,
                 help="Seeds 0..N-1 of the long-context items."),
    click.Option(["--report-limit"], type=int, default=None,
                 help="First N items, windows or prompts of each task (long-context: N per seed) [default: every "
                      "item; long-context 20 per seed; fidelity 16 prompts]."),
    click.Option(["--report-seq-len"], type=int, default=1024, show_default=True,
                 help="Perplexity window in tokens."),
    click.Option(["--report-batch-size"], type=int, default=8, show_default=True,
                 help="Rows per forward / generate call of the report."),
    click.Option(["--report-dtype"], default=REPORT_DTYPE, show_default=True,
                 help="dtype of both models in the report."),
]


def _convert_then_report(**values) -> None:
    """Check the report's options and files, convert (exactly as the conversion command alone), then report."""
    import gc

    import torch

    from retrofit.convert.parts import PartsSoFar, parts_so_far
    from retrofit.convert.data import calibration_files
    from retrofit.convert.recipe import load_recipe
    from retrofit.devices import parse_device
    from retrofit.devices import is_first_process
    from retrofit.eval.conversion_report import (conversion_facts, cost_line, measure_conversion, prepare_report,
                                                 report_settings, run_report)
    from retrofit.eval.table import markdown_table
    from retrofit.memory import OutOfMemory, reported

    report_values = {option.name: values.pop(option.name) for option in REPORT_OPTIONS}
    if values["dry_run"]:  # the memory plan alone: nothing is converted, so nothing is reported
        conversion_command.callback(**values)
        return
    if not report_values.pop("report"):
        refuse_without(click.get_current_context(), {name: (False, "the report (drop --no-report)")
                                                     for name in report_values})
        conversion_command.callback(**values)
        return
    settings = report_settings(report_values["report_data_dir"], report_values["report_text"],
                               report_values["report_tasks"], report_values["report_context"],
                               report_values["report_seeds"], report_values["report_limit"],
                               report_values["report_seq_len"], report_values["report_batch_size"],
                               report_values["report_dtype"])
    recipe = load_recipe(values["recipe"])
    data = list(values["data"]) or recipe.get("data") or []
    calibration = calibration_files([data] if isinstance(data, str) else data)
    jobs = prepare_report(settings, values["model"], calibration)
    device = parse_device(values["device"] or recipe.get("device"))
    out = Path(values["out"])
    earlier = parts_so_far(values["out"]) if values["resume"] else PartsSoFar()
    with measure_conversion(device) as cost:
        conversion_command.callback(**values)
    if not is_first_process():
        return
    conversion = conversion_facts(out, cost, earlier, values["model"], values["recipe"], calibration)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        with reported("making the conversion report", device=device):
            report = run_report(values["model"], out, settings, jobs, device, conversion)
    except OutOfMemory as failure:
        failure.advice = (f"a smaller --report-batch-size or fewer --report-context lengths; the hybrid is saved in "
                          f"{out}, and `retrofit eval {values['model']} --hybrid {out} --report --data-dir DIR` makes "
                          "the report alone")
        raise
    click.echo("")
    click.echo(markdown_table(report))
    click.echo(cost_line(conversion))
    click.echo(f"report: {out / 'report.json'}")


convert_command = click.Command(
    "convert", params=[*conversion_command.params, *REPORT_OPTIONS], callback=_convert_then_report,
    help=f"{conversion_command.help}\n\n{REPORT_HELP}", epilog=CONVERT_EXAMPLES)
