"""bench/handler_ab.py runs (docs/benchmarks.md cites its ratios): a short run of this
tree against its own HEAD prints both medians and a ratio line."""

from __future__ import annotations

import subprocess
import sys

from kit import ROOT


def test_handler_ab_compares_two_versions_of_one_request():
    run = subprocess.run(
        [sys.executable, "bench/handler_ab.py", "--vs", "HEAD", "--blocks", "4", "--calls", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = run.stdout.splitlines()
    assert lines[0].startswith("/queue: HEAD ") and "this tree" in lines[0], run.stdout
    name, value = lines[-1].split("=")
    assert name == "ab_queue_ratio" and float(value) > 0, run.stdout
