"""One request's Python, this tree's handler.py against another commit's, in one process.

    python3 bench/handler_ab.py --vs REF [--path /queue] [--blocks 200] [--calls 25]
    python3 bench/handler_ab.py --vs REF --before-file /tmp/handler_before.py

Both versions of handler.py are imported into this process (handler_a, REF's or
--before-file, and handler_b, this tree's). Each answers through its own handler.api, as
Lambda calls it, with a Runtime whose API connection answers every statement at once
(answering_runtime: the database taken out, so only the request's Python is left). The
calls go in rounds: each round one block of --calls calls per version, the versions in a
shuffled order, so that both see the same load. Each call's CPU time (this thread's,
time.thread_time: what Lambda bills, unmoved by waiting on other processes) and wall time
are kept.

Printed: each version's median CPU µs per request, and the ratio b/a (below 1: this tree
is faster) as the median of the rounds' ratios (each round's block medians), with a
95 % interval of that median: a difference inside the interval is not resolved. No
database is connected to.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import claims

ROOT = Path(__file__).resolve().parent.parent
CLAIMED_APP = "com.example.bench.app123"


def answering_runtime(handler):
    """A handler.Runtime whose API connection answers every statement at once with the
    claimed row (the shared password's row when that is asked), its promoter caught up (a
    clock that stands still)."""

    # The shared password's row (sql/034), for a version that reads it on each request.
    credential = getattr(handler, "SERVICE_CREDENTIAL", None)
    stored = {
        "token_hash": handler.token_hash(claims.UPLOAD_PASSWORD),
        "previous_token_hash": None,
        "session_key": b"bench",
    }

    class AnsweringConnection(handler.SharedConnection):
        def records(self, sql, **params):
            return [stored] if sql == credential else [{"appid": CLAIMED_APP}]

        def autocommit(self, work):
            return [{"appid": CLAIMED_APP}]

        def transaction(self, work):
            return [{"appid": CLAIMED_APP}]

    class AnsweringRuntime(handler.Runtime):
        def api_connection(self):
            return self.answering

    config = handler.load_settings(dict(os.environ))
    runtime = AnsweringRuntime(config)
    runtime.answering = AnsweringConnection(lambda: {}, clock=lambda: 0.0)
    runtime.answering.promoter.caught_up_at[config.policy] = 0.0
    return runtime


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module.use_runtime(answering_runtime(module))
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vs", required=True, help="the commit to compare with (git rev)")
    parser.add_argument("--before-file", type=Path, help="REF's handler.py, already written")
    parser.add_argument("--after-file", type=Path, default=ROOT / "handler.py", help="b")
    parser.add_argument("--path", default="/queue", help="the request's path")
    parser.add_argument("--blocks", type=int, default=200, help="rounds (a block per version)")
    parser.add_argument("--calls", type=int, default=25, help="calls per block")
    args = parser.parse_args(argv)
    claims.service_env("postgresql://bench@127.0.0.1:1/never-connected")
    with tempfile.TemporaryDirectory() as scratch:
        other = args.before_file
        if other is None:
            other = Path(scratch) / "handler.py"
            other.write_bytes(
                subprocess.run(
                    ["git", "show", f"{args.vs}:handler.py"],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                ).stdout
            )
        versions = {"a": load(other, "handler_a"), "b": load(args.after_file, "handler_b")}
        return measure(versions, args)


def measure(versions: dict, args: argparse.Namespace) -> int:
    context = versions["a"].LocalContext(25, "bench-ab")
    for module in versions.values():
        for _ in range(300):  # warm: the first calls build what is built lazily
            answer = module.api(claims.gateway_event(args.path), context)
        if answer["statusCode"] >= 500:
            raise SystemExit(f"{args.path} answered {answer['statusCode']}: {answer['body']}")
    cpu: dict[str, list[float]] = {key: [] for key in versions}
    wall: dict[str, list[float]] = {key: [] for key in versions}
    ratios = []
    order = random.Random(1)
    for _ in range(args.blocks):
        keys = list(versions)
        order.shuffle(keys)
        block = {}
        for key in keys:
            module = versions[key]
            times = []
            for _ in range(args.calls):
                event = claims.gateway_event(args.path)
                started, used = time.perf_counter(), time.thread_time()
                module.api(event, context)
                times.append(time.thread_time() - used)
                wall[key].append(time.perf_counter() - started)
            cpu[key] += times
            block[key] = statistics.median(times)
        ratios.append(block["b"] / block["a"])
    a, b = (statistics.median(cpu[key]) * 1e6 for key in ("a", "b"))
    wall_a, wall_b = (statistics.median(wall[key]) * 1e6 for key in ("a", "b"))
    low, high = claims.interval(ratios)
    ratio = statistics.median(ratios)
    name = args.path.strip("/").split("/")[0]
    print(
        f"{args.path}: {args.vs} {a:.1f} µs CPU ({wall_a:.1f} wall), this tree {b:.1f} µs CPU"
        f" ({wall_b:.1f} wall); {args.blocks} rounds of {args.calls} calls each"
    )
    print(f"ab_{name}_before_cpu_us={a:.1f}")
    print(f"ab_{name}_after_cpu_us={b:.1f}")
    print(f"ab_{name}_ratio={ratio:.3f} interval={low:.3f}-{high:.3f} (b/a: reported)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
