"""Parsing a large upload with and without Python's cyclic garbage collector.

    python bench/json_parse.py [--megabytes 4] [--runs 3]

The upload routes parse and check a body with the collector paused (handler.py,
`_cycle_collector_paused`): a document of small nested arrays makes millions of
containers, and every collector pass walks them all again. This prints the median time
of json.loads + handler.json_problem over such a document with the collector on and off,
and their ratio, measured in one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import handler


def parse_and_check(document: str, collector: bool) -> float:
    gc.collect()
    if collector:
        gc.enable()
    else:
        gc.disable()
    try:
        started = time.perf_counter()
        handler.json_problem(json.loads(document), "analysis")
        return time.perf_counter() - started
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    document = "[" + ",".join(["[]"] * int(args.megabytes * 1_000_000 / 3)) + "]"
    timings = {
        collector: statistics.median(parse_and_check(document, collector) for _ in range(args.runs))
        for collector in (True, False)
    }
    print(f"document: {len(document) / 1e6:.1f} MB of small nested arrays")
    print(f"with the collector: {timings[True]:.2f} s, without: {timings[False]:.2f} s")
    print(f"parse_with_collector_vs_without={timings[True] / timings[False]:.2f}")


if __name__ == "__main__":
    main()
