"""The loss of every optimizer step of one conversion and the peak memory of the process that ran it, for a side by
side of two checkouts (a change that must not move the loss curve, and should lower the memory).

    OMP_NUM_THREADS=1 python benchmarks/convert_loss_curve.py --data ../shared/data/calib --json after.json
    OMP_NUM_THREADS=1 python benchmarks/convert_loss_curve.py --data ../shared/data/calib --json before.json \\
        --retrofit-from /tmp/older-checkout
    python benchmarks/convert_loss_curve.py --compare before.json after.json

Each run is a fresh process (the peak resident set is the process's own: ``VmHWM``). ``--compare`` prints both
curves step by step with the largest absolute and relative difference of the losses and both peaks.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _import_path(argv: list[str]) -> Path:
    """The folder to import retrofit from: ``--retrofit-from DIR`` or this checkout (read before argparse)."""
    if "--retrofit-from" in argv:
        return Path(argv[argv.index("--retrofit-from") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


def run(args) -> dict:
    sys.path.insert(0, str(_import_path(sys.argv)))
    import retrofit
    from retrofit.atomic import write_json
    from retrofit.convert import distill
    from retrofit.convert.pipeline import convert
    from retrofit.devices import peak_rss_bytes

    histories = []
    original_run = distill.Distiller.run

    def run_and_keep_history(self):
        try:
            return original_run(self)
        finally:
            histories.append(self.history)

    distill.Distiller.run = run_and_keep_history
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        convert(args.model, recipe=args.recipe, data=list(args.data), out=Path(tmp) / "hybrid", show_progress=False,
                device="cpu")
    seconds = time.perf_counter() - start
    result = {"retrofit": str(Path(retrofit.__file__).parent.parent), "recipe": args.recipe, "model": args.model,
              "seconds": seconds, "peak_rss_bytes": peak_rss_bytes(), "stage1": histories[0]["stage1"],
              "stage2": histories[0]["stage2"]}
    if args.json:
        write_json(args.json, result)
    return result


def compare(before_path: str, after_path: str) -> None:
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    print(f"before: {before['retrofit']}\nafter:  {after['retrofit']}")
    print("| stage | step | loss before | loss after | abs. difference | rel. difference |")
    print("|---|---:|---:|---:|---:|---:|")
    worst_abs = worst_rel = 0.0
    for stage in ("stage1", "stage2"):
        if len(before[stage]) != len(after[stage]):
            raise SystemExit(f"{stage}: {len(before[stage])} steps before, {len(after[stage])} after")
        for step, (a, b) in enumerate(zip(before[stage], after[stage])):
            diff = abs(a - b)
            rel = diff / max(abs(a), 1e-30)
            worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, rel)
            print(f"| {stage[-1]} | {step} | {a:.6f} | {b:.6f} | {diff:.2e} | {rel:.2e} |")
    print(f"largest difference: {worst_abs:.2e} absolute, {worst_rel:.2e} relative")
    print(f"peak RSS: {before['peak_rss_bytes'] / 2 ** 30:.2f} GiB before, {after['peak_rss_bytes'] / 2 ** 30:.2f} GiB "
          f"after; {before['seconds']:.0f} s before, {after['seconds']:.0f} s after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipe", default="smollm2-135m/cpu-small")
    parser.add_argument("--data", action="append", default=[])
    parser.add_argument("--json", default=None)
    parser.add_argument("--retrofit-from", default=None, help="import retrofit from this folder")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None)
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if not args.data:
        parser.error("--data is required (calibration text file or folder)")
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k not in ("stage1", "stage2")}))


if __name__ == "__main__":
    main()
