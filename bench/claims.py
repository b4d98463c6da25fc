"""Benchmark of the index-head claim at 10k, 100k and 1M apps.

    python bench/claims.py --apps 1000000 [--database-url URL] [--seed 1]
    python bench/claims.py --apps 10000 --apps 100000 --apps 1000000

For each size it builds a production-like database at ledger state 006 (legacy JSON
states, random popularity, ages and versions: bench/claims_data.py), upgrades it through
the real ledger runner while probes play the previous release (claims_upgrade.py), and
then measures, on that database:

* GET /queue through handler.api (the Mangum entry, API Gateway v2 event) in a separate
  API process: median and p99, and the first claim checked against the oracle;
* the bare SQL floor (claims_workers.FLOOR_CLAIM over a bare pg8000 connection);
* where one claim's time goes, layer by layer (Powertools, handler.api's own, Mangum's
  HTTPCycle stepped by hand, Starlette/FastAPI, the route, claim_next_app, handler's
  Session, the SQL, the floor), in the API process, and cProfile's top entries
  (bench/claim_layers.py measures, and runs alone too);
* throughput with 1, 4 and 16 concurrent claimers for both (one process and one
  connection each, like Lambda containers), with a check for double claims, and for the
  service's claim statement alone (handler.claim_next_app, no HTTP stack), which tells
  the SQL's share of a gap from the request's Python;
* the queue-status and priority reports;
* GET /apps/{appId} through handler.api, and the first public one over HTTP in new
  `handler.py serve` processes less a warm one (first_public_read_extra_ms);
* a version bump (CURRENT_ANALYSIS_VERSION + 1): first claim against the oracle, later
  claims, and the claim plan;
and once per run: `import handler` against its unavoidable libraries, and boto3.

Between phases the claimed rows are put back as they were and apps is vacuumed, so that
every phase starts from the same data. Throughput clients each make one claim before the
window opens (a container's first claim runs the promoter; its time is printed apart).
The targets are evaluated at the largest --apps; growth needs a 10k run, so when 10000
is not among --apps a 10k database is built as well (bench_10000), unless --no-baseline.
handler.py and sql/ are copied when the run starts and every process uses the copy.
The databases stay at the head of the ledger, usable by the service. The run ends with
each figure of TARGETS beside its target (PASS, MISS, or reported), then the same
figures as `name=value` lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import http.client
import math
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import claim_layers
import claims_data
import claims_db
import claims_upgrade
import claims_workers
import pg8000.native

ROOT = Path(__file__).resolve().parent.parent
# handler.py and sql/ as they were when the run started (main() copies them there), so
# that every process of a run measures the same code even if the tree changes meanwhile.
CODE = ROOT
CONCURRENCY = (1, 4, 16)
BASELINE_APPS = 10_000
# A claim token for plans only (EXPLAIN runs nothing; the column is uuid).
EXPLAIN_TOKEN = str(uuid.UUID(int=0))

TARGETS = {
    "claim_vs_floor": ("<=", 1.25),
    "growth_10k_to_1m": ("<=", 1.5),
    "throughput4_vs_floor": (">=", 0.8),
    "throughput16_vs_floor": (">=", 0.8),
    "reports_max_s": ("<=", 5.0),
    "import_vs_libs": ("<=", 1.15),
    "first_public_read_extra_ms": ("<=", 5.0),
    "peak_rss_mb": ("<", 150.0),
    "upgrade_total_s": (None, None),
    "upgrade_longest_lock_s": (None, None),
    "app_status_max_ms": ("<=", 5.0),
    "mass_slowest_request_ms": ("<=", 1000.0),
}


def say(text: str = "") -> None:
    print(text, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclasses.dataclass
class Throughput:
    claims: int
    first_claims: float  # the slowest of the clients' first (warm-up) claims
    seconds: float
    per_second: float
    median_latency: float
    duplicates: int
    verified: bool
    ran_dry: bool


@dataclasses.dataclass
class SizeResult:
    apps: int
    service_median: float = math.nan
    service_p99: float = math.nan
    floor_median: float = math.nan
    floor_p99: float = math.nan
    service_throughput: dict[int, Throughput] = dataclasses.field(default_factory=dict)
    floor_throughput: dict[int, Throughput] = dataclasses.field(default_factory=dict)
    # The service's claim statement alone (claims_workers.claim_sql_worker): no HTTP stack.
    claim_sql_throughput: dict[int, Throughput] = dataclasses.field(default_factory=dict)
    reports: dict[str, float] = dataclasses.field(default_factory=dict)
    upgrade: claims_upgrade.UpgradeResult | None = None
    peak_rss_mb: float = 0.0
    oracle_failures: list[str] = dataclasses.field(default_factory=list)
    bump_ok: bool | None = None
    bump_later_median: float = math.nan
    seq_scans: list[str] = dataclasses.field(default_factory=list)
    boto3: dict[str, bool] = dataclasses.field(default_factory=dict)
    layers: dict[str, float] = dataclasses.field(default_factory=dict)
    first_reads: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    claim_plan_ms: tuple[float, float] = (math.nan, math.nan)
    promote_ms: float = math.nan
    first_after_upgrade: float = math.nan
    floor_plan_ms: tuple[float, float] = (math.nan, math.nan)
    app_status_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    mass: dict[str, float] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# The database under test
# ---------------------------------------------------------------------------------------


class Bench:
    """One size: its database, a bare connection for arranging and checking, the
    service's handler module (for the upgrade runner, the oracle's rule and reports)."""

    def __init__(self, handler, url: str, args: argparse.Namespace):
        self.handler = handler
        self.url = url
        self.args = args
        self.sql = claims_db.connect(url, "bench-orchestrator")
        self.sql.run("SET statement_timeout = '10min'")

    def configure_service(self, **extra: str) -> None:
        os.environ["DATABASE_URL"] = self.url
        os.environ["UPLOAD_PASSWORD"] = claims_workers.UPLOAD_PASSWORD
        for name in (
            "CURRENT_ANALYSIS_VERSION",
            "STALE_ANALYSIS_DAYS",
            "PROCESSING_TIMEOUT_MINUTES",
        ):
            os.environ.pop(name, None)
        os.environ.update(extra)
        self.handler.use_runtime(None)

    @property
    def policy(self):
        return self.handler.settings().policy

    def oracle(self, policy) -> tuple[str | None, int]:
        """The first candidate in claim order by the queue's rule (docs/queue.md),
        evaluated plainly (a scan), and how many candidates there are."""
        rows = self.sql.run(
            f"SELECT appid, count(*) OVER () FROM apps WHERE {self.handler.CANDIDATE}"
            f" ORDER BY {self.handler.CLAIM_ORDER} LIMIT 1",
            **policy.sql_params(),
        )
        return (rows[0][0], rows[0][1]) if rows else (None, 0)

    def describe(self, appid: str) -> str:
        rows = self.sql.run(
            "SELECT status, app_popularity(details), added, analysisversion, analysed, due"
            " FROM apps WHERE appid = :a",
            a=appid,
        )
        return f"{appid} {rows[0] if rows else '(gone)'}"

    def check_oracle(self, label: str, expected: str | None, got: str, result: SizeResult):
        if expected == got or (expected is None and not got):
            say(f"   {label}: {got or '(empty)'} = oracle: OK")
            return
        message = f"{label}: got {self.describe(got)}, oracle {self.describe(expected or '')}"
        result.oracle_failures.append(message)
        say(f"   {label}: MISMATCH {message}")

    # --- snapshot and restore -----------------------------------------------------------

    def snapshot(self) -> None:
        self.sql.run("DROP TABLE IF EXISTS bench_snapshot")
        self.sql.run(
            "CREATE TABLE bench_snapshot AS"
            " SELECT appid, status, processing_started, due, analysis_claim_token FROM apps"
        )
        self.sql.run("ALTER TABLE bench_snapshot ADD PRIMARY KEY (appid)")

    def restore(self, appids: list[str]) -> float:
        """Put claimed rows back as the snapshot has them; vacuum so that the next phase
        starts without the dead index entries this phase left at the heads."""
        started = time.perf_counter()
        if appids:
            self.sql.run(
                """UPDATE apps a SET status = s.status,
                       processing_started = s.processing_started,
                       due = s.due, analysis_claim_token = s.analysis_claim_token
                   FROM bench_snapshot s
                   WHERE a.appid = s.appid AND a.appid = ANY(CAST(:ids AS text[]))""",
                ids=appids,
            )
        self.sql.run("VACUUM (INDEX_CLEANUP ON) apps")
        return time.perf_counter() - started

    def restore_all(self) -> None:
        """Put back every row whose claim state differs from the snapshot (if any)."""
        if self.sql.run("SELECT to_regclass('bench_snapshot') IS NOT NULL")[0][0]:
            self.sql.run(
                """UPDATE apps a SET status = s.status,
                       processing_started = s.processing_started,
                       due = s.due, analysis_claim_token = s.analysis_claim_token
                   FROM bench_snapshot s
                   WHERE a.appid = s.appid
                     AND (a.status, a.processing_started, a.analysis_claim_token)
                         IS DISTINCT FROM
                         (s.status, s.processing_started, s.analysis_claim_token)"""
            )

    def drop_snapshot(self) -> None:
        self.sql.run("DROP TABLE IF EXISTS bench_snapshot")

    def queued_count(self) -> int:
        return self.sql.run("SELECT count(*) FROM apps WHERE status = 'queued'")[0][0]

    # --- EXPLAIN -----------------------------------------------------------------------

    def promoter_statement(self, statement: str) -> bool:
        """Whether the promoter runs this statement: in its batch's transaction, after
        handler.PLAN_WITH_VALUES (planned with the cutoffs' values)."""
        return statement in (
            self.handler.PROMOTE_EXPIRED_LEASES,
            self.handler.PROMOTE_STALE_BATCH,
            self.handler.CLEAR_STALE_DUE_FLAGS,
        )

    def explain(
        self, statement: str, analyze: bool = True, service: bool = True, **params
    ) -> list[str]:
        """The plan of a statement as the service runs it, executed with ANALYZE inside a
        rolled-back transaction. The service prepares its statements on its API
        connection, which plans them generically (handler.Runtime sets plan_cache_mode;
        tests/test_claims_scale_without_scans.py checks it), except the promoter's,
        planned with their values. service=False: as a bare connection runs it."""
        options = "(ANALYZE, BUFFERS) " if analyze else ""
        self.sql.run("BEGIN")
        try:
            if not service:
                return [r[0] for r in self.sql.run(f"EXPLAIN {options}{statement}", **params)]
            text, make_values = pg8000.native.to_statement(statement)
            values = ", ".join(pg8000.native.literal(v) for v in make_values(params))
            self.sql.run(
                self.handler.PLAN_WITH_VALUES
                if self.promoter_statement(statement)
                else "SET LOCAL plan_cache_mode = force_generic_plan"
            )
            self.sql.run(f"PREPARE bench_plan AS {text}")
            execute = f"EXECUTE bench_plan({values})" if values else "EXECUTE bench_plan"
            return [r[0] for r in self.sql.run(f"EXPLAIN {options}{execute}")]
        finally:
            self.sql.run("ROLLBACK")
            self.sql.run("DEALLOCATE ALL")

    def print_explain(
        self, title: str, statement: str, lines: list[str], result: SizeResult, service=True
    ) -> None:
        if not service:
            kind = ""
        elif self.promoter_statement(statement):
            kind = " (planned with its values, as the promoter runs it)"
        else:
            kind = " (generic plan, as the API connection runs it)"
        say(f"   EXPLAIN (ANALYZE, BUFFERS) {title}{kind}:")
        for line in lines:
            say("      " + line)
        scans = [line.strip() for line in lines if "Seq Scan on apps" in line]
        if scans:
            result.seq_scans.append(f"{title}: {scans[0]}")
            say(f"   !! {title}: the plan scans apps sequentially")


# ---------------------------------------------------------------------------------------
# Processes: the API process (latency), and the claimers (throughput)
# ---------------------------------------------------------------------------------------

SPAWN = multiprocessing.get_context("spawn")
REPORT_STATEMENT_TIMEOUT_MS = 45_000  # template.yaml's ReportFunction (tests/test_template.py)


class ApiProcess:
    """A separate interpreter importing handler and answering /queue through handler.api,
    driven over a pipe (claims_workers.api_process)."""

    def __init__(self, url: str):
        self.pipe, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=claims_workers.api_process, args=(child, url))
        self.process.start()

    def call(self, command: str, argument=None, timeout: float = 600):
        self.pipe.send((command, argument))
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"the API process did not answer {command} in {timeout} s")
        return self.pipe.recv()

    def claims(self, count: int) -> list[tuple[str, str | None, float]]:
        return self.call("claims", count)

    def close(self) -> dict:
        stats = self.call("stats")
        self.call("exit")
        self.process.join(30)
        return stats

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)


def run_claimers(target, url: str, clients: int, duration: float, quota: int) -> list[dict]:
    barrier = SPAWN.Barrier(clients + 1)
    results = SPAWN.Queue()
    per_client = max(1, quota // clients)
    processes = [
        SPAWN.Process(target=target, args=(url, barrier, results, duration, per_client))
        for _ in range(clients)
    ]
    for process in processes:
        process.start()
    try:
        barrier.wait(timeout=180)
        outcomes = [results.get(timeout=duration + 120) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.terminate()
                process.join(10)
    return outcomes


def throughput(bench: Bench, kind: str, clients: int, duration: float, quota: int):
    target = {
        "service": claims_workers.service_worker,
        "claim SQL": claims_workers.claim_sql_worker,
        "floor": claims_workers.floor_worker,
    }[kind]
    outcomes = run_claimers(target, bench.url, clients, duration, quota)
    warmups = [outcome["warmup"] for outcome in outcomes]
    claimed = [pair for outcome in outcomes for pair in outcome["claimed"]]
    claimed += [(appid, token) for appid, token, _ in warmups if appid]
    appids = [appid for appid, _ in claimed]
    duplicates = sum(n - 1 for n in Counter(appids).values() if n > 1)
    if kind != "floor":
        (verified,) = bench.sql.run(
            """SELECT count(*) FROM unnest(CAST(:ids AS text[]), CAST(:tokens AS text[]))
                   AS c(appid, token)
               JOIN apps a USING (appid)
               WHERE a.status = 'processing'
                 AND CAST(a.analysis_claim_token AS text) = c.token""",
            ids=appids,
            tokens=[token for _, token in claimed],
        )[0]
    else:
        (verified,) = bench.sql.run(
            "SELECT count(*) FROM apps WHERE appid = ANY(CAST(:ids AS text[]))"
            " AND status = 'processing'",
            ids=appids,
        )[0]
    seconds = max(outcome["elapsed"] for outcome in outcomes)
    window_claims = sum(len(outcome["claimed"]) for outcome in outcomes)
    latencies = [t for outcome in outcomes for t in outcome["latencies"]]
    result = Throughput(
        claims=window_claims,
        first_claims=max(seconds for _, _, seconds in warmups),
        seconds=seconds,
        per_second=window_claims / seconds if seconds else 0.0,
        median_latency=statistics.median(latencies) if latencies else math.nan,
        duplicates=duplicates,
        verified=verified == len(set(appids)),
        ran_dry=any(outcome["empty"] for outcome in outcomes),
    )
    rss = max(outcome["peak_rss_mb"] for outcome in outcomes)
    return result, appids, rss


# ---------------------------------------------------------------------------------------
# One size
# ---------------------------------------------------------------------------------------


def build_and_upgrade(bench: Bench, n: int, result: SizeResult) -> None:
    say(f"-- build: {n:,} apps at ledger state 006 (legacy JSON states), seed {bench.args.seed}")
    started = time.perf_counter()
    steps = claims_data.build_legacy_database(
        bench.sql, CODE / "sql", n, bench.args.seed, bench.args.payload_bytes
    )
    build_s = time.perf_counter() - started
    for name, seconds in steps:
        say(f"   {name:<42}{seconds:8.2f} s")
    mix = claims_data.legacy_mix(bench.sql)
    say(
        f"   build total {build_s:.1f} s; states " + ", ".join(f"{k} {v:,}" for k, v in mix.items())
    )
    sizes = bench.sql.run(
        "SELECT pg_size_pretty(pg_total_relation_size('apps')),"
        " pg_size_pretty(pg_total_relation_size('app_analyses')),"
        " (SELECT count(*) FROM app_analyses)"
    )[0]
    say(f"   apps {sizes[0]}, app_analyses {sizes[1]} ({sizes[2]:,} history rows)")

    read_appid, write_appid = bench.sql.run(
        "SELECT (SELECT appid FROM apps WHERE analysis IS NOT NULL AND appid = lower(appid)"
        "        ORDER BY appid LIMIT 1),"
        "       (SELECT appid FROM apps WHERE analysis IS NULL AND appid = lower(appid)"
        "        ORDER BY appid LIMIT 1)"
    )[0]
    say("-- upgrade 006 -> head as a deploy runs it, while the previous release reads,")
    say("   updates and inserts apps")
    bench.configure_service()
    upgrade = claims_upgrade.measure_upgrade(
        bench.handler, bench.url, CODE / "sql", read_appid, write_appid
    )
    result.upgrade = upgrade
    say(f"   entry point: {upgrade.entry}; applied {', '.join(upgrade.applied) or 'nothing'}")
    say(
        f"   {'file':<34}{'seconds':>9}  {'strongest lock':<22}{'reads blocked':>14}"
        f"{'writes blocked':>16}"
    )
    for f in upgrade.files:
        say(
            f"   {f.name:<34}{f.seconds:9.2f}  {f.strongest_lock:<22}"
            f"{f.reads_blocked_s:13.2f}s{f.writes_blocked_s:15.2f}s"
        )
    say(f"   {'after the last file':<34}{upgrade.after_files_s:9.2f}")
    say(
        f"   upgrade total {upgrade.total_s:.1f} s; the previous release's reads were blocked"
        f" {upgrade.reads_blocked_total_s:.2f} s in all (longest stall"
        f" {upgrade.reads_blocked_s:.2f} s), its writes {upgrade.writes_blocked_total_s:.2f} s"
        f" in all (longest {upgrade.writes_blocked_s:.2f} s)"
    )
    held = max((f.ae_held_s for f in upgrade.files), default=0.0)
    held_w = max((f.write_blocking_held_s for f in upgrade.files), default=0.0)
    say(
        f"   (pg_locks: ACCESS EXCLUSIVE on apps held at most {held:.2f} s in one stretch;"
        f" a write-blocking mode at most {held_w:.2f} s)"
    )
    # The migration function's Timeout (template.yaml) less what migrate keeps back.
    deadline = claims_upgrade.MIGRATION_TIMEOUT_SECONDS - bench.handler.CFN_REPLY_MARGIN_SECONDS
    if upgrade.total_s > deadline:
        say(f"   !! longer than the migration function's {deadline} s for the ledger")
    for error in upgrade.probe_errors:
        say(f"   probe error (last): {error}")


def run_size(handler, url: str, n: int, args: argparse.Namespace, reuse: bool) -> SizeResult:
    result = SizeResult(apps=n)
    bench = Bench(handler, url, args)
    say()
    say(f"== {n:,} apps: {url} (load average {_load()})")
    if not reuse:
        build_and_upgrade(bench, n, result)
    bench.configure_service()
    policy = bench.policy
    api = ApiProcess(url)
    pre_first: list = []
    try:
        # --- first claim after the upgrade (first promotion, policy recorded) ---------
        expected, candidates = bench.oracle(policy)
        pre_first = bench.sql.run(
            "SELECT appid, status, processing_started, due, analysis_claim_token FROM apps"
            " WHERE appid = :a",
            a=expected or "",
        )
        say(f"-- first /queue after the {'upgrade' if not reuse else 'start'}")
        ((appid, _, seconds),) = api.claims(1)
        result.first_after_upgrade = seconds
        (due,) = bench.sql.run("SELECT count(*) FROM apps WHERE due")[0]
        say(
            f"   {ms(seconds)} (new API process: connect, record the policy, promote;"
            f" {due:,} rows flagged due, most by the migration step; {candidates:,} candidates)"
        )
        bench.check_oracle("first claim", expected, appid, result)
        promote = bench.explain(
            handler.PROMOTE_STALE_BATCH,
            horizon_seconds=handler.PROMOTION_HORIZON_SECONDS,
            batch=handler.PROMOTION_BATCH,
            **policy.sql_params(),
        )
        say(
            f"   the next promotion, before any VACUUM (dead entries of the {due:,} flagged rows"
            f" still in apps_stale_version_watch): {_plan_time(promote, 'Execution Time')} ms,"
            f" heap blocks visited: {_heap_blocks(promote)}"
        )
        seq_before = _seq_scan_check(bench, policy)
        say(
            "   claim and promotion plans before ANALYZE: "
            + ("; ".join(seq_before) if seq_before else "no Seq Scan on apps")
        )
        started = time.perf_counter()
        bench.sql.run("ANALYZE apps")
        say(
            f"   ANALYZE apps: {time.perf_counter() - started:.2f} s (autovacuum analyses after"
            f" the upgrade's mass update; this server has autovacuum={args.autovacuum})"
        )
        bench.snapshot()
        bench.restore([])  # vacuum: the phases start from the same clean state

        # --- plans ---------------------------------------------------------------------
        claim_plan = bench.explain(
            handler.CLAIM_NEXT_APP, token=EXPLAIN_TOKEN, analyser=None, **policy.sql_params()
        )
        result.claim_plan_ms = (
            _plan_time(claim_plan, "Planning Time"),
            _plan_time(claim_plan, "Execution Time"),
        )
        bench.print_explain(
            "CLAIM_NEXT_APP (service claim)", handler.CLAIM_NEXT_APP, claim_plan, result
        )
        promote = bench.explain(
            handler.PROMOTE_STALE_BATCH,
            horizon_seconds=handler.PROMOTION_HORIZON_SECONDS,
            batch=handler.PROMOTION_BATCH,
            **policy.sql_params(),
        )
        bench.print_explain(
            "PROMOTE_STALE_BATCH (every 15 s per process)",
            handler.PROMOTE_STALE_BATCH,
            promote,
            result,
        )
        result.promote_ms = _plan_time(promote, "Execution Time")
        say(
            f"   the promotion runs every {handler.PROMOTE_EVERY_SECONDS} s in each container:"
            f" with 16 containers, {result.promote_ms * 16 / handler.PROMOTE_EVERY_SECONDS:.1f}"
            " ms of database time per second"
        )
        floor_plan = bench.explain(claims_workers.FLOOR_CLAIM, service=False)
        result.floor_plan_ms = (
            _plan_time(floor_plan, "Planning Time"),
            _plan_time(floor_plan, "Execution Time"),
        )
        bench.print_explain(
            "floor claim (bare connection)",
            claims_workers.FLOOR_CLAIM,
            floor_plan,
            result,
            service=False,
        )

        # --- latency: service, then floor, on the same data ---------------------------
        count = min(args.claims, max(50, bench.queued_count() // 4))
        say(
            f"-- latency, one client: {args.repeats} rounds of {count} service claims"
            " (handler.api, Mangum v2) then the same data's floor (bare pg8000)"
        )
        service_lat: list[float] = []
        floor_lat: list[float] = []
        floor = claims_db.connect(url, "bench-floor")
        floor.run(claims_workers.FLOOR_CLAIM)  # warm the connection's caches
        bench.restore(_all_floor_claims(bench))
        for round_number in range(1, args.repeats + 1):
            expected, _ = bench.oracle(policy)
            claims = api.claims(count)
            bench.check_oracle(f"round {round_number}, first claim", expected, claims[0][0], result)
            appids = [a for a, _, _ in claims if a]
            _check_unique(appids, f"round {round_number}", result)
            series = [t for _, _, t in claims]
            bench.restore(appids)
            floor_series = []
            for _ in range(count):
                t = time.perf_counter()
                floor.run(claims_workers.FLOOR_CLAIM)
                floor_series.append(time.perf_counter() - t)
            bench.restore(_all_floor_claims(bench))
            say(
                f"   round {round_number}: service median {ms(statistics.median(series))},"
                f" floor median {ms(statistics.median(floor_series))}"
            )
            service_lat += series
            floor_lat += floor_series
        floor.close()
        result.service_median = statistics.median(service_lat)
        result.service_p99 = percentile(service_lat, 0.99)
        result.floor_median = statistics.median(floor_lat)
        result.floor_p99 = percentile(floor_lat, 0.99)
        say(
            f"   service GET /queue: median {ms(result.service_median)}, p99"
            f" {ms(result.service_p99)}, max {ms(max(service_lat))}"
        )
        say(
            f"   floor (bare pg8000):  median {ms(result.floor_median)}, p99"
            f" {ms(result.floor_p99)}, max {ms(max(floor_lat))}"
        )
        say(f"   service / floor (median): {result.service_median / result.floor_median:.2f}")

        # --- where the service's time goes (bench/claim_layers.py) -----------------------
        claim_layers_phase(bench, api, result, args)
        say(
            f"   server side (EXPLAIN ANALYZE above): planning {result.claim_plan_ms[0]:.3f} ms,"
            f" execution {result.claim_plan_ms[1]:.3f} ms; floor: planning"
            f" {result.floor_plan_ms[0]:.3f} ms, execution {result.floor_plan_ms[1]:.3f} ms"
        )
        bench.restore_all()
        bench.restore([])

        # --- throughput ----------------------------------------------------------------
        quota = max(CONCURRENCY[-1], min(args.max_claims, bench.queued_count() // 2))
        say(
            f"-- throughput: {args.duration:g} s windows, at most {quota:,} claims per window"
            " (one process and connection per client, each warmed by one claim first;"
            " claimed rows restored after each)"
        )
        for clients in CONCURRENCY:
            for kind in ("service", "claim SQL", "floor"):
                measured, appids, rss = throughput(bench, kind, clients, args.duration, quota)
                if kind == "service":
                    result.service_throughput[clients] = measured
                    result.peak_rss_mb = max(result.peak_rss_mb, rss)
                elif kind == "claim SQL":
                    result.claim_sql_throughput[clients] = measured
                else:
                    result.floor_throughput[clients] = measured
                say(
                    f"   {kind:<9}{clients:>3} clients: {measured.per_second:9.0f} claims/s"
                    f" ({measured.claims:,} in {measured.seconds:.2f} s, median latency"
                    f" {ms(measured.median_latency)}; first claims up to"
                    f" {ms(measured.first_claims)}), double claims: {measured.duplicates},"
                    f" rows verified: {'yes' if measured.verified else 'NO'}"
                    + (" [queue ran dry]" if measured.ran_dry else "")
                )
                if measured.duplicates or not measured.verified:
                    result.oracle_failures.append(f"{kind} x{clients}: double or lost claims")
                bench.restore(appids if kind != "floor" else _all_floor_claims(bench))
            floor_rate = result.floor_throughput[clients].per_second
            say(
                f"   service / floor at {clients} clients:"
                f" {result.service_throughput[clients].per_second / floor_rate:.2f}"
                f" (the claim's SQL alone / floor:"
                f" {result.claim_sql_throughput[clients].per_second / floor_rate:.2f})"
            )

        # --- reports -----------------------------------------------------------------------
        say("-- reports (handler.queue_status and handler.priority_report, 3 runs each)")
        # On the report function's statement timeout (template.yaml's ReportFunction), not
        # the API's 5 s: a first count of a table evicted from the page cache can take
        # longer, and is measured against reports_max_s rather than failing the run.
        config = handler.settings()
        db = handler.SharedConnection(
            lambda: handler.connection_arguments(config), REPORT_STATEMENT_TIMEOUT_MS
        )
        for name, work in (
            ("queue-status", lambda: handler.queue_status(db, policy)),
            ("priority-report", lambda: handler.priority_report(db, policy, 50)),
        ):
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                work()
                runs.append(time.perf_counter() - t)
            result.reports[name] = max(runs)
            say(f"   {name:<16} " + ", ".join(f"{r:.3f} s" for r in runs))
        db.discard()

        # --- GET /apps/{appId}: public, so it must cost about a claim at any size ------------
        app_status_phase(bench, api, result)
        first_public_read_phase(bench, result, args)

        # --- version bump -----------------------------------------------------------------
        bumped = policy.analysis_version + 1
        say(f"-- version bump: the service restarted with CURRENT_ANALYSIS_VERSION={bumped}")
        bump_env = {"CURRENT_ANALYSIS_VERSION": str(bumped)}
        api.call("configure", bump_env)
        bench.configure_service(**bump_env)
        bump_policy = bench.policy
        expected, candidates = bench.oracle(bump_policy)
        ((appid, _, seconds),) = api.claims(1)
        say(
            f"   first claim: {ms(seconds)} ({candidates:,} candidates; includes the policy"
            " change's flag clearing and a promotion)"
        )
        before = len(result.oracle_failures)
        bench.check_oracle("first claim after the bump", expected, appid, result)
        later = api.claims(args.bump_claims)
        bump_ids = [appid] + [a for a, _, _ in later if a]
        result.bump_later_median = statistics.median(t for _, _, t in later)
        say(
            f"   next {len(later)} claims: median {ms(result.bump_later_median)}"
            f" ({result.bump_later_median / result.floor_median:.2f}x the floor's median,"
            f" {result.bump_later_median / result.service_median:.2f}x the service's before"
            f" the bump), p99 {ms(percentile([t for _, _, t in later], 0.99))}"
        )
        scans_before = len(result.seq_scans)
        bench.print_explain(
            f"CLAIM_NEXT_APP at version {bumped}",
            handler.CLAIM_NEXT_APP,
            bench.explain(
                handler.CLAIM_NEXT_APP,
                token=EXPLAIN_TOKEN,
                analyser=None,
                **bump_policy.sql_params(),
            ),
            result,
        )
        for scan in _seq_scan_check(bench, bump_policy):
            result.seq_scans.append(f"at version {bumped}: {scan}")
            say(f"   !! at version {bumped}: {scan}")
        clear = _explain_plain(
            bench,
            handler.CLEAR_STALE_DUE_FLAGS,
            {**bump_policy.sql_params(), "batch": handler.PROMOTION_BATCH, "after": ""},
        )
        say(
            "   CLEAR_STALE_DUE_FLAGS (once per policy change, in its first claim): "
            + ("; ".join(clear) if clear else "no Seq Scan on apps")
        )
        result.bump_ok = (
            len(result.oracle_failures) == before
            and len(result.seq_scans) == scans_before
            and result.bump_later_median <= 2 * result.floor_median
        )
        _check_unique(bump_ids, "version bump", result)

        # --- a mass promotion: STALE_ANALYSIS_DAYS lowered over most analyses -------------
        api.call("configure", {})
        bench.configure_service()
        bench.restore_all()
        bench.restore([])
        mass_promotion_phase(bench, api, result, args)

        # --- leave the database as the service would have it -------------------------------
        api.call("configure", {})
        bench.configure_service()
        result.boto3 = {}
        stats = api.close()
        result.peak_rss_mb = max(result.peak_rss_mb, stats["peak_rss_mb"])
        result.boto3["after /queue"] = stats["boto3_loaded"]
        say(
            f"-- API process: peak RSS {stats['peak_rss_mb']:.1f} MB (throughput claimers:"
            f" up to {result.peak_rss_mb:.1f} MB), import handler {stats['import_handler_s']:.3f}"
            f" s in-process, boto3 loaded after /queue: {result.boto3['after /queue']}"
        )
    finally:
        api.kill()
        bench.configure_service()
        bench.restore_all()
        if pre_first:
            bench.sql.run(
                """UPDATE apps SET status = :s, processing_started = :p, due = :d,
                       analysis_claim_token = :t WHERE appid = :a""",
                a=pre_first[0][0],
                s=pre_first[0][1],
                p=pre_first[0][2],
                d=pre_first[0][3],
                t=pre_first[0][4],
            )
        bench.drop_snapshot()
        handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
        bench.sql.run("VACUUM ANALYZE apps")
        handler.use_runtime(None)
        bench.sql.close()
    return result


def _load() -> str:
    """The machine's load average: other processes' CPU use skews latencies."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _plan_time(lines: list[str], label: str) -> float:
    for line in lines:
        if line.strip().startswith(label + ":"):
            return float(line.split(":")[1].split()[0])
    return math.nan


def _heap_blocks(lines: list[str]) -> int:
    return sum(
        int(part.split("=")[1])
        for line in lines
        if "Heap Blocks:" in line
        for part in line.split()
        if "=" in part
    )


def _all_floor_claims(bench: Bench) -> list[str]:
    """Rows claimed since the snapshot (restoring a row the service claimed too is
    harmless: it goes back to the snapshot either way)."""
    return [
        appid
        for (appid,) in bench.sql.run(
            """SELECT a.appid FROM apps a JOIN bench_snapshot s USING (appid)
               WHERE a.status = 'processing' AND s.status <> 'processing'"""
        )
    ]


def _check_unique(appids: list[str], label: str, result: SizeResult) -> None:
    duplicates = [a for a, n in Counter(appids).items() if n > 1]
    if duplicates:
        result.oracle_failures.append(f"{label}: handed out twice: {duplicates[:5]}")
        say(f"   !! {label}: apps handed out twice: {duplicates[:5]}")


APP_STATUS_KINDS = {
    "queued-top": "SELECT appid FROM apps WHERE status = 'queued' ORDER BY {order} LIMIT 1",
    "queued-deep": ("SELECT appid FROM apps WHERE status = 'queued' ORDER BY {order_desc} LIMIT 1"),
    "analysed": "SELECT appid FROM apps WHERE status = 'analysed' LIMIT 1",
    "failed": "SELECT appid FROM apps WHERE status = 'failed' LIMIT 1",
}


def app_status_phase(bench: Bench, api: ApiProcess, result: SizeResult) -> None:
    """GET /apps/{appId} through handler.api for an app at the head of the queue, one at
    its end (the queue position counts the most there), an analysed and a failed one:
    the median of 50 requests each; app_status_max_ms is the slowest of the four."""
    handler = bench.handler
    order = handler.CLAIM_ORDER
    order_desc = "app_popularity(details), added DESC, appid DESC"
    paths = {}
    for kind, query in APP_STATUS_KINDS.items():
        rows = bench.sql.run(query.format(order=order, order_desc=order_desc))
        if rows:
            paths[kind] = f"/apps/{rows[0][0]}"
    timings = api.call("gets", [(path, 50) for path in paths.values()])
    say("-- GET /apps/{appId} (handler.api, 50 requests each; median, max)")
    for kind, path in paths.items():
        series = timings[path]
        result.app_status_ms[kind] = statistics.median(series) * 1000
        say(f"   {kind:<12} {path:<40} {ms(statistics.median(series))}, {ms(max(series))}")
    deep = paths.get("queued-deep")
    if deep:
        ((popularity, added),) = bench.sql.run(
            "SELECT app_popularity(details), added FROM apps WHERE appid = :a", a=deep[6:]
        )
        plan = bench.explain(
            handler.QUEUE_POSITION,
            popularity=popularity,
            added=added,
            appid=deep[6:],
            limit=handler.QUEUE_POSITION_BOUND + 1,
            **bench.policy.sql_params(),
        )
        bench.print_explain("QUEUE_POSITION (queued-deep)", handler.QUEUE_POSITION, plan, result)


def claim_layers_phase(
    bench: Bench, api: ApiProcess, result: SizeResult, args: argparse.Namespace
) -> None:
    """Where one claim's time goes, layer by layer, in the API process (the measurement
    and the table are bench/claim_layers.py's): its Python with the database answering at
    once, then real claims in rounds, the rows put back and apps vacuumed between them,
    then cProfile over real claims."""
    queued = bench.queued_count()
    per_round = max(10, min(claim_layers.ROUND_CLAIMS, queued // (2 * len(claim_layers.DATABASE))))
    say(
        "-- where a service claim's time goes (bench/claim_layers.py): the Python"
        f" without the database, {args.layer_calls} calls per layer; then"
        f" {args.layer_claims} real claims per layer in rounds of {per_round} (load average"
        f" {_load()})"
    )
    samples, routes_before = api.call("layers_python", args.layer_calls)
    left = args.layer_claims
    while left > 0:
        got, dry = api.call("layers_claims", min(per_round, left))
        claim_layers.merge(samples, got)
        bench.restore(_all_floor_claims(bench))
        left -= per_round
        if dry:
            say("   !! the queue ran dry during a round")
            break
    for line in claim_layers.table(samples, routes_before):
        say(line)
    result.layers = claim_layers.figures(samples)
    if args.profile_claims:
        lines = api.call("layers_profile", min(args.profile_claims, max(1, queued // 4)))
        bench.restore(_all_floor_claims(bench))
        say("   " + lines[0])
        for line in lines[1:]:
            say(line)
    api.call("layers_close")


FIRST_READ_WARM = 10


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _http_get(port: int, path: str) -> float:
    """Seconds of one GET on a new connection, to the end of the body."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
    finally:
        connection.close()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"GET {path} answered {response.status}")
    return elapsed


def serve_first_read(url: str, path: str, warm: int = FIRST_READ_WARM) -> tuple[float, float]:
    """(the first GET of `path`, the median of `warm` GETs after it) in seconds, against
    a new `python3 handler.py serve` process on a free loopback port, started with
    DATABASE_URL set and sent nothing before that first request; each GET on a new
    connection. The process is ended (SIGTERM) afterwards."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "ADMIN_TOKEN") and not k.startswith(("CURRENT_", "STALE_"))
    }
    env.update(
        DATABASE_URL=url,
        UPLOAD_PASSWORD=claims_workers.UPLOAD_PASSWORD,
        POWERTOOLS_LOG_LEVEL=os.environ.get("POWERTOOLS_LOG_LEVEL", "WARNING"),
    )
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, str(CODE / "handler.py"), "serve", "--port", str(port)],
        cwd=CODE,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = threading.Event()
    said: list[str] = []

    def read_log() -> None:
        for line in server.stderr:
            said.append(line)
            if "Uvicorn running on" in line:
                ready.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("serve did not start: " + "".join(said[-5:]))
        first = _http_get(port, path)
        later = [_http_get(port, path) for _ in range(warm)]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        reader.join(10)
    return first, statistics.median(later)


def first_public_read_phase(bench: Bench, result: SizeResult, args: argparse.Namespace) -> None:
    """The first public GET /apps/{appId} a new `serve` process answers over HTTP, less a
    warm one, for the app at the head of the queue: one new process per run; the median
    of the runs' differences is first_public_read_extra_ms."""
    rows = bench.sql.run(APP_STATUS_KINDS["queued-top"].format(order=bench.handler.CLAIM_ORDER))
    rows = rows or bench.sql.run("SELECT appid FROM apps ORDER BY appid LIMIT 1")
    path = f"/apps/{rows[0][0]}"
    say(
        f"-- first public GET {path} over HTTP in a new `handler.py serve` process, less a"
        f" warm one (median of {FIRST_READ_WARM} after it), {args.first_read_runs} processes"
    )
    for run_number in range(1, args.first_read_runs + 1):
        first, warm = serve_first_read(bench.url, path)
        result.first_reads.append((first, warm))
        say(
            f"   process {run_number}: first {ms(first)}, warm {ms(warm)},"
            f" extra {(first - warm) * 1000:.1f} ms"
        )
    extras = [first - warm for first, warm in result.first_reads]
    if extras:
        say(
            f"   first public read over a warm one: median +{statistics.median(extras) * 1000:.1f}"
            f" ms (range {min(extras) * 1000:+.1f} to {max(extras) * 1000:+.1f})"
        )


UNFLAGGED_STALE = """
SELECT count(*) FROM apps
WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
  AND COALESCE(analysisversion, 0) <= :version
  AND COALESCE(analysed, '-infinity') < now() - make_interval(days => :days)
"""


def mass_promotion_phase(
    bench: Bench, api: ApiProcess, result: SizeResult, args: argparse.Namespace
) -> None:
    """The service restarted with STALE_ANALYSIS_DAYS lowered so that most analyses fall
    due at once. Claims go on one after another, each running the promoter within its
    budget; every tenth claim (and the first ten) is checked against the oracle while
    promotion is partial. Measured: the slowest request, and the requests until done."""
    days = args.mass_stale_days
    say(f"-- mass promotion: the service restarted with STALE_ANALYSIS_DAYS={days}")
    env = {"STALE_ANALYSIS_DAYS": str(days)}
    api.call("configure", env)
    bench.configure_service(**env)
    policy = bench.policy
    version = policy.analysis_version
    ((unflagged,),) = bench.sql.run(UNFLAGGED_STALE, days=days, version=version)
    say(f"   {unflagged:,} analyses fell due at once")
    times, claimed, checks, requests = [], [], 0, 0
    failures_before = len(result.oracle_failures)
    while requests < args.mass_max_requests:
        check = requests < 10 or requests % 10 == 0
        expected = bench.oracle(policy)[0] if check else None
        ((appid, _, seconds),) = api.claims(1)
        requests += 1
        times.append(seconds)
        if appid:
            claimed.append(appid)
        if check:
            checks += 1
            bench.check_oracle(f"mass claim {requests}", expected, appid, result)
        ((left,),) = bench.sql.run(UNFLAGGED_STALE, days=days, version=version)
        if left == 0:
            break
    result.mass = {
        "fell_due": unflagged,
        "requests_until_flagged": requests if left == 0 else math.nan,
        "slowest_request_ms": max(times) * 1000,
        "median_request_ms": statistics.median(times) * 1000,
        "oracle_checks": checks,
        "oracle_failures": len(result.oracle_failures) - failures_before,
    }
    say(
        f"   {requests} claims until every one was flagged ({left:,} left): slowest"
        f" {ms(max(times))}, median {ms(statistics.median(times))}; {checks} claims checked"
        f" against the oracle, {result.mass['oracle_failures']} mismatches"
    )
    _check_unique(claimed, "mass promotion", result)
    bench.restore(claimed)
    api.call("configure", {})
    bench.configure_service()


def _explain_plain(bench: Bench, statement: str, params: dict) -> list[str]:
    """The Seq Scan on apps lines of a statement's plan (EXPLAIN only, nothing runs)."""
    lines = bench.explain(statement, analyze=False, **params)
    return [line.strip() for line in lines if "Seq Scan on apps" in line]


def _seq_scan_check(bench: Bench, policy) -> list[str]:
    """Seq Scans on apps in the plans of what every /queue may run: the claim and the
    promotion (plain EXPLAIN: the planner's current choice, nothing runs)."""
    found = []
    for title, statement, params in (
        (
            "CLAIM_NEXT_APP",
            bench.handler.CLAIM_NEXT_APP,
            {"token": EXPLAIN_TOKEN, "analyser": None},
        ),
        (
            "PROMOTE_EXPIRED_LEASES",
            bench.handler.PROMOTE_EXPIRED_LEASES,
            {
                "horizon_seconds": bench.handler.PROMOTION_HORIZON_SECONDS,
                "batch": bench.handler.PROMOTION_BATCH,
            },
        ),
        (
            "PROMOTE_STALE_BATCH",
            bench.handler.PROMOTE_STALE_BATCH,
            {
                "horizon_seconds": bench.handler.PROMOTION_HORIZON_SECONDS,
                "batch": bench.handler.PROMOTION_BATCH,
            },
        ),
    ):
        scans = _explain_plain(bench, statement, {**params, **policy.sql_params()})
        found += [f"{title}: {line}" for line in scans]
    return found


# ---------------------------------------------------------------------------------------
# Import time and boto3
# ---------------------------------------------------------------------------------------

IMPORT_HANDLER = (
    "import sys, time; t = time.perf_counter(); import handler;"
    " print(time.perf_counter() - t, 'boto3' in sys.modules)"
)
IMPORT_LIBS = (
    "import time; t = time.perf_counter(); import fastapi, mangum, pg8000.native;"
    " from aws_lambda_powertools import Logger, Metrics; print(time.perf_counter() - t)"
)
IMPORT_EXTRA = (
    "import sys, time; import fastapi, mangum, pg8000.native;"
    " from aws_lambda_powertools import Logger, Metrics; before = set(sys.modules);"
    " t = time.perf_counter(); import handler; d = time.perf_counter() - t;"
    " print(d, ' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
)


def _python(code: str) -> str:
    # Without PYTHONDONTWRITEBYTECODE: handler.py is imported from bytecode, as its
    # libraries are and as a Lambda container imports it (the build ships bytecode,
    # docs/benchmarks.md "Bytecode"); the first run writes it (measure_imports).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "UPLOAD_PASSWORD", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
        and not k.startswith(("CURRENT_", "STALE_"))
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=CODE,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()


def measure_imports(runs: int) -> tuple[list[float], list[float], bool, str]:
    _python(IMPORT_HANDLER)  # bytecode caches written, files in the page cache
    _python(IMPORT_LIBS)
    handler_times, lib_times, boto3 = [], [], False
    for _ in range(runs):
        seconds, loaded = _python(IMPORT_HANDLER).split()
        handler_times.append(float(seconds))
        boto3 = boto3 or loaded == "True"
        lib_times.append(float(_python(IMPORT_LIBS)))
    extra = _python(IMPORT_EXTRA)
    return handler_times, lib_times, boto3, extra


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--apps",
        type=int,
        action="append",
        required=True,
        help="number of apps (repeatable: --apps 10000 --apps 1000000)",
    )
    parser.add_argument(
        "--database-url",
        help="the database to build in (with one --apps); default: bench_<N> on the local"
        " server, dropped and created again",
    )
    parser.add_argument(
        "--server-url",
        default=claims_db.DEFAULT_SERVER,
        help=f"server for bench_<N> databases (default {claims_db.DEFAULT_SERVER}; an"
        " embedded PostgreSQL is started when nothing answers there)",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the data (1)")
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=1000,
        help="approximate size of a stored analysis (1000; production uploads are larger,"
        " which lengthens 001 and 008)",
    )
    parser.add_argument("--claims", type=int, default=1000, help="claims per latency series")
    parser.add_argument("--repeats", type=int, default=3, help="latency series per size (3)")
    parser.add_argument("--bump-claims", type=int, default=200, help="claims after the bump")
    parser.add_argument("--duration", type=float, default=3.0, help="throughput window (s)")
    parser.add_argument(
        "--max-claims", type=int, default=100_000, help="claims per throughput window at most"
    )
    parser.add_argument("--import-runs", type=int, default=11, help="import timings (11)")
    parser.add_argument(
        "--layer-calls",
        type=int,
        default=1000,
        help="calls per layer of the claim's Python without the database (1000)",
    )
    parser.add_argument("--layer-claims", type=int, default=300, help="real claims per layer (300)")
    parser.add_argument(
        "--profile-claims", type=int, default=200, help="claims under cProfile (200; 0: none)"
    )
    parser.add_argument(
        "--first-read-runs",
        type=int,
        default=5,
        help="new serve processes for first_public_read_extra_ms (5)",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="do not add a 10k run for growth_10k_to_1m"
    )
    parser.add_argument(
        "--mass-stale-days",
        type=int,
        default=30,
        help="STALE_ANALYSIS_DAYS of the mass promotion (30: most analyses fall due)",
    )
    parser.add_argument(
        "--mass-max-requests", type=int, default=2000, help="claims of the mass promotion"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="measure existing databases already at the head of the ledger (no build, no"
        " upgrade figures)",
    )
    parser.add_argument(
        "--recreate",
        action="store_true",
        help="with --database-url: drop and create that database first",
    )
    args = parser.parse_args(argv)
    if any(n < 1000 for n in args.apps):
        parser.error("--apps must be at least 1000")
    if args.database_url and len(set(args.apps)) > 1:
        parser.error("--database-url takes a single --apps")
    return args


def prepare_database(args: argparse.Namespace, n: int, primary: bool, reuse: bool) -> str:
    """The URL of the database for n apps, created empty unless reused."""
    if args.database_url and primary:
        url = args.database_url
        name = claims_db.database_name(url)
        server = claims_db.with_database(url, "postgres")
        if args.recreate:
            return claims_db.recreate_database(server, name)
        if reuse:
            return url
        connection = claims_db.connect(url)
        try:
            occupied = connection.run(
                "SELECT to_regclass('apps') IS NOT NULL OR to_regclass('schema_migrations')"
                " IS NOT NULL"
            )[0][0]
        finally:
            connection.close()
        if occupied:
            raise SystemExit(f"{name} already has apps; use --recreate or an empty database")
        return url
    base = args.database_url or args.server_url
    suffix = "" if not args.database_url else f"{claims_db.database_name(base)}_"
    name = f"bench_{suffix}{n}"
    server = claims_db.with_database(base, "postgres")
    return (
        claims_db.with_database(server, name)
        if reuse
        else claims_db.recreate_database(server, name)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sorted(set(args.apps))
    baseline_added = BASELINE_APPS not in sizes and not args.no_baseline
    if baseline_added:
        sizes.insert(0, BASELINE_APPS)
    if not args.database_url and not claims_db.server_reachable(args.server_url):
        sys.path.insert(0, str(ROOT))
        import handler

        args.server_url = handler.start_embedded_postgres(ROOT / ".local" / "bench-pgdata")
        say(f"no server at the default URL; embedded PostgreSQL at {args.server_url}")
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    global CODE
    CODE = Path(tempfile.mkdtemp(prefix="bench-code-"))
    shutil.copy2(ROOT / "handler.py", CODE / "handler.py")
    shutil.copytree(ROOT / "sql", CODE / "sql")
    os.environ["BENCH_CODE_DIR"] = str(CODE)
    try:
        return run(args, sizes, baseline_added)
    finally:
        shutil.rmtree(CODE, ignore_errors=True)


def run(args: argparse.Namespace, sizes: list[int], baseline_added: bool) -> int:
    sys.path.insert(0, str(CODE))
    import handler

    digest = hashlib.sha256((CODE / "handler.py").read_bytes()).hexdigest()[:12]
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()

    first_url = args.database_url or args.server_url
    probe = claims_db.connect(claims_db.with_database(first_url, "postgres"))
    version, args.autovacuum = (
        probe.run("SHOW server_version")[0][0],
        probe.run("SHOW autovacuum")[0][0],
    )
    probe.close()
    say(f"claims benchmark: PostgreSQL {version}, {os.cpu_count()} CPUs, sizes {sizes}")
    say(f"code: handler.py sha256 {digest}, sql/ as of the start; HEAD {commit[:70]}")
    if baseline_added:
        say(f"(a {BASELINE_APPS:,}-app database is built too: growth_10k_to_1m needs it)")

    say()
    say("== import handler (subprocesses, median of runs)")
    handler_times, lib_times, boto3_on_import, extra = measure_imports(args.import_runs)
    handler_s, libs_s = statistics.median(handler_times), statistics.median(lib_times)
    extra_s, _, extra_modules = extra.partition(" ")
    say(
        f"   import handler: median {handler_s * 1000:.1f} ms"
        f" (min {min(handler_times) * 1000:.1f}); boto3 imported: {boto3_on_import}"
    )
    say(
        "   import fastapi, mangum, pg8000.native; Powertools Logger, Metrics: median"
        f" {libs_s * 1000:.1f} ms (min {min(lib_times) * 1000:.1f})"
    )
    say(
        f"   ratio of medians: {handler_s / libs_s:.2f}"
        f" (of minima {min(handler_times) / min(lib_times):.2f})"
    )
    say(
        f"   handler on top of the libraries: {float(extra_s) * 1000:.1f} ms, new top-level"
        f" modules: {extra_modules or '(none)'}"
    )

    results: dict[int, SizeResult] = {}
    run_started = time.perf_counter()
    for n in sizes:
        primary = n == max(args.apps)
        reuse = args.reuse
        url = prepare_database(args, n, primary, reuse)
        size_started = time.perf_counter()
        results[n] = run_size(handler, url, n, args, reuse)
        say(
            f"   ({n:,} apps measured in {time.perf_counter() - size_started:.0f} s;"
            f" load average {_load()})"
        )

    print_summary(results, handler_s, libs_s, boto3_on_import, time.perf_counter() - run_started)
    return 0


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def print_summary(
    results: dict[int, SizeResult],
    handler_s: float,
    libs_s: float,
    boto3_on_import: bool,
    run_s: float,
) -> None:
    largest = results[max(results)]
    base = results.get(BASELINE_APPS)
    upgrade = largest.upgrade
    service4 = largest.service_throughput[4].per_second
    floor4 = largest.floor_throughput[4].per_second
    service16 = largest.service_throughput[CONCURRENCY[-1]].per_second
    floor16 = largest.floor_throughput[CONCURRENCY[-1]].per_second
    first_extras = [first - warm for first, warm in largest.first_reads]
    figures = {
        "claim_vs_floor": ratio(largest.service_median, largest.floor_median),
        "growth_10k_to_1m": (
            ratio(largest.service_median, base.service_median) if base else math.nan
        ),
        "throughput4_vs_floor": ratio(service4, floor4),
        "throughput16_vs_floor": ratio(service16, floor16),
        "reports_max_s": max(largest.reports.values()),
        "import_vs_libs": ratio(handler_s, libs_s),
        "first_public_read_extra_ms": (
            statistics.median(first_extras) * 1000 if first_extras else math.nan
        ),
        "peak_rss_mb": max(r.peak_rss_mb for r in results.values()),
        "upgrade_total_s": upgrade.total_s if upgrade else math.nan,
        "upgrade_longest_lock_s": upgrade.longest_lock_s if upgrade else math.nan,
        "app_status_max_ms": max(largest.app_status_ms.values(), default=math.nan),
        "mass_slowest_request_ms": largest.mass.get("slowest_request_ms", math.nan),
    }
    say()
    say(f"== summary (targets evaluated at {largest.apps:,} apps; run {run_s:.0f} s)")
    say(
        f"   {'apps':>10} {'service med':>12} {'p99':>10} {'floor med':>10} {'p99':>10}"
        f" {'ratio':>6} {'svc x16/s':>10} {'floor x16/s':>11} {'reports s':>9}"
        f" {'1st claim s':>11} {'upgrade s':>9} {'longest lock s':>14} {'blocked s':>9}"
    )
    for n, r in sorted(results.items()):
        upgraded = (
            f" {r.upgrade.total_s:9.1f} {r.upgrade.longest_lock_s:14.2f}"
            f" {max(r.upgrade.reads_blocked_total_s, r.upgrade.writes_blocked_total_s):9.2f}"
            if r.upgrade
            else f" {'n/a':>9} {'n/a':>14} {'n/a':>9}"
        )
        say(
            f"   {n:>10,} {ms(r.service_median):>12} {ms(r.service_p99):>10}"
            f" {ms(r.floor_median):>10} {ms(r.floor_p99):>10}"
            f" {ratio(r.service_median, r.floor_median):6.2f}"
            f" {r.service_throughput[CONCURRENCY[-1]].per_second:10.0f}"
            f" {r.floor_throughput[CONCURRENCY[-1]].per_second:11.0f}"
            f" {max(r.reports.values()):9.2f} {r.first_after_upgrade:11.2f}{upgraded}"
        )
    for clients in CONCURRENCY:
        service = largest.service_throughput[clients].per_second
        floor = largest.floor_throughput[clients].per_second
        alone = largest.claim_sql_throughput[clients].per_second
        say(
            f"   {clients:>2} clients at {largest.apps:,}: service {service:.0f}/s,"
            f" floor {floor:.0f}/s, ratio {ratio(service, floor):.2f}; the claim's SQL"
            f" alone {alone:.0f}/s, ratio {ratio(alone, floor):.2f}"
        )
    failures = [f for r in results.values() for f in r.oracle_failures]
    scans = [s for r in results.values() for s in r.seq_scans]
    say(f"   oracle and double-claim checks: {'all passed' if not failures else failures}")
    say(f"   Seq Scan on apps in the claim's plans: {'none' if not scans else scans}")
    say(f"   GET /apps at {largest.apps:,} (median ms): {largest.app_status_ms}")
    if largest.layers:
        parts = ", ".join(
            f"{label} {largest.layers[f'layer_{name}_us']:.0f}"
            + (
                f" ({largest.layers[f'layer_{name}_no_db_us']:.0f})"
                if f"layer_{name}_no_db_us" in largest.layers
                else ""
            )
            for label, name in (
                ("Powertools", "powertools"),
                ("handler.api's own", "api_own"),
                ("HTTPCycle, stepped", "cycle"),
                ("Starlette/FastAPI", "starlette_fastapi"),
                ("route", "route"),
                ("claim_next_app", "claim_next_app"),
                ("Session", "session"),
                ("SQL", "prepared_sql"),
            )
        )
        say(
            f"   a claim's layers at {largest.apps:,}, µs of real claims (without the"
            f" database): {parts}; floor {largest.layers['layer_floor_us']:.0f}"
        )
    say(f"   mass promotion at {largest.apps:,}: {largest.mass}")
    say(
        f"   version bump at {largest.apps:,}: first claim right, later claims within 2x the"
        f" floor (median {ratio(largest.bump_later_median, largest.floor_median):.2f}x),"
        f" no scan: {'PASS' if largest.bump_ok else 'MISS'}"
    )
    boto3_after = any(r.boto3.get("after /queue") for r in results.values())
    say(
        f"   boto3 on the API path: after import {'yes' if boto3_on_import else 'no'},"
        f" after /queue {'yes' if boto3_after else 'no'}:"
        f" {'PASS' if not (boto3_on_import or boto3_after) else 'MISS'}"
    )
    for name, value in figures.items():
        op, limit = TARGETS[name]
        if op is None or math.isnan(value):
            verdict = "(reported)" if op is None else "(n/a)"
        else:
            ok = value <= limit if op == "<=" else value >= limit if op == ">=" else value < limit
            verdict = f"{'PASS' if ok else 'MISS'} (target {op} {limit:g})"
        say(f"   {name:<28}{value:10.3f}  {verdict}")
    say()
    for name, value in figures.items():
        say(f"{name}={value:.3f}")


if __name__ == "__main__":
    sys.exit(main())
