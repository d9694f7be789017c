"""``custom_dataset`` functions of the shipped lm-eval tasks: the evaluation files of a data folder, read by the
same loaders as ``retrofit eval`` (same items, same order, so ``--limit N`` takes the same first N in both).

lm-eval calls them with the task's metadata (``--metadata data_dir=DIR`` on its command line,
``TaskManager(metadata={"data_dir": DIR})`` in Python, merged with the model_args) and returns no download: they
run with ``HF_DATASETS_OFFLINE=1``. Each returns ``{"validation": datasets.Dataset}`` with the record fields of
``retrofit eval``'s item types.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from retrofit.errors import RetrofitError
from retrofit.eval.lambada import load_lambada
from retrofit.eval.multiple_choice import load_hellaswag, load_jsonl

FILES = {"retrofit_piqa": "piqa.jsonl", "retrofit_arc_easy": "arc_easy.jsonl",
         "retrofit_hellaswag": "hellaswag_val.txt.bz2", "retrofit_lambada": "lambada_openai.jsonl"}


def data_file(task: str, data_dir: Any) -> Path:
    """``DIR/<file of task>``; a missing ``data_dir`` or file is a one-line error naming what to pass."""
    if not data_dir:
        raise RetrofitError(f"task {task} reads {FILES[task]}: pass the folder holding it as lm-eval metadata, "
                            "e.g. --metadata data_dir=../shared/data/eval")
    path = Path(str(data_dir)).expanduser() / FILES[task]
    if not path.is_file():
        raise RetrofitError(f"task {task}: data file not found: {path}")
    return path


def _dataset(task: str, loader: Callable[[Path], list], data_dir: Any) -> dict:
    import datasets

    records = [asdict(item) for item in loader(data_file(task, data_dir))]
    for record in records:
        if "choices" in record:
            record["choices"] = list(record["choices"])
    return {"validation": datasets.Dataset.from_list(records)}


def piqa(data_dir: str | None = None, **metadata: Any) -> dict:
    return _dataset("retrofit_piqa", load_jsonl, data_dir)


def arc_easy(data_dir: str | None = None, **metadata: Any) -> dict:
    return _dataset("retrofit_arc_easy", load_jsonl, data_dir)


def hellaswag(data_dir: str | None = None, **metadata: Any) -> dict:
    return _dataset("retrofit_hellaswag", load_hellaswag, data_dir)


def lambada(data_dir: str | None = None, **metadata: Any) -> dict:
    return _dataset("retrofit_lambada", load_lambada, data_dir)
