"""Loading the reference model's GGUF file: transformers' own load against ``retrofit.load``, side by side.

Each path runs in a fresh process (imports done before the clock starts), alternating, ``--repeats`` times each:

    transformers   AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) + AutoTokenizer.from_pretrained(...)
    retrofit       retrofit.load(path.gguf)  (one parse of the file shared by config, tokenizer and weights)
    first use      reference_checkpoint("smollm2-135m") on an empty cache: the GGUF dequantized and saved once as
                   float32 safetensors (what the alias costs the first time; the file itself is linked, not fetched)
    first use, three parses   the same with the shared parse switched off (what it cost before 2026-12-04)

    OMP_NUM_THREADS=1 python benchmarks/gguf_load.py --repeats 3 --json OUT.json

Medians are printed with each path's speed-up over its baseline (transformers' load; the first use with three
parses). Results in BENCHMARKS.md, "Current figures > Loading".
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRANSFORMERS = """
import time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from retrofit.load import reference_gguf
path = reference_gguf("smollm2-135m")
began = time.perf_counter()
AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
print(time.perf_counter() - began)
"""
RETROFIT = """
import time, retrofit
from retrofit.load import reference_gguf
path = reference_gguf("smollm2-135m")
began = time.perf_counter()
retrofit.load(path)
print(time.perf_counter() - began)
"""
FIRST_USE = """
import contextlib, importlib, os, sys, time
from pathlib import Path
loading = importlib.import_module("retrofit.load")   # the module (retrofit.load is also the function's name)
path = loading.reference_gguf("smollm2-135m")
empty = Path(os.environ["EMPTY_CACHE"]) / "smollm2-135m"
empty.mkdir(parents=True)
os.symlink(path, empty / path.name)
os.environ["RETROFIT_CACHE"] = str(empty.parent)
if sys.argv[1] == "without":
    loading.parsed_once = contextlib.nullcontext   # transformers' three parses, as before 2026-12-04
began = time.perf_counter()
loading.reference_checkpoint("smollm2-135m")
print(time.perf_counter() - began)
"""
# name -> (the timed program, its argument, the name it is compared with)
TIMED = {
    "transformers": (TRANSFORMERS, "", "transformers"),
    "retrofit": (RETROFIT, "", "transformers"),
    "first use, three parses": (FIRST_USE, "without", "first use, three parses"),
    "first use": (FIRST_USE, "with", "first use, three parses"),
}


def _time_once(name: str, code: str, argument: str) -> float:
    with tempfile.TemporaryDirectory() as empty:
        env = {**os.environ, "EMPTY_CACHE": empty, "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([sys.executable, "-c", code, argument], capture_output=True, text=True, env=env,
                              cwd=empty)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the per-run seconds and medians here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    seconds: dict[str, list[float]] = {name: [] for name in TIMED}
    for _ in range(args.repeats):
        for name, (code, argument, _) in TIMED.items():
            seconds[name].append(_time_once(name, code, argument))
    medians = {name: statistics.median(runs) for name, runs in seconds.items()}
    print("| load | median s | runs (s) | speed-up |\n|---|---:|---|---:|")
    for name, runs in seconds.items():
        baseline = TIMED[name][2]
        print(f"| {name} | {medians[name]:.2f} | {', '.join(f'{run:.2f}' for run in runs)} | "
              f"{medians[baseline] / medians[name]:.2f}x vs {baseline} |")
    if args.json:
        from retrofit.atomic import write_json

        write_json(args.json, {"seconds": seconds, "medians": medians, "threads": os.environ.get("OMP_NUM_THREADS")})


if __name__ == "__main__":
    main()
