"""retrofit inside lm-evaluation-harness (the real lm-eval 0.4.x, offline): registration on `import retrofit`, the
shipped local tasks, agreement with `retrofit eval` and with lm-eval's own `hf` model on the same PIQA items, sparse
decoding on a generation task written by `retrofit lm-eval-task`, and one-line errors before any model loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_runner import assert_one_line_error
from _cli_runner import run as run_cli

REPO = Path(__file__).resolve().parents[1]
RETROFIT = Path(sys.executable).with_name("retrofit")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# the first 50 PIQA items keep the three-way agreement test at 45 s on 2 CPU cores (133 s with 200); the same
# agreement on the first 200 (62.50 / 65.50 three ways) is recorded in BENCHMARKS.md
PIQA_ITEMS = 50


def lm_eval(tmp_path: Path, *args: str) -> dict:
    """`retrofit lm-eval ARGS --output_path OUT` in a fresh offline process; returns lm-eval's results JSON."""
    out = tmp_path / "lm-eval-out"
    tmp_path.mkdir(parents=True, exist_ok=True)
    # the checkout's retrofit, whichever one the interpreter's install points to
    env = {**os.environ, **OFFLINE,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run([str(RETROFIT), "lm-eval", *args, "--device", "cpu", "--output_path", str(out)],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3000)
    assert completed.returncode == 0, completed.stderr[-3000:]
    # neither git's complaint outside a repository nor HFLM's about being handed a model object reaches the user
    assert "fatal: not a git repository" not in completed.stderr
    assert "is not of type `str`" not in completed.stderr
    (results,) = out.glob("*/results_*.json")
    return json.loads(results.read_text())


def test_import_retrofit_registers_the_model_lazily():
    """`import retrofit` names the model in lm-eval's registry without importing lm-eval's model code."""
    code = ("import sys, retrofit; from lm_eval.api.registry import model_registry; "
            "print(model_registry._objs['retrofit']); "
            "print(sorted(m for m in sys.modules if m.startswith('lm_eval')), 'datasets' in sys.modules); "
            "from lm_eval.api.registry import get_model; print(get_model('retrofit').__name__)")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    placeholder, loaded_heavy, resolved = completed.stdout.strip().splitlines()
    assert placeholder == "retrofit.harness.model:RetrofitLM"
    assert loaded_heavy == "['lm_eval', 'lm_eval.api', 'lm_eval.api.registry'] False"
    assert resolved == "RetrofitLM"


def test_shipped_task_yamls_are_package_data():
    from retrofit.harness import TASKS_DIR

    names = sorted(path.stem for path in TASKS_DIR.glob("*.yaml"))
    assert names == ["retrofit_arc_easy", "retrofit_hellaswag", "retrofit_lambada", "retrofit_piqa"]
    assert '"retrofit.harness" = ["tasks/*.yaml"]' in (REPO / "pyproject.toml").read_text()


def test_local_tasks_read_the_same_items_as_retrofit_eval(eval_data_dir):
    from retrofit.eval.multiple_choice import load_hellaswag, load_jsonl
    from retrofit.harness import datasets

    piqa = datasets.piqa(data_dir=str(eval_data_dir), pretrained="ignored")["validation"]  # metadata holds model_args
    items = load_jsonl(eval_data_dir / "piqa.jsonl")
    assert len(piqa) == len(items) == 1838
    assert [piqa[i]["query"] for i in (0, 917, 1837)] == [items[i].query for i in (0, 917, 1837)]
    assert piqa[5]["choices"] == list(items[5].choices) and piqa[5]["gold"] == items[5].gold
    hellaswag = datasets.hellaswag(data_dir=str(eval_data_dir))["validation"]
    assert len(hellaswag) == 10042 and hellaswag[0]["query"] == load_hellaswag(
        eval_data_dir / "hellaswag_val.txt.bz2", limit=1)[0].query


def test_errors_are_one_line_and_come_before_the_model_loads(eval_data_dir, tmp_path):
    result = run_cli("lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m",
                     "--tasks", "retrofit_piqa", "--limit", "2")
    assert_one_line_error(result, "task retrofit_piqa reads piqa.jsonl", "--metadata data_dir=")
    result = run_cli("lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m",
                     "--tasks", "retrofit_piqa", "--metadata", f"data_dir={tmp_path}")
    assert_one_line_error(result, "data file not found", "piqa.jsonl")
    result = run_cli("lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m,sparse=qest,budget=64",
                     "--tasks", "retrofit_piqa", "--metadata", f"data_dir={eval_data_dir}")
    assert_one_line_error(result, "unknown sparse method 'qest'", "did you mean 'quest'")
    result = run_cli("lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m,sparse=quest",
                     "--tasks", "retrofit_piqa", "--metadata", f"data_dir={eval_data_dir}")
    assert_one_line_error(result, "sparse=quest needs budget=N")
    result = run_cli("lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m,page_size=4",
                     "--tasks", "retrofit_piqa", "--metadata", f"data_dir={eval_data_dir}")
    assert_one_line_error(result, "page_size", "need sparse=METHOD")
    result = run_cli("lm-eval", "--model", "retrofit", "--tasks", "retrofit_piqa")
    assert_one_line_error(result, "needs --model_args pretrained=MODEL")


def test_a_missing_model_is_one_line_from_inside_lm_eval(eval_data_dir):
    # passes the early checks: retrofit.load refuses it inside lm-eval's simple_evaluate, and the line comes through
    result = run_cli("lm-eval", "--model", "retrofit", "--model_args", "pretrained=/no/such/model",
                     "--tasks", "retrofit_piqa", "--metadata", f"data_dir={eval_data_dir}", "--device", "cpu")
    assert result.exit_code == 2, result.output
    # lm-eval's own INFO log lines may come first; the error is the last line, and no traceback
    assert result.stderr.strip().splitlines()[-1] == "retrofit: error: no such file or directory: /no/such/model"
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_lm_eval_hf_retrofit_model_and_retrofit_eval_agree_on_piqa(smollm2, eval_data_dir, tmp_path):
    """The same first 50 PIQA items scored three ways: lm-eval's own `hf` model (the float32 checkpoint retrofit.load
    reads for the alias), lm-eval with the `retrofit` model, and `retrofit eval`. They must agree to one item (2
    points): the same tokens are scored, so only float32 summation order can move a near-tie."""
    from retrofit.eval.runner import run_eval
    from retrofit.eval.tasks import EvalSettings, build_jobs
    from retrofit.load import reference_checkpoint

    model, tokenizer = smollm2
    jobs = build_jobs(["piqa"], EvalSettings(data_dir=eval_data_dir, limit=PIQA_ITEMS))
    ours = run_eval(model, tokenizer, jobs, [], batch_size=8).results["dense"]["piqa"]
    print(f"\nretrofit eval, PIQA first {PIQA_ITEMS}: acc {ours['acc']:.4f} ± {ours['acc_stderr']:.4f}, "
          f"acc_norm {ours['acc_norm']:.4f} ± {ours['acc_norm_stderr']:.4f}")
    task = ["--tasks", "retrofit_piqa", "--metadata", f"data_dir={eval_data_dir}", "--limit", str(PIQA_ITEMS),
            "--batch_size", "8"]
    hf = lm_eval(tmp_path / "hf", "--model", "hf", "--model_args",
                 f"pretrained={reference_checkpoint('smollm2-135m')},dtype=float32", *task)["results"]["retrofit_piqa"]
    bridged = lm_eval(tmp_path / "retrofit", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m",
                      *task)["results"]["retrofit_piqa"]
    print(f"\nPIQA first {PIQA_ITEMS}, dense acc: retrofit eval {ours['acc']:.4f} ± {ours['acc_stderr']:.4f}, "
          f"lm-eval hf {hf['acc,none']:.4f} ± {hf['acc_stderr,none']:.4f}, "
          f"lm-eval retrofit {bridged['acc,none']:.4f}; acc_norm {ours['acc_norm']:.4f} / "
          f"{hf['acc_norm,none']:.4f} / {bridged['acc_norm,none']:.4f}")
    assert ours["n"] == PIQA_ITEMS and hf["sample_len"] == bridged["sample_len"] == PIQA_ITEMS
    one_item = 1 / PIQA_ITEMS + 1e-9
    for metric in ("acc", "acc_norm"):
        assert abs(hf[f"{metric},none"] - ours[metric]) <= one_item
        assert abs(bridged[f"{metric},none"] - ours[metric]) <= one_item
        # lm-eval's stderr and ours are the same closed form on the same outcomes
        assert bridged[f"{metric}_stderr,none"] == pytest.approx(ours[f"{metric}_stderr"], abs=0.0011)


@pytest.mark.slow
def test_sparse_decoding_runs_through_lm_eval_on_a_written_passkey_task(tmp_path):
    """`retrofit lm-eval-task` writes passkey at 1k tokens; lm-eval runs it dense and with StreamingLLM at a budget
    of 16 tokens (sinks + a window far shorter than the distance to the key). Dense reads the keys (SmolLM2 does at
    1k: test_eval_synthetic); the sparse model must decode differently, which shows sparse decoding was applied."""
    tasks = tmp_path / "tasks"
    result = run_cli("lm-eval-task", "passkey", "smollm2-135m", "--context-length", "1k", "--limit", "2",
                     "--out", str(tasks))
    assert result.exit_code == 0, result.output
    assert "retrofit_passkey_1024: 2 items" in result.stdout
    common = ["--include_path", str(tasks), "--tasks", "retrofit_passkey_1024", "--log_samples", "--batch_size", "2"]
    dense = lm_eval(tmp_path / "dense", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m", *common)
    sparse = lm_eval(tmp_path / "sparse", "--model", "retrofit", "--model_args",
                     "pretrained=smollm2-135m,sparse=streaming,budget=16", *common)
    dense_score = dense["results"]["retrofit_passkey_1024"]["score,none"]
    sparse_score = sparse["results"]["retrofit_passkey_1024"]["score,none"]

    def outputs(run: str) -> list[str]:
        (samples,) = (tmp_path / run / "lm-eval-out").glob("*/samples_retrofit_passkey_1024_*.jsonl")
        return [json.loads(line)["resps"][0][0] for line in samples.read_text().splitlines()]

    print(f"\npasskey@1024 through lm-eval: dense {dense_score}, streaming@16 {sparse_score}; "
          f"outputs {outputs('dense')} vs {outputs('sparse')}")
    assert dense_score == 1.0
    assert outputs("dense") != outputs("sparse")
    assert sparse["config"]["model_args"]["sparse"] == "streaming"


@pytest.mark.slow
def test_retrofit_eval_and_lm_eval_score_the_same_first_items_of_a_long_context_task(tmp_path):
    """`--limit 4` takes the first 4 items in both: `retrofit eval --limit 4` and lm-eval's `--limit 4` on the task
    `retrofit lm-eval-task` wrote (its 20 items a seed) read the same 4 prompts and give each the same output and
    score. StreamingLLM at 128 tokens keeps only the sinks and the last window, so the scores differ by item."""
    samples = tmp_path / "samples.jsonl"
    ours = run_cli("eval", "smollm2-135m", "--tasks", "passkey", "--context-length", "1k", "--limit", "4",
                   "--sparse", "streaming", "--budget", "128", "--batch-size", "4", "--device", "cpu",
                   "--log-samples", str(samples))
    assert ours.exit_code == 0, ours.output
    written = run_cli("lm-eval-task", "passkey", "smollm2-135m", "--context-length", "1k", "--out", str(tmp_path / "t"))
    assert "retrofit_passkey_1024: 20 items" in written.stdout, written.output
    theirs = lm_eval(tmp_path / "run", "--model", "retrofit", "--model_args",
                     "pretrained=smollm2-135m,sparse=streaming,budget=128", "--include_path", str(tmp_path / "t"),
                     "--tasks", "retrofit_passkey_1024", "--limit", "4", "--log_samples", "--batch_size", "4")
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    mine = [(r["seed"], r["index"], r["output"], r["score"]) for r in records if r["variant"] != "dense"]
    (lm_eval_samples,) = (tmp_path / "run" / "lm-eval-out").glob("*/samples_retrofit_passkey_1024_*.jsonl")
    lm_evals = sorted((json.loads(line) for line in lm_eval_samples.read_text().splitlines()),
                      key=lambda sample: sample["doc_id"])
    assert [(s["doc"]["seed"], s["doc"]["index"], s["resps"][0][0], s["score"]) for s in lm_evals] == mine
    assert [index for _, index, _, _ in mine] == [0, 19, 9, 14]  # the needle at 0%, 100%, 47% and 74% deep
    assert len({score for *_, score in mine}) == 2, mine  # some items read, some lost: the items tell apart


def test_written_task_holds_retrofit_evals_prompts(smollm2, tmp_path):
    from lm_eval.tasks._yaml_loader import load_yaml

    from retrofit.eval.synthetic import generate_items
    from retrofit.harness.synthetic import process_results, write_synthetic_task

    _, tokenizer = smollm2
    written = write_synthetic_task("niah_multivalue", tokenizer, 512, [3, 4], 2, tmp_path)
    config = load_yaml(str(written.yaml_path), resolve_func=True)  # lm-eval's own YAML loader, !function resolved
    assert config["task"] == "retrofit_niah_multivalue_512" and config["process_results"] is process_results
    assert config["dataset_kwargs"]["data_files"]["test"] == str(written.data_path)
    records = [json.loads(line) for line in written.data_path.read_text().splitlines()]
    items = generate_items("niah_multivalue", tokenizer, 512, [3, 4], 2)
    assert [r["prompt"] for r in records] == [tokenizer.decode(list(i.prompt_ids)) for i in items]
    assert [r["seed"] for r in records] == [3, 3, 4, 4]
    answers = records[0]["answers"]
    assert process_results(records[0], [" " + ", ".join(answers)]) == {"score": 1.0, "partial": 1.0}
    assert process_results(records[0], [answers[0]]) == {"score": 0.0, "partial": 0.25}
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_hybrid_checkpoint_scores_the_same_in_lm_eval_and_retrofit_eval(smollm2, eval_data_dir, tmp_path):
    """model_args pretrained=DIR loads a hybrid through retrofit.load; lm-eval's per-choice log-likelihoods equal
    retrofit eval's on the same items (same tokens, both unpadded-equivalent float32 forwards)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from retrofit.convert.build import to_hybrid
    from retrofit.eval.multiple_choice import evaluate_multiple_choice, item_outcomes, load_jsonl
    from retrofit.harness import TASKS_DIR
    from retrofit.hybrid import HybridSection, save_hybrid
    from retrofit.load import load

    dense_model, tokenizer = smollm2
    save_hybrid(to_hybrid(dense_model, HybridSection(layers=[15], layer_type="gdn", base_model_type="llama")),
                tokenizer, tmp_path / "gdn15")
    hybrid, hybrid_tokenizer = load(str(tmp_path / "gdn15"))
    items = load_jsonl(eval_data_dir / "piqa.jsonl", limit=3)
    _, scores = evaluate_multiple_choice(hybrid, hybrid_tokenizer, items, batch_size=4)
    ours = item_outcomes(items, scores)
    results = lm_eval.simple_evaluate(
        model="retrofit", model_args=f"pretrained={tmp_path / 'gdn15'}", tasks=["retrofit_piqa"], limit=3,
        batch_size=4, device="cpu", log_samples=True,
        # retrofit_piqa is one of retrofit's own tasks: lm-eval's index of its ~15,000 built-in ones is not needed
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                                 metadata={"data_dir": str(eval_data_dir)}))
    samples = sorted(results["samples"]["retrofit_piqa"], key=lambda sample: sample["doc_id"])
    theirs = [[response[0][0] for response in sample["resps"]] for sample in samples]
    assert results["config"]["model_args"] == f"pretrained={tmp_path / 'gdn15'}"
    for mine, lm_evals in zip(ours, theirs):
        # sums of ~20-60 float32 log-probabilities; batching differs (padding), 1e-4 as in test_eval_scoring
        assert mine["loglikelihoods"] == pytest.approx(lm_evals, abs=1e-4)
    assert results["results"]["retrofit_piqa"]["acc,none"] == sum(record["acc"] for record in ours) / 3


def test_lm_eval_indexes_only_the_include_paths_when_they_hold_every_task_asked_for(tmp_path):
    """lm-eval indexes its ~14,000 built-in task files before looking a name up (about 15 s of a CPU core): when
    every task asked for is retrofit's or the user's, only the include paths are indexed; a built-in task, or a mix,
    leaves lm-eval's own task manager in place."""
    from lm_eval import tasks as lm_eval_tasks

    from retrofit.harness import TASKS_DIR
    from retrofit.harness.command import (include_shipped_tasks, included_tasks_only_when_they_hold_every_task,
                                          parse_lm_eval_args)

    def args_for(*argv):
        _, args = parse_lm_eval_args(["--model", "retrofit", *argv])
        include_shipped_tasks(args)
        return args

    every_task_manager = lm_eval_tasks.TaskManager
    ours = args_for("--tasks", "retrofit_piqa,retrofit_arc_easy")
    with included_tasks_only_when_they_hold_every_task(ours):
        narrowed = lm_eval_tasks.TaskManager(include_path=ours.include_path)  # as lm-eval's run command builds it
    assert lm_eval_tasks.TaskManager is every_task_manager  # restored on leaving
    shipped = sorted(path.stem for path in TASKS_DIR.glob("*.yaml"))
    assert narrowed.all_tasks == shipped and isinstance(narrowed, every_task_manager)
    for argv in (("--tasks", "piqa"), ("--tasks", "retrofit_piqa,arc_easy"), ()):
        with included_tasks_only_when_they_hold_every_task(args_for(*argv)):
            assert lm_eval_tasks.TaskManager is every_task_manager, argv
