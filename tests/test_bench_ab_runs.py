"""Every bench/ script docs/benchmarks.md describes runs here, small, so none rots: a
short run of bench/handler_ab.py, this tree against its own HEAD, prints both medians and
a ratio line; a small run of bench/claims.py prints every figure of the results table,
and one of bench/web_view.py every page's;
bench/cold_start.py with one emulator prints Init's figures with their targets; and
bench/model_mutations.py finds one slip caught by its guarantee's own test."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from kit import ROOT

from helpers import connect


def figures(stdout: str) -> dict[str, str]:
    """The `name=value ...` lines of a bench script: {name: the rest of the line}."""
    return dict(re.findall(r"^(\w+)=(.*)$", stdout, re.MULTILINE))


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
    found = figures(run.stdout)
    for name in ("ab_queue_before_cpu_us", "ab_queue_after_cpu_us", "ab_queue_ratio"):
        assert float(found[name].split()[0]) > 0, run.stdout


def run_bench(script: str, args: list[str], database: str, server_url: str):
    """bench/<script> run small on the suite's server (300 s at most), its database
    dropped afterwards; its run, whatever its exit status."""
    try:
        return subprocess.run(
            [sys.executable, f"bench/{script}", *args, "--server-url", server_url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        admin = connect(server_url)
        try:
            admin.run(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        finally:
            admin.close()


def test_claims_prints_every_figure_with_its_target(server_url):
    """bench/claims.py (docs/benchmarks.md, "Results"), run small on the suite's server:
    every figure of its TARGETS printed as `name=value target...` or `... reported`,
    the oracle and double-claim checks passed; its database dropped afterwards."""
    small = (
        "--apps 2000 --no-baseline --rounds 2 --claims 20 --clients 2 --duration 0.5"
        " --windows 1 --import-runs 1 --first-read-runs 1 --http-claims 3 --bump-claims 10"
        " --mass-max-requests 20"
    ).split()
    run = run_bench("claims.py", small, "bench_2000", server_url)
    assert run.returncode == 0, run.stderr[-3000:]
    found = figures(run.stdout)
    names = (
        "claim_vs_floor claim_sql_vs_floor throughput16_vs_floor import_vs_libs reports_max_s"
        " app_status_max_ms first_public_read_extra_ms http_claim_ms bump_later_vs_floor"
        " mass_slowest_request_ms peak_rss_mb upgrade_total_s upgrade_longest_lock_s"
    ).split()
    for name in names:
        value, verdict = found[name].split(" ", 1)
        assert not math.isnan(float(value)), name
        assert verdict.startswith("target") or verdict == "reported", (name, verdict)
    assert "oracle, double claims, Seq Scans: all passed" in run.stdout, run.stdout[-3000:]


def test_web_view_prints_every_page_and_the_reports_extra_work(server_url):
    """bench/web_view.py (docs/benchmarks.md, "The web view"), run small on the suite's
    server: every page's JSON answered and timed beside its target, the report's extra
    work and the history's size printed; its database dropped afterwards."""
    run = run_bench("web_view.py", ["--apps", "2000", "--runs", "1"], "bench_web_2000", server_url)
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: a target missed, said
    found = figures(run.stdout)
    assert "report_extra_ms" in found, run.stderr[-3000:]
    pages = (
        "status_counted status_cached history_7d_counted history_24h_counted history_7d_cached"
        " apps_first apps_failed apps_prefix apps_contains app_story actions analysers openapi"
        " report_extra"
    ).split()
    for name in pages:
        value, verdict = found[f"{name}_ms"].split(" ", 1)
        assert float(value) >= 0 and verdict.startswith("target<="), (name, verdict)
    # 90 days of snapshots: the oldest hour pruned by the report's, which took its place.
    assert int(found["history_rows"]) == 24 * 90
    assert int(found["history_kb"]) > 0


def test_claim_counts_prints_ours_and_the_textbooks(server_url):
    """bench/claim_counts.py (docs/benchmarks.md, "The claim's database work in counts"),
    run small on the suite's server: every count for both queues, each ratio beside its
    target; its database dropped afterwards."""
    small = ["--apps", "2000", "--claims", "50"]
    run = run_bench("claim_counts.py", small, "bench_counts_2000", server_url)
    # 1: a target missed, said on its line (and a traceback is 1 too: its figures are
    # then missing, and its stderr is shown).
    assert run.returncode in (0, 1), run.stderr[-3000:]
    found = figures(run.stdout)
    assert "wal_bytes_vs_textbook" in found, run.stderr[-3000:]
    for queue in ("ours", "textbook"):
        counts = ("wal_bytes", "wal_records", "dirtied", "hit", "index_entries", "cpu_us")
        for count in (*counts, "statement_cpu_us"):
            assert float(found[f"{queue}_{count}"].split()[0]) >= 0, (queue, count)
    # Every claim, 4 indexes (tests/test_a_claim_writes_little.py names them).
    assert float(found["ours_index_entries"].split()[0]) == 4
    for ratio in ("wal_bytes_vs_textbook", "dirtied_vs_textbook", "cpu_vs_textbook"):
        assert found[ratio].split()[1].startswith("target<="), ratio
    # The floor of a claim's CPU: the same apps claimed by name, no queue head read.
    assert float(found["ours_named_statement_cpu_us"].split()[0]) >= 0
    for ratio in ("statement_cpu_vs_textbook", "named_statement_cpu_vs_textbook"):
        assert found[ratio].split()[1] == "reported", ratio
    # Where the WAL goes: page-image bytes per relation, the textbook's key among them.
    assert float(found["textbook_image_bytes_textbook_queue_pkey"].split()[0]) > 0


def test_cold_start_prints_init_at_the_templates_cpu_share():
    """One emulator per setting (the built package under Python 3.12, as the Lambda
    runtime): Init and the first secret-reading request, each with its target."""
    run = subprocess.run(
        [sys.executable, "bench/cold_start.py", "--emulator-runs", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    found = figures(run.stdout)
    for name in ("init_configured_share_ms", "first_secret_request_extra_ms"):
        value, verdict = found[name].split(" ", 1)
        assert float(value) > 0 and verdict.startswith("target<="), (name, run.stdout)


def test_model_mutations_finds_a_slip_caught_by_its_guarantees_test(server_url):
    """The body limit checked per chunk instead of in total: tests/test_api.py fails."""
    run = subprocess.run(
        [sys.executable, "bench/model_mutations.py", "per chunk"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": server_url},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (line,) = [line for line in run.stdout.splitlines() if "per chunk" in line]
    assert line.startswith("caught "), run.stdout
