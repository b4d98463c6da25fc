"""One request's Python, this tree's handler.py against another commit's, in one process.

    python3 bench/handler_ab.py --vs REF [--path /queue] [--blocks 200] [--calls 25]

Both versions of handler.py are imported into this process (as handler_a, REF's, and
handler_b, this tree's) and each answers through its own handler.api with a Runtime whose
API connection answers at once (bench/claim_layers.answering_runtime: the database taken
out, as claim_layers.py's part 1 does). Calls go in blocks of --calls, the two versions'
blocks in a shuffled order, so both see the same load; medians in microseconds and their
ratio (b/a < 1: this tree is faster). A small change to the request path (a few
microseconds) shows here when it drowns in a whole claim's round trip.

No database is written; the settings come from bench/claims_workers (UPLOAD_PASSWORD and
a DATABASE_URL that is never connected to).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import claim_layers
import claims_workers

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module.use_runtime(claim_layers.answering_runtime(module))
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vs", required=True, help="the commit to compare with (git rev)")
    parser.add_argument("--path", default="/queue", help="the request's path")
    parser.add_argument("--blocks", type=int, default=200, help="blocks per version")
    parser.add_argument("--calls", type=int, default=25, help="calls per block")
    args = parser.parse_args(argv)
    claims_workers._service_env("postgresql://bench@127.0.0.1:1/never-connected", None)
    source = subprocess.run(
        ["git", "show", f"{args.vs}:handler.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "handler.py"
        other.write_bytes(source)
        versions = {"a": load(other, "handler_a"), "b": load(ROOT / "handler.py", "handler_b")}
        context = versions["a"].LocalContext(25, "bench-ab")
        for module in versions.values():
            for _ in range(300):  # warm: the first calls build what is built lazily
                answer = module.api(claims_workers.api_gateway_v2_event(args.path), context)
            if answer["statusCode"] >= 500:
                raise SystemExit(f"{args.path} answered {answer['statusCode']}: {answer['body']}")
        times: dict[str, list[float]] = {key: [] for key in versions}
        order = random.Random(1)
        for _ in range(args.blocks):
            keys = list(versions)
            order.shuffle(keys)
            for key in keys:
                module = versions[key]
                for _ in range(args.calls):
                    event = claims_workers.api_gateway_v2_event(args.path)
                    started = time.perf_counter()
                    module.api(event, context)
                    times[key].append(time.perf_counter() - started)
    a, b = (statistics.median(times[key]) * 1e6 for key in ("a", "b"))
    print(f"{args.path}: {args.vs} {a:.1f} µs, this tree {b:.1f} µs, ratio {b / a:.3f}")
    print(f"ab_{args.path.strip('/').split('/')[0]}_ratio={b / a:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
