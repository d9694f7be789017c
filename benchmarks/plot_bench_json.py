"""Draw a saved ``retrofit bench --json`` as ``retrofit bench --plot`` draws a run: decode tokens/s against context,
a line per variant, engine and batch, beside the prefill seconds. Several files join into one chart.

    python benchmarks/plot_bench_json.py benchmarks/results/2026-12-04/h200_bench_gdn_quest_streaming.json \\
        --out docs/images/decode-tokens-per-s.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from retrofit.bench.plot import chart_title, save_bench_plot


def joined_points(paths: list[Path], variants: list[str] | None = None) -> list[dict]:
    """The points of every file in order (``variants`` keeps those variants, in every file)."""
    points = [point for path in paths for point in json.loads(path.read_text())["results"]]
    return [point for point in points if not variants or point["variant"] in variants]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="retrofit bench --json files")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--variants", default=None, help="comma-separated variants to draw (default: all)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",") if args.variants else None
    first_config = json.loads(args.results[0].read_text())["config"]
    save_bench_plot(joined_points(args.results, variants), args.out, title=chart_title(first_config))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
