"""The request-path benchmarks run (docs/benchmarks.md cites their figures): a short run
of bench/handler_ab.py, this tree against its own HEAD, prints both medians and a ratio
line; a small run of bench/claim_layers.py prints every layer of its table."""

from __future__ import annotations

import math
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


def test_claim_layers_prints_every_layer(server_url):
    """bench/claim_layers.py (docs/benchmarks.md, "Where a claim's time goes"), run small
    on the suite's server: a figure for every row of its table, and its database dropped."""
    small = ["--apps", "2000", "--claims", "20", "--python-calls", "20", "--profile-claims", "10"]
    run = subprocess.run(
        [sys.executable, "bench/claim_layers.py", *small, "--server-url", server_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    figures = dict(line.split("=") for line in run.stdout.splitlines() if line.startswith("layer_"))
    rows = (
        "claim powertools api_own cycle starlette_fastapi route claim_next_app session"
        " prepared_sql sql_over_floor python floor over_floor"
    ).split()
    for name in rows:
        assert not math.isnan(float(figures[f"layer_{name}_us"])), name
    assert run.stdout.splitlines()[-1] == "-- dropped bench_layers_2000", run.stdout[-500:]
