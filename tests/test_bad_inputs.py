"""Every bad input a user can type gets one line on stderr and exit code 2, never a traceback: one table of them,
run through the real `retrofit` command (click's runner, in process). The table is the place to add the next one.

A row is (arguments, a fragment the one line must contain). ``{name}`` in an argument is a bad file or directory
made once for the module (see ``bad_files``); rows run in table order and none needs a GPU or the network.
"""
from __future__ import annotations

import json
import random
import shutil
import textwrap
from pathlib import Path

import pytest

from _cli_runner import run

from retrofit.errors import RetrofitError

FIXTURE = Path(__file__).parent / "fixtures" / "hybrid_v1_gdn"
EVAL = ["--data-dir", "{eval}"]
CONVERT = ["smollm2-135m", "--recipe", "smollm2-135m/cpu-small", "--out", "{missing}"]
REPORT = ["--report-data-dir", "{eval}"]
REPORTED = [*CONVERT, "--data", "{calib}", *REPORT]  # a sound conversion with its report, before the bad option
SELECT = ["select", "smollm2-135m", "--fraction", "0.25", "--data", "{text_file}"]

ROWS = [
    # --- inspect: paths that are not models, damaged checkpoints, devices and dtypes
    (["inspect", "{missing}"], "no such file or directory"),
    (["inspect", "{empty_dir}"], "is not a model directory (no config.json in it)"),
    (["inspect", "{text_file}"], "is not a model"),
    (["inspect", "{bad_json}"], "config.json: not valid JSON"),
    (["inspect", "{json_list}"], "config.json: expected a JSON object"),
    (["inspect", "{truncated}"], "model.safetensors: truncated"),
    (["inspect", "{random_weights}"], "model.safetensors: not a safetensors file"),
    (["inspect", "{random_gguf}"], "not a GGUF file"),
    (["inspect", "{missing}.gguf"], "no such GGUF file"),
    (["inspect", "{no_tokenizer}"], "cannot load the hybrid checkpoint"),
    (["inspect", "nobody-here/no-such-model"], "could not fetch 'nobody-here/no-such-model'"),
    (["inspect", "smollm2-135m", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["inspect", "smollm2-135m", "--device", "tpu"], "unknown device 'tpu'"),
    (["inspect", "smollm2-135m", "--device", "cuda"], "CUDA is not available"),
    (["inspect"], "Missing argument 'MODEL'"),
    (["nosuchverb"], "No such command 'nosuchverb'"),
    # --- generate: empty prompts, impossible lengths, options that contradict or do nothing
    (["generate", "smollm2-135m", "--prompt", ""], "--prompt is empty"),
    (["generate", "smollm2-135m", "--prompt", "   "], "--prompt is empty"),
    (["generate", "smollm2-135m"], "give the text to continue as --prompt TEXT or --prompt-file PATH"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be a positive"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens must be a positive"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "many"], "Invalid value for '--max-new-tokens'"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "9000"], "8192"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--temperature", "-1"], "--temperature must be 0"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--top-p", "0.9"], "--top-p only apply to sampling"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--seed", "3"], "--seed only apply to sampling"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--temperature", "1", "--top-p", "1.5"], "top_p"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--budget", "64"], "--budget needs --sparse METHOD"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse-arg", "page_size=4"], "--sparse-arg needs --sparse"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "qest"], "did you mean 'quest'"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "quest", "--budget", "0"], "budget=0 is invalid"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "quest", "--budget", "1000", "--sparse-arg",
      "page_size=48"], "page_size=48 is invalid: expected a divisor of budget=1000"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "quest", "--sparse-arg", "page_size"],
     "'page_size' is not of the form key=value"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "quest", "--sparse-arg", "colour=red"],
     "unknown parameter 'colour' for sparse method 'quest'"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "seer"], "gate_path=None is invalid"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "seer", "--sparse-arg", "gate_path={missing}"],
     "does not exist"),
    (["generate", "{truncated}", "--prompt", "hi"], "model.safetensors: truncated"),
    # --- eval: task names, data files, variants and options no task uses
    (["eval", "smollm2-135m", "--tasks", "piqa,piqa", *EVAL], "--tasks names piqa more than once"),
    (["eval", "smollm2-135m", "--tasks", "pika", *EVAL], "did you mean 'piqa'"),
    (["eval", "smollm2-135m", "--tasks", ",", *EVAL], "--tasks is empty"),
    (["eval", "smollm2-135m", "--tasks", "piqa"], "pass --data-dir DIR"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--data-dir", "{empty_dir}"], "data file not found"),
    (["eval", "smollm2-135m", "--tasks", "ppl:{missing}"], "data file not found"),
    (["eval", "smollm2-135m", "--tasks", "ppl:{random_text}"], "not UTF-8 text"),
    (["eval", "smollm2-135m", "--tasks", "ppl:{blank_text}"], "is empty"),
    (["eval", "smollm2-135m", "--tasks", "ppl:{control_text}"], "not text"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--context-length", "2k", *EVAL], "--context-length needs a synthetic"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--num-seeds", "3", *EVAL], "--num-seeds needs a synthetic"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--seq-len", "512", *EVAL], "--seq-len needs a perplexity task"),
    (["eval", "smollm2-135m", "--tasks", "niah_single", "--context-length", "2x"], "--context-length: expected"),
    (["eval", "smollm2-135m", "--tasks", "niah_single", "--num-seeds", "0"], "--num-seeds must be positive"),
    (["eval", "smollm2-135m", "--tasks", "niah_single", "--haystack", "{missing}"], "haystack file"),
    (["eval", "smollm2-135m", "--tasks", "niah_single", "--haystack", "{random_text}"], "not UTF-8 text"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--limit", "0", *EVAL], "--limit must be a positive"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--batch-size", "0", *EVAL], "--batch-size must be positive"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--batch-size", "max", *EVAL], "a positive number of rows or auto"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--task-file", "foo={missing}", *EVAL], "--task-file foo"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--budget", "256", *EVAL], "--budget needs --sparse METHOD"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--sparse", "quest", *EVAL], "--sparse needs at least one --budget"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--hybrid", "{missing}", *EVAL], "no such directory"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--hybrid", "{dense_dir}", *EVAL], "not a hybrid checkpoint"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--hybrid", "{empty_dir}", *EVAL], "is not a model directory"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--hybrid", "{text_file}", *EVAL], "is a file, not a hybrid checkpoint directory"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--hybrid", "{truncated}", *EVAL], "model.safetensors: truncated"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--variant", "quest:page_size=4", *EVAL], "need an integer budget"),
    (["eval", "{truncated}", "--tasks", "piqa", *EVAL], "model.safetensors: truncated"),
    (["eval", "smollm2-135m", "--tasks", "niah_single", "--context-length", "20000"], "over the model's limit"),
    (["eval", "smollm2-135m", *EVAL], "name the tasks with --tasks"),
    (["eval", "smollm2-135m", "--report"], "the conversion report needs the evaluation data: pass --data-dir DIR"),
    (["eval", "smollm2-135m", "--report", "--tasks", "piqa", *EVAL], "--report chooses the tasks: drop --tasks"),
    (["eval", "smollm2-135m", "--tasks", "fidelity:{missing}"], "data file not found"),
    # --- convert: the conversion report's options and files, all checked before the conversion starts
    (["convert", *CONVERT, "--data", "{eval}/wikitext2_test.raw", *REPORT], "wikitext2_test.raw is an evaluation set"),
    (["convert", *CONVERT, "--data", "{wikitext_copy}", *REPORT],
     "evaluation file {eval}/wikitext2_test.raw has the same content as the calibration file {wikitext_copy}"),
    (["convert", *CONVERT, "--data", "{mixed_calib}", *REPORT],
     "the calibration file {mixed_calib} (--data) contains the evaluation text {eval}/wikitext2_test.raw"),
    (["convert", *CONVERT, "--data", "{piqa_copy}", *REPORT],
     "has the same content as the calibration file {piqa_copy}"),
    (["convert", *CONVERT, "--data", "{calib}"], "pass --report-data-dir DIR"),
    (["convert", *CONVERT, "--data", "{calib}", "--report-data-dir", "{empty_dir}"], "data file not found"),
    (["convert", *REPORTED, "--report-text", "{missing}"], "data file not found"),
    (["convert", *REPORTED, "--report-text", "{random_text}"], "not UTF-8 text"),
    (["convert", *REPORTED, "--report-context", "16k"],
     "--report-context 16384 is over smollm2-135m's limit of 8192 positions"),
    (["convert", *REPORTED, "--report-context", "2x"], "--report-context: expected comma-separated token counts"),
    (["convert", *REPORTED, "--report-context", "128,2k"], "--report-context 128 is too short for passkey"),
    (["convert", *REPORTED, "--report-tasks", "pika"], "--report-tasks: unknown task 'pika' (did you mean 'piqa'?)"),
    (["convert", *REPORTED, "--report-tasks", "passkey"], "--report-tasks: passkey is in every report already"),
    (["convert", *REPORTED, "--report-tasks", "piqa,piqa"], "--report-tasks names piqa more than once"),
    (["convert", *REPORTED, "--report-seeds", "0"], "--report-seeds must be positive"),
    (["convert", *REPORTED, "--report-limit", "0"], "--report-limit must be positive"),
    (["convert", *REPORTED, "--report-dtype", "float8"], "unknown dtype 'float8'"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--report-limit", "4"],
     "--report-limit needs the report (drop --no-report)"),
    # --- convert: calibration data, layers, settings and options that would do nothing, before any model work
    (["convert", *CONVERT, "--data", "{random_text}", "--no-report"], "not UTF-8 text"),
    (["convert", *CONVERT, "--data", "{blank_text}", "--no-report"], "is empty"),
    (["convert", *CONVERT, "--data", "{missing}", "--no-report"], "does not exist"),
    (["convert", *CONVERT, "--data", "{empty_dir}", "--no-report"], "holds no text files"),
    (["convert", *CONVERT, "--no-report"], "no calibration data"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--resume"], "--resume: nothing to resume"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--to", "gdnn"], "did you mean 'gdn'"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--layers", "3,30"], "layer index 30 is out of range"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--tokens", "0"], "--tokens must be > 0"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--stage2-lengths", "1024:0.5"], "sum to 0.5"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--parallel", "fsdp"], "applies under torchrun"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--lora-rank", "0", "--lr-lora", "1e-4"],
     "--lr-lora applies to LoRA"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--recipe", "{missing}"], "not found"),
    (["convert", *CONVERT, "--data", "{calib}", "--no-report", "--recipe", "{empty_recipe}"], "empty (no settings)"),
    (["convert", "smollm2-135m", "--recipe", "smollm2-135m/cpu-small", "--data", "{calib}", "--no-report", "--out",
      "{dense_dir}"], "exists; pass --overwrite"),
    # --- gates (Seer's gate training): data and output
    (["gates", "smollm2-135m", "--data", "{random_text}", "--out", "{missing}.gates"], "not UTF-8 text"),
    (["gates", "smollm2-135m", "--data", "{calib}", "--out", "{empty_dir}"], "is a directory"),
    (["gates", "smollm2-135m", "--data", "{calib}", "--out", "{missing}.gates", "--resume"], "--resume: no checkpoint"),
    (["gates", "smollm2-135m", "--data", "{calib}", "--out", "{damaged_gates}", "--resume"],
     "cannot read a gate-training checkpoint"),
    # --- output files named on the command line: a directory where a file is written is refused before any work
    (["eval", "smollm2-135m", "--tasks", "piqa", "--json", "{empty_dir}", *EVAL], "is a directory"),
    (["eval", "smollm2-135m", "--tasks", "piqa", "--log-samples", "{empty_dir}", *EVAL], "is a directory"),
    (["bench", "llama3-8b", "--json", "{empty_dir}"], "is a directory"),
    # --- bench: configs, lengths, engines, variants
    (["bench", "llama3-7b"], "unknown model config 'llama3-7b' (did you mean 'llama3-8b'?)"),
    (["bench", "llama3-8b", "--context", "0"], "lengths must be positive"),
    (["bench", "llama3-8b", "--context", "lots"], "--context: expected comma-separated token counts"),
    (["bench", "llama3-8b", "--batch", "0"], "lengths must be positive"),
    (["bench", "llama3-8b", "--decode-tokens", "0"], "--decode-tokens must be positive"),
    (["bench", "llama3-8b", "--repeats", "0"], "--repeats must be positive"),
    (["bench", "llama3-8b", "--engine", "vllm"], "Invalid value for '--engine'"),
    (["bench", "llama3-8b", "--variant", "convert:gdn:every:0"], "K must be >= 1"),
    (["bench", "llama3-8b", "--variant", "convert:gdnn:every:4"], "did you mean 'gdn'"),
    (["bench", "smollm2-135m", "--layers", "0"], "--layers must be in 1..30"),
    (["bench", "smollm2-135m", "--layers", "2", "--context", "9000"], "over the model's limit"),
    (["bench", "{dense_dir}", "--layers", "2"], "--layers applies to a config name"),
    # --- select: the scored selector's settings, checked before the model loads
    (["select", "smollm2-135m", "--fraction", "0", "--data", "{text_file}"], "the fraction must be in (0, 1]"),
    ([*SELECT, "--retrieval-weight", "-1"], "retrieval_weight must be a finite number >= 0"),
    ([*SELECT, "--retrieval-weight", "inf"], "retrieval_weight must be a finite number >= 0"),
    ([*SELECT, "--retrieval-probes", "0"], "needs retrieval probes"),
    ([*SELECT, "--copy-weight", "-0.5"], "copy_weight must be a finite number >= 0"),
    ([*SELECT, "--retrieval-probes", "0", "--retrieval-weight", "0", "--copy-weight", "1"],
     "copy_weight 1.0 needs retrieval probes"),
    ([*SELECT, "--retrieval-probes", "-2", "--retrieval-weight", "0"], "retrieval_probes must be >= 0"),
    ([*SELECT, "--probe-context", "2048,abc"], "bad probe_context '2048,abc'"),
    ([*SELECT, "--probe-context", "64"], "must be >= 128 tokens"),
    ([*SELECT, "--probe-context", ""], "bad probe_context ''"),
    ([*SELECT, "--align-steps", "0"], "align_steps must be >= 1"),
    ([*SELECT, "--probe-windows", "0"], "probe_windows must be >= 1"),
    # --- lm-eval (lm-evaluation-harness's command line with retrofit's model): checked before lm-eval starts
    (["lm-eval", "--model", "retrofit", "--model_args", "pretrained={missing}", "--tasks", "retrofit_piqa"],
     "no such file or directory"),
    (["lm-eval", "--model", "retrofit", "--model_args", "sparse=quest", "--tasks", "retrofit_piqa"],
     "needs --model_args pretrained=MODEL"),
    (["lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m,sparse=qest,budget=64", "--tasks",
      "retrofit_piqa"], "did you mean 'quest'"),
    (["lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m", "--tasks", "retrofit_piqa"],
     "--metadata data_dir="),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, eval_data_dir, calib_data_dir, smollm2):
    """name -> path of each bad file or directory the table names (``{eval}`` and ``{calib}`` are the real evaluation
    and calibration folders, ``{dense_dir}`` the real SmolLM2 directory: a good dense model, but not a hybrid)."""
    from retrofit.load import reference_checkpoint

    root = tmp_path_factory.mktemp("bad")
    paths = {"missing": root / "does-not-exist", "eval": eval_data_dir, "calib": calib_data_dir,
             "dense_dir": reference_checkpoint("smollm2-135m")}
    (root / "empty").mkdir()
    paths["empty_dir"] = root / "empty"
    paths["text_file"] = root / "notes.txt"
    paths["text_file"].write_text("not a model\n")

    def fixture_copy(name: str) -> Path:
        target = root / name
        shutil.copytree(FIXTURE, target)
        return target

    paths["no_tokenizer"] = fixture_copy("no_tokenizer")  # a sound hybrid, saved without its tokenizer
    paths["bad_json"] = fixture_copy("bad_json")
    (paths["bad_json"] / "config.json").write_text('{"model_type": "llama",,}')
    paths["json_list"] = fixture_copy("json_list")
    (paths["json_list"] / "config.json").write_text(json.dumps([1, 2]))
    paths["truncated"] = fixture_copy("truncated")
    weights = paths["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    paths["random_weights"] = fixture_copy("random_weights")
    (paths["random_weights"] / "model.safetensors").write_bytes(random.Random(1).randbytes(200_000))
    paths["random_gguf"] = root / "model.gguf"
    paths["random_gguf"].write_bytes(random.Random(2).randbytes(100_000))
    paths["random_text"] = root / "random.txt"
    paths["random_text"].write_bytes(b"\xff\xfe" + random.Random(3).randbytes(50_000))
    paths["damaged_gates"] = root / "damaged.gates"  # its training checkpoint is random bytes
    (root / "damaged.gates.ckpt").write_bytes(random.Random(4).randbytes(5_000))
    paths["empty_recipe"] = root / "recipe.yaml"  # what a failed substitution into a recipe template leaves
    paths["empty_recipe"].write_text("")
    paths["blank_text"] = root / "blank.txt"
    paths["blank_text"].write_text("  \n\n  ")
    paths["control_text"] = root / "control.txt"
    paths["control_text"].write_text("\x01\x02\x03\x04" * 1000)
    # calibration text that holds evaluation data: a renamed copy, and a book with a tenth of the test text re-wrapped
    paths["wikitext_copy"] = root / "notes.txt"
    shutil.copyfile(eval_data_dir / "wikitext2_test.raw", paths["wikitext_copy"])
    paths["piqa_copy"] = root / "questions.txt"
    shutil.copyfile(eval_data_dir / "piqa.jsonl", paths["piqa_copy"])
    test_text = (eval_data_dir / "wikitext2_test.raw").read_text()
    paths["mixed_calib"] = root / "mixed.txt"
    paths["mixed_calib"].write_text((calib_data_dir / "walden.txt").read_text()
                                    + textwrap.fill(test_text[len(test_text) // 2:len(test_text) * 6 // 10], 70))
    return paths


def row_id(args: list[str]) -> str:
    """The row's arguments, the shared convert options shortened to ``...``, cut at 60 characters."""
    shown = " ".join(args).replace(" ".join(REPORTED), "... +report").replace(" ".join(CONVERT), "...")
    return shown.replace(" ".join(REPORT), "+report")[:60]


@pytest.mark.parametrize("args, fragment", ROWS, ids=[row_id(args) for args, _ in ROWS])
def test_bad_input_is_one_line_and_exit_2(bad_files, args, fragment):
    argv = [part.format(**bad_files) for part in args]
    result = run(*argv)
    assert "Traceback" not in result.output + result.stderr, result.stderr
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment.format(**bad_files) in lines[0], lines[0]


def test_the_table_has_the_rows_of_every_verb():
    # the table is the one place bad inputs are listed: every verb users type has rows in it
    verbs = {args[0] for args, _ in ROWS}
    assert {"inspect", "generate", "eval", "bench", "select", "lm-eval", "convert", "gates"} <= verbs
    assert len(ROWS) >= 64


def test_text_check_passes_text_with_any_whitespace_and_refuses_control_characters(calib_data_dir):
    """Whether a file is text: the quick test (every character printable once line breaks and tabs are set aside)
    and the exact count (>= 90% printable or whitespace) must give one verdict; each branch is reached here."""
    from retrofit.textfiles import _printable_but_line_breaks_and_tabs, check_text

    book = (calib_data_dir / "walden.txt").read_text()
    assert _printable_but_line_breaks_and_tabs(book[: 1 << 20])  # a book takes the quick path
    check_text(book, "walden.txt")
    words = "Call me Ishmael.\tSome years ago,\r\nnever mind how long. " * 40
    spaced = words.replace(" ", "\u00a0\u2028\x0c", 50)  # no-break spaces, line separators, form feeds
    assert not _printable_but_line_breaks_and_tabs(spaced)  # other whitespace goes to the exact count
    check_text(spaced, "spaced.txt")
    bell_every_20 = "".join(character + ("\x07" if index % 20 == 0 else "") for index, character in enumerate(words))
    check_text(bell_every_20, "bells.txt")  # 1 control character in 21: 95% text passes
    with pytest.raises(RetrofitError, match=r"bad\.txt: not text \(20% control characters\)"):
        check_text("abcd\x00" * 400, "bad.txt")
