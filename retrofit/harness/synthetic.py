"""Long-context synthetic tasks of ``retrofit eval`` (passkey, niah_single, ...) written as lm-eval tasks: a JSONL file
of prompts and answers and a ``generate_until`` task YAML that reads it offline (``dataset_path: json``,
``dataset_kwargs.data_files``), scored by ``retrofit eval``'s own scorer (:func:`process_results`).

The prompt text is the decoded prompt of ``retrofit eval`` (chat template and answer prefix included); lm-eval
encodes it again, and decodes greedily until the end-of-sequence token or the task's token limit, as ``retrofit
eval`` does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from retrofit.atomic import write_text
from retrofit.eval import synthetic


class _Function(str):
    """A value written with lm-eval's ``!function`` YAML tag (a dotted path lm-eval imports)."""


class _TaskDumper(yaml.SafeDumper):
    pass


_TaskDumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


@dataclass(frozen=True)
class WrittenTask:
    name: str
    yaml_path: Path
    data_path: Path
    items: int


def task_name(task: str, context_length: int) -> str:
    return f"retrofit_{task}_{context_length}"


def write_synthetic_task(task: str, tokenizer, context_length: int, seeds: list[int], num_items: int,
                         out_dir: Path, haystack: synthetic.Haystack | None = None) -> WrittenTask:
    """Write ``OUT/retrofit_<task>_<length>.jsonl`` (one item per line: prompt, answers, seed, index) and the task
    YAML beside it; the items are those of ``retrofit eval --tasks TASK --context-length LENGTH`` for ``seeds``."""
    spec = synthetic.SYNTHETIC_TASKS.get(task)
    items = synthetic.generate_items(task, tokenizer, context_length, seeds, num_items, haystack)
    name = task_name(task, context_length)
    out_dir = Path(out_dir).resolve()
    data_path, yaml_path = out_dir / f"{name}.jsonl", out_dir / f"{name}.yaml"
    records = [{"task": task, "context_length": context_length, "seed": item.seed, "index": item.index,
                "prompt": tokenizer.decode(list(item.prompt_ids), skip_special_tokens=False),
                "prompt_tokens": len(item.prompt_ids), "answers": list(item.answers)} for item in items]
    metrics = ["score"] + (["partial"] if spec.multi_answer else [])
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_path)}},
        "output_type": "generate_until",
        "test_split": "test",
        "doc_to_text": "prompt",
        "doc_to_target": "{{answers | join(', ')}}",
        # the end-of-sequence token (lm-eval always adds it) or the token limit ends the answer, as in retrofit eval
        "generation_kwargs": {"until": [], "max_gen_toks": spec.max_new_tokens, "do_sample": False},
        "process_results": _Function("retrofit.harness.synthetic.process_results"),
        "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in metrics],
        "metadata": {"version": 1.0, "written_by": "retrofit lm-eval-task"},
    }
    text = yaml.dump(config, Dumper=_TaskDumper, sort_keys=False, width=120)
    write_text(data_path, "".join(json.dumps(record) + "\n" for record in records))
    write_text(yaml_path, f"# {task} at {context_length} tokens, seeds {seeds[0]}..{seeds[-1]}, {num_items} items "
                          f"per seed; written by retrofit lm-eval-task\n" + text)
    return WrittenTask(name, yaml_path, data_path, len(records))


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's per-document scoring hook: ``retrofit eval``'s scorer on the one greedy output (0/1 ``score``,
    and ``partial`` for multi-answer tasks)."""
    item = synthetic.SyntheticItem(doc["task"], int(doc["context_length"]), int(doc["seed"]), int(doc["index"]),
                                   (), tuple(doc["answers"]), 0)
    return {metric: values[0] for metric, values in synthetic.item_scores(doc["task"], [item], [results[0]]).items()}
