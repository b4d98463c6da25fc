"""What `blocking()` costs a route on Lambda (work inline) and under `serve` (work on a
worker thread), per call, measured in one run; no database.

    python bench/lambda_path.py [--calls 100000]

Each route makes one or two blocking() calls. Prints microseconds per call for: the work
called directly, blocking() inline (the Lambda path: a Runtime without worker threads),
and blocking() through a worker thread (serve's path), then `name=value` lines with the
ratios: inline_overhead_us (blocking inline minus direct) and thread_hop_vs_inline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

import handler


def work() -> int:
    return 1


async def per_call(calls: int, runtime: handler.Runtime) -> tuple[float, float]:
    """(direct, through blocking()) microseconds per call, with `runtime` installed."""
    handler.use_runtime(runtime)
    started = time.perf_counter()
    for _ in range(calls):
        work()
    direct = (time.perf_counter() - started) / calls * 1e6
    started = time.perf_counter()
    for _ in range(calls):
        await handler.blocking(work)
    wrapped = (time.perf_counter() - started) / calls * 1e6
    return direct, wrapped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args(argv)
    settings = handler.load_settings({"DATABASE_URL": "postgresql://u@127.0.0.1/unused"})
    direct, inline = asyncio.run(per_call(args.calls, handler.Runtime(settings)))
    hops = max(1, args.calls // 20)  # a thread hop is slower: fewer calls
    _, threaded = asyncio.run(per_call(hops, handler.Runtime(settings, worker_threads=8)))
    handler.use_runtime(None)
    print(f"direct call:               {direct:8.2f} us")
    print(f"blocking() inline (Lambda): {inline:8.2f} us")
    print(f"blocking() on a thread:     {threaded:8.2f} us")
    print(f"inline_overhead_us={inline - direct:.2f}")
    print(f"thread_hop_us={threaded:.1f}")
    print(f"thread_hop_vs_inline={threaded / inline:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
