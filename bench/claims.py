"""The claim (GET /queue) and the public read at 10k to 1M apps, against the bare SQL floor.

    python3 bench/claims.py --apps 1000000 [--seed 1] [--server-url URL]
    python3 bench/claims.py --apps 10000 --apps 1000000 --reuse

For each size it builds a production-like database at ledger state 006
(bench/claims_data.py), upgrades it through handler.migrate while probes play the
previous release (bench/claims_upgrade.py), and measures on it:

* latency, one client: rounds in which the service's claim through handler.api (the
  Lambda entry, an API Gateway v2 event, in its own API process), the service's claim
  statement alone (handler.claim_next_app on the API's connection: the SQL and its
  session, no HTTP stack) and the floor (FLOOR_CLAIM on a bare pg8000 connection) each
  claim a block, in a shuffled order; the claimed rows are put back and apps vacuumed
  after every round, so each round starts from the same data. claim_vs_floor and
  claim_sql_vs_floor are the medians of the rounds' ratios (block medians), printed with
  a 95 % interval. The first claim of every service block is checked against the oracle
  (a plain query of handler.CANDIDATE);
* throughput with 16 processes (one connection each, as 16 Lambda containers), service
  and floor windows in ABBA order, no app handed out twice;
* the queue-status and priority reports, on the report function's statement timeout;
* GET /apps/{appId} through handler.api; over HTTP, in new `handler.py serve`
  processes, the first public read less a warm one, and warm claims (the end-to-end
  answer);
* a version bump and a mass promotion (STALE_ANALYSIS_DAYS lowered), claims checked
  against the oracle meanwhile;
and once: `import handler` against its libraries, and whether boto3 is on the API path.

handler.py and sql/ are copied when the run starts; every process uses the copy. The
figures are taken at the largest --apps (growth needs a 10k run: one is added unless
--no-baseline). The run ends with one `name=value target...` line per figure. The
databases stay at the head of the ledger with the benchmark's claims undone.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import math
import multiprocessing
import os
import random
import resource
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

import claims_data
import claims_upgrade
import pg8000.native

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT  # the run's copy of handler.py and sql/ (main() makes it)
BASELINE_APPS = 10_000
EXPLAIN_TOKEN = str(uuid.UUID(int=0))  # plans only: EXPLAIN runs nothing
UPLOAD_PASSWORD = "bench-upload-password"
TOKEN_HEADER = "x-analysis-claim-token"
REPORT_STATEMENT_TIMEOUT_MS = 45_000  # template.yaml's ReportFunction (tests/test_template.py)
SPAWN = multiprocessing.get_context("spawn")

# The floor: the complete index-head claim, bare (issue 5's statement).
FLOOR_CLAIM = """
UPDATE apps SET status = 'processing', processing_started = now(),
                analysis_claim_token = gen_random_uuid()
WHERE appid = (
    SELECT appid FROM apps WHERE status = 'queued'
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING appid
"""

# name: (comparison, limit); None: reported, no target.
TARGETS = {
    "claim_vs_floor": ("<=", 2.0),
    "claim_sql_vs_floor": ("<=", 1.1),
    "growth_10k_to_1m": ("<=", 1.5),
    "throughput16_vs_floor": (">=", 0.8),
    "import_vs_libs": ("<=", 1.15),
    "reports_max_s": ("<=", 5.0),
    "app_status_max_ms": ("<=", 5.0),
    "first_public_read_extra_ms": ("<=", 5.0),
    "http_claim_ms": (None, None),
    "bump_later_vs_floor": ("<=", 2.0),
    "mass_slowest_request_ms": ("<=", 1000.0),
    "peak_rss_mb": ("<", 150.0),
    "upgrade_total_s": (None, None),
    "upgrade_longest_lock_s": (None, None),
}


def say(text: str = "") -> None:
    print(text, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


# ---------------------------------------------------------------------------------------
# The service as a Lambda container runs it (used in spawned processes too)
# ---------------------------------------------------------------------------------------


def gateway_event(path: str, password: str = UPLOAD_PASSWORD) -> dict:
    """What API Gateway (HTTP API, payload format 2.0) hands the API function."""
    now = time.time()
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {
            "accept": "*/*",
            "authorization": f"Bearer {password}",
            "host": "bench.execute-api.us-east-1.amazonaws.com",
            "user-agent": "curl/7.88.1",
            "x-forwarded-for": "127.0.0.1",
            "x-forwarded-port": "443",
            "x-forwarded-proto": "https",
        },
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "bench",
            "domainName": "bench.execute-api.us-east-1.amazonaws.com",
            "domainPrefix": "bench",
            "http": {
                "method": "GET",
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": "127.0.0.1",
                "userAgent": "curl/7.88.1",
            },
            "requestId": "bench",
            "routeKey": "$default",
            "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)),
            "timeEpoch": int(now * 1000),
        },
        "isBase64Encoded": False,
    }


def service_env(url: str, extra: dict[str, str] | None = None) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ["UPLOAD_PASSWORD"] = UPLOAD_PASSWORD
    os.environ.setdefault("POWERTOOLS_METRICS_NAMESPACE", "AnalysisQueueBench")
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    for name in ("CURRENT_ANALYSIS_VERSION", "STALE_ANALYSIS_DAYS", "PROCESSING_TIMEOUT_MINUTES"):
        os.environ.pop(name, None)
    os.environ.update(extra or {})


def import_handler():
    code = os.environ.get("BENCH_CODE_DIR") or str(ROOT)
    if code not in sys.path:
        sys.path.insert(0, code)
    import handler

    return handler


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Service:
    """A Lambda container of the API function: one request at a time through handler.api."""

    def __init__(self, url: str):
        service_env(url)
        self.handler = import_handler()
        self.context = self.handler.LocalContext(25, "bench-api")  # the API's Timeout
        self.configure()

    def configure(self, extra: dict[str, str] | None = None) -> None:
        service_env(os.environ["DATABASE_URL"], extra)
        self.handler.use_runtime(None)

    def get(self, path: str) -> dict:
        return self.handler.api(gateway_event(path), self.context)

    def claim(self) -> tuple[str, str | None]:
        """(appid, or '' when there is no work; the claim token)."""
        response = self.get("/queue")
        if response["statusCode"] != 200:
            raise RuntimeError(f"/queue answered {response['statusCode']}: {response['body']}")
        headers = {k.lower(): v for k, v in (response.get("headers") or {}).items()}
        return response["body"], headers.get(TOKEN_HEADER)

    def claim_sql(self) -> tuple[str, str | None]:
        """The claim statement alone: handler.claim_next_app on the API's connection."""
        handler = self.handler
        claimed = handler.claim_next_app(handler.api_connection(), handler.settings().policy)
        return claimed if claimed else ("", None)


def timed_claims(claim, count: int) -> list[tuple[str, str | None, float]]:
    results = []
    for _ in range(count):
        started = time.perf_counter()
        appid, token = claim()
        results.append((appid, token, time.perf_counter() - started))
        if not appid:
            break
    return results


def api_process(pipe, url: str) -> None:
    """The API process, driven over a pipe: ("claims" | "sql_claims", n) -> [(appid,
    token, seconds)], ("gets", [(path, n)]) -> {path: [seconds]}, ("configure", env),
    ("stats", None) -> dict, ("exit", None)."""
    service = Service(url)
    service.get("/healthz")  # connected, as a warm container is
    while True:
        command, argument = pipe.recv()
        if command == "claims":
            pipe.send(timed_claims(service.claim, argument))
        elif command == "sql_claims":
            pipe.send(timed_claims(service.claim_sql, argument))
        elif command == "gets":
            timings = {}
            for path, repeats in argument:
                timings[path] = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    response = service.get(path)
                    timings[path].append(time.perf_counter() - started)
                    if response["statusCode"] != 200:
                        raise RuntimeError(f"{path} answered {response['statusCode']}")
            pipe.send(timings)
        elif command == "configure":
            service.configure(argument)
            service.get("/healthz")
            pipe.send(None)
        elif command == "stats":
            pipe.send({"peak_rss_mb": peak_rss_mb(), "boto3": "boto3" in sys.modules})
        elif command == "exit":
            pipe.send(None)
            return


class ApiProcess:
    def __init__(self, url: str):
        self.pipe, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=api_process, args=(child, url))
        self.process.start()

    def call(self, command: str, argument=None, timeout: float = 600):
        self.pipe.send((command, argument))
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"the API process did not answer {command} in {timeout} s")
        return self.pipe.recv()

    def close(self) -> dict:
        stats = self.call("stats")
        self.call("exit")
        self.process.join(30)
        return stats

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)


def window(claim, barrier, duration: float, quota: int) -> dict:
    """One claim to warm up (a container's first claim runs the promoter), then claims
    until the window or the quota ends, or the queue runs dry."""
    warmup = claim()
    barrier.wait()
    started = time.perf_counter()
    claimed: list[tuple[str, str | None]] = [warmup] if warmup[0] else []
    count = 0
    while count < quota and time.perf_counter() < started + duration:
        appid, token = claim()
        if not appid:
            break
        claimed.append((appid, token))
        count += 1
    elapsed = time.perf_counter() - started
    return {"claimed": claimed, "count": count, "elapsed": elapsed, "rss": peak_rss_mb()}


def service_worker(url: str, barrier, results, duration: float, quota: int) -> None:
    service = Service(url)
    service.get("/healthz")
    results.put(window(service.claim, barrier, duration, quota))


def floor_worker(url: str, barrier, results, duration: float, quota: int) -> None:
    connection = claims_data.connect(url, "bench-floor")

    def claim() -> tuple[str, None]:
        rows = connection.run(FLOOR_CLAIM)
        return (rows[0][0] if rows else ""), None

    results.put(window(claim, barrier, duration, quota))
    connection.close()


# ---------------------------------------------------------------------------------------
# The database under test
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class SizeResult:
    apps: int
    service: list[float] = dataclasses.field(default_factory=list)
    claim_sql: list[float] = dataclasses.field(default_factory=list)
    rounds: list[dict[str, float]] = dataclasses.field(default_factory=list)
    floor: list[float] = dataclasses.field(default_factory=list)
    throughput: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    reports: dict[str, float] = dataclasses.field(default_factory=dict)
    app_status_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    first_reads: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    http_claims: list[float] = dataclasses.field(default_factory=list)
    bump_later: float = math.nan
    mass: dict[str, float] = dataclasses.field(default_factory=dict)
    upgrade: claims_upgrade.UpgradeResult | None = None
    peak_rss_mb: float = 0.0
    boto3: bool = False
    failures: list[str] = dataclasses.field(default_factory=list)


class Bench:
    """One size: its database, a bare connection for arranging and checking, and the
    handler module (the upgrade runner, the oracle's rule, the reports)."""

    def __init__(self, handler, url: str, args: argparse.Namespace, result: SizeResult):
        self.handler, self.url, self.args, self.result = handler, url, args, result
        self.sql = claims_data.connect(url, "bench-orchestrator")
        self.sql.run("SET statement_timeout = '10min'")

    def configure(self, **extra: str) -> None:
        service_env(self.url, extra)
        self.handler.use_runtime(None)

    @property
    def policy(self):
        return self.handler.settings().policy

    def oracle(self, policy=None) -> str | None:
        """The first candidate in claim order by the queue's rule, evaluated plainly."""
        policy = policy or self.policy
        rows = self.sql.run(
            f"SELECT appid FROM apps WHERE {self.handler.CANDIDATE}"
            f" ORDER BY {self.handler.CLAIM_ORDER} LIMIT 1",
            **policy.sql_params(),
        )
        return rows[0][0] if rows else None

    def check(self, label: str, expected: str | None, got: str, quiet: bool = False) -> None:
        if expected == got or (expected is None and not got):
            if not quiet:
                say(f"   {label}: {got or '(empty)'} = oracle")
            return
        self.result.failures.append(f"{label}: got {got!r}, the oracle {expected!r}")
        say(f"   !! {label}: got {got!r}, the oracle {expected!r}")

    def unique(self, appids: list[str], label: str) -> None:
        twice = [a for a, n in Counter(appids).items() if n > 1]
        if twice:
            self.result.failures.append(f"{label}: handed out twice: {twice[:5]}")
            say(f"   !! {label}: handed out twice: {twice[:5]}")

    def snapshot(self) -> None:
        self.sql.run("DROP TABLE IF EXISTS bench_snapshot")
        self.sql.run(
            "CREATE TABLE bench_snapshot AS"
            " SELECT appid, status, processing_started, due, analysis_claim_token FROM apps"
        )
        self.sql.run("ALTER TABLE bench_snapshot ADD PRIMARY KEY (appid)")

    def restore(self) -> None:
        """Put back every row whose claim state differs from the snapshot, and vacuum, so
        that the next round starts without the dead index entries this one left. (Flags
        the promoter set on rows it did not claim stay: a policy's own run clears them.)"""
        self.sql.run(
            """UPDATE apps a SET status = s.status, processing_started = s.processing_started,
                   due = s.due, analysis_claim_token = s.analysis_claim_token
               FROM bench_snapshot s
               WHERE a.appid = s.appid
                 AND (a.status, a.processing_started, a.analysis_claim_token)
                     IS DISTINCT FROM (s.status, s.processing_started, s.analysis_claim_token)"""
        )
        self.sql.run("VACUUM (INDEX_CLEANUP ON) apps")

    def queued(self) -> int:
        return self.sql.run("SELECT count(*) FROM apps WHERE status = 'queued'")[0][0]

    def plan(self, statement: str, analyze: bool = True, **params) -> list[str]:
        """The plan of a statement as the API connection runs it (prepared, generic plan),
        with ANALYZE inside a rolled-back transaction."""
        text, make_values = pg8000.native.to_statement(statement)
        values = ", ".join(pg8000.native.literal(v) for v in make_values(params))
        self.sql.run("BEGIN")
        try:
            self.sql.run("SET LOCAL plan_cache_mode = force_generic_plan")
            self.sql.run(f"PREPARE bench_plan AS {text}")
            execute = f"EXECUTE bench_plan({values})" if values else "EXECUTE bench_plan"
            options = "(ANALYZE, BUFFERS) " if analyze else ""
            return [r[0] for r in self.sql.run(f"EXPLAIN {options}{execute}")]
        finally:
            self.sql.run("ROLLBACK")
            self.sql.run("DEALLOCATE ALL")

    def scans(self, label: str, policy=None) -> None:
        """No Seq Scan on apps in the plans of what every /queue may run."""
        handler, policy = self.handler, policy or self.policy
        promoter = {
            "horizon_seconds": handler.PROMOTION_HORIZON_SECONDS,
            "batch": handler.PROMOTION_BATCH,
        }
        for title, statement, params in (
            ("CLAIM_NEXT_APP", handler.CLAIM_NEXT_APP, {"token": EXPLAIN_TOKEN, "analyser": None}),
            ("PROMOTE_EXPIRED_LEASES", handler.PROMOTE_EXPIRED_LEASES, promoter),
            ("PROMOTE_STALE_BATCH", handler.PROMOTE_STALE_BATCH, promoter),
            ("PROMOTE_DUE_RETRIES", handler.PROMOTE_DUE_RETRIES, promoter),
            (
                "CLAIM_NEXT_RETRY",
                handler.CLAIM_NEXT_RETRY,
                {"token": EXPLAIN_TOKEN, "analyser": None},
            ),
        ):
            lines = self.plan(statement, analyze=False, **params, **policy.sql_params())
            for line in lines:
                if "Seq Scan on apps" in line:
                    self.result.failures.append(f"{label}, {title}: {line.strip()}")
                    say(f"   !! {label}, {title}: {line.strip()}")


# ---------------------------------------------------------------------------------------
# Phases of one size
# ---------------------------------------------------------------------------------------


def retry_tier(bench: Bench) -> None:
    """The retries due (the rows sql/031 counts as one failure: the build's old retryable
    failures) and the lowest tier's head, which a claim reads when nothing else is a
    candidate: an index read of the flagged rows, however many back off."""
    ((flagged, waiting),) = bench.sql.run(
        "SELECT count(*) FILTER (WHERE retry_due),"
        " count(*) FILTER (WHERE status = 'failed' AND failure_retryable AND NOT retry_due)"
        " FROM apps"
    )
    plan = bench.plan(bench.handler.RETRY_HEAD, **bench.policy.sql_params())
    read = [x.strip() for x in plan if "Index" in x and "apps" in x][:1]
    say(
        f"   retries due (flagged) {flagged:,}, other retryable failures {waiting:,};"
        f" the retry tier's head: {'; '.join(read + [x.strip() for x in plan if 'Time:' in x])}"
    )
    if flagged == 0:
        bench.result.failures.append("no retry was due: the retry tier went unmeasured")


def build_and_upgrade(bench: Bench, n: int) -> None:
    say(f"-- build: {n:,} apps at ledger state 006 (legacy JSON states), seed {bench.args.seed}")
    started = time.perf_counter()
    claims_data.build_legacy_database(
        bench.sql, CODE / "sql", n, bench.args.seed, bench.args.payload_bytes
    )
    mix = claims_data.legacy_mix(bench.sql)
    say(
        f"   {time.perf_counter() - started:.1f} s; states "
        + ", ".join(f"{k} {v:,}" for k, v in mix.items())
    )
    read_appid, write_appid = bench.sql.run(
        "SELECT (SELECT appid FROM apps WHERE analysis IS NOT NULL AND appid = lower(appid)"
        "        ORDER BY appid LIMIT 1),"
        "       (SELECT appid FROM apps WHERE analysis IS NULL AND appid = lower(appid)"
        "        ORDER BY appid LIMIT 1)"
    )[0]
    say("-- upgrade 006 -> head as a deploy runs it (handler.migrate), while the previous")
    say("   release reads, updates and inserts apps")
    bench.configure()
    upgrade = claims_upgrade.measure_upgrade(
        bench.handler, bench.url, CODE / "sql", read_appid, write_appid
    )
    bench.result.upgrade = upgrade
    say(f"   {'file':<34}{'seconds':>9}  {'strongest lock':<22}{'reads blocked':>14}")
    for f in upgrade.files:
        say(f"   {f.name:<34}{f.seconds:9.2f}  {f.strongest_lock:<22}{f.reads_blocked_s:13.2f}s")
    say(
        f"   total {upgrade.total_s:.1f} s; the previous release's reads blocked at most"
        f" {upgrade.reads_blocked_s:.2f} s at a time, its writes {upgrade.writes_blocked_s:.2f} s"
    )
    for error in upgrade.probe_errors:
        say(f"   probe error (last): {error}")


def latency_phase(bench: Bench, api: ApiProcess) -> None:
    """Rounds of a block each of the service's claims, the claim statement alone and the
    floor, in a shuffled order, the rows put back after every round; each round's ratios
    of block medians to the floor's."""
    args, result = bench.args, bench.result
    count = min(args.claims, max(10, bench.queued() // (4 * args.rounds)))
    say(
        f"-- latency, one client: {args.rounds} rounds of {count} claims each through"
        " handler.api, claim_next_app alone and the floor, in a shuffled order"
    )
    floor = claims_data.connect(bench.url, "bench-floor")
    floor.run(FLOOR_CLAIM)  # the connection's caches warm
    bench.restore()

    def floor_claims(n: int):
        return timed_claims(lambda: ((floor.run(FLOOR_CLAIM) or [[""]])[0][0], None), n)

    series = {
        "service": (result.service, lambda n: api.call("claims", n)),
        "claim SQL": (result.claim_sql, lambda n: api.call("sql_claims", n)),
        "floor": (result.floor, floor_claims),
    }
    order = random.Random(args.seed)
    for round_number in range(1, args.rounds + 1):
        kinds = list(series)
        order.shuffle(kinds)
        medians = {}
        for kind in kinds:
            expected = bench.oracle() if kind == "service" else None
            claims = series[kind][1](count)
            if kind == "service":
                bench.check(f"round {round_number}, first claim", expected, claims[0][0], True)
            bench.unique([a for a, _, _ in claims if a], f"{kind}, round {round_number}")
            series[kind][0].extend(t for _, _, t in claims)
            medians[kind] = median(t for _, _, t in claims)
        bench.restore()
        result.rounds.append(medians)
        say(
            f"   round {round_number}: "
            + ", ".join(f"{kind} {ms(medians[kind])}" for kind in series)
            + f" (load {load()})"
        )
    floor.close()
    say(
        f"   medians: service {ms(median(result.service))}, claim SQL alone"
        f" {ms(median(result.claim_sql))}, floor {ms(median(result.floor))}"
    )


def throughput_phase(bench: Bench) -> None:
    """--clients processes claiming for --duration seconds, service and floor windows in
    turn, ABBA (--windows of each); no app handed out twice, every service claim's row
    held. The figure is the service's claims over the floor's, all windows summed."""
    args = bench.args
    clients = args.clients
    quota = max(clients, min(100_000, bench.queued() // 2)) // clients
    say(f"-- throughput: {clients} clients, {args.duration:g} s windows, service and floor in turn")
    kinds = (("service", service_worker), ("floor", floor_worker))
    for number in range(args.windows):
        for kind, target in kinds[:: 1 if number % 2 == 0 else -1]:  # ABBA: drift cancels
            barrier = SPAWN.Barrier(clients + 1)
            results = SPAWN.Queue()
            work = (bench.url, barrier, results, args.duration, quota)
            processes = [SPAWN.Process(target=target, args=work) for _ in range(clients)]
            for process in processes:
                process.start()
            try:
                barrier.wait(timeout=180)
                outcomes = [results.get(timeout=args.duration + 120) for _ in processes]
            finally:
                for process in processes:
                    process.join(30)
                    if process.is_alive():
                        process.terminate()
            claimed = [pair for outcome in outcomes for pair in outcome["claimed"]]
            appids = [appid for appid, _ in claimed]
            bench.unique(appids, f"{kind} x{clients}")
            if kind == "service":
                (held,) = bench.sql.run(
                    """SELECT count(*) FROM unnest(CAST(:ids AS text[]), CAST(:tokens AS text[]))
                           AS c(appid, token) JOIN apps a USING (appid)
                       WHERE a.status = 'processing'
                         AND CAST(a.analysis_claim_token AS text) = c.token""",
                    ids=appids,
                    tokens=[token for _, token in claimed],
                )[0]
                if held != len(set(appids)):
                    bench.result.failures.append(f"throughput: {len(appids) - held} rows not held")
                bench.result.peak_rss_mb = max(
                    [bench.result.peak_rss_mb, *(o["rss"] for o in outcomes)]
                )
            rate = sum(o["count"] for o in outcomes) / max(o["elapsed"] for o in outcomes)
            bench.result.throughput.setdefault(kind, []).append(rate)
            say(f"   window {number + 1}, {kind:<8}{rate:8.0f} claims/s (load {load()})")
            bench.restore()


def reports_phase(bench: Bench) -> None:
    say("-- reports (handler.queue_status and handler.priority_report, 3 runs each)")
    handler, policy = bench.handler, bench.policy
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
            started = time.perf_counter()
            work()
            runs.append(time.perf_counter() - started)
        bench.result.reports[name] = max(runs)
        say(f"   {name:<16} " + ", ".join(f"{r:.3f} s" for r in runs))
    db.discard()


APP_KINDS = {
    "queued-top": "SELECT appid FROM apps WHERE status = 'queued' ORDER BY {order} LIMIT 1",
    "queued-deep": (
        "SELECT appid FROM apps WHERE status = 'queued'"
        " ORDER BY app_popularity(details), added DESC, appid DESC LIMIT 1"
    ),
    "analysed": "SELECT appid FROM apps WHERE status = 'analysed' LIMIT 1",
    "failed": "SELECT appid FROM apps WHERE status = 'failed' LIMIT 1",
}


def app_status_phase(bench: Bench, api: ApiProcess) -> str:
    """GET /apps/{appId} through handler.api for the app at the head of the queue, one at
    its end (its queue position counts the most), an analysed and a failed one: medians
    of 50 each. Returns the head's path."""
    paths = {}
    for kind, query in APP_KINDS.items():
        rows = bench.sql.run(query.format(order=bench.handler.CLAIM_ORDER))
        if rows:
            paths[kind] = f"/apps/{rows[0][0]}"
    timings = api.call("gets", [(path, 50) for path in paths.values()])
    say("-- GET /apps/{appId} through handler.api, median of 50")
    for kind, path in paths.items():
        bench.result.app_status_ms[kind] = median(timings[path]) * 1000
        say(f"   {kind:<12} {ms(median(timings[path]))}")
    return paths.get("queued-top") or next(iter(paths.values()))


def http_get(port: int, path: str, password: str | None = None) -> tuple[float, str]:
    """Seconds of one GET on a new connection to the end of the body, and the body."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"Authorization": f"Bearer {password}"} if password else {}
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        body = response.read().decode()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"GET {path} answered {response.status}")
    return time.perf_counter() - started, body


def serve_process(url: str, path: str, warm: int, claims: int) -> tuple[float, float, list]:
    """A new `python3 handler.py serve` on a free loopback port, sent nothing before:
    (its first GET of path, the median of `warm` more, [seconds of each GET /queue])."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "ADMIN_TOKEN") and not k.startswith(("CURRENT_", "STALE_"))
    }
    env.update(DATABASE_URL=url, UPLOAD_PASSWORD=UPLOAD_PASSWORD)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(CODE / "handler.py"), "serve", "--port", str(port)],
        cwd=CODE,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, said = threading.Event(), []

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
        first, _ = http_get(port, path)
        later = [http_get(port, path)[0] for _ in range(warm)]
        claimed = []
        for _ in range(claims):
            seconds, appid = http_get(port, "/queue", UPLOAD_PASSWORD)
            if not appid:
                break
            claimed.append(seconds)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        reader.join(10)
    return first, median(later), claimed


def http_phase(bench: Bench, path: str) -> None:
    """Over HTTP: the first public read of new serve processes less a warm one, and warm
    claims (a new connection each, as an analyser's curl)."""
    args = bench.args
    say(
        f"-- over HTTP, {args.first_read_runs} new `handler.py serve` processes: the first"
        f" GET {path} less a warm one, then {args.http_claims} GET /queue each"
    )
    for number in range(args.first_read_runs):
        first, warm, claimed = serve_process(bench.url, path, 10, args.http_claims)
        bench.result.first_reads.append((first, warm))
        bench.result.http_claims += claimed
        say(
            f"   process {number + 1}: first read {ms(first)}, warm {ms(warm)}; claims"
            f" median {ms(median(claimed))}"
        )
        bench.restore()


def bump_phase(bench: Bench, api: ApiProcess) -> None:
    """The service restarted with CURRENT_ANALYSIS_VERSION + 1: its first claim (which
    starts the pass clearing flags) against the oracle, then later claims."""
    bumped = {"CURRENT_ANALYSIS_VERSION": str(bench.policy.analysis_version + 1)}
    say(f"-- version bump: the service restarted with {bumped}")
    api.call("configure", bumped)
    bench.configure(**bumped)
    expected = bench.oracle()
    ((appid, _, seconds),) = api.call("claims", 1)
    bench.check(f"first claim ({ms(seconds)})", expected, appid)
    later = api.call("claims", bench.args.bump_claims)
    bench.result.bump_later = median(t for _, _, t in later)
    bench.unique([appid] + [a for a, _, _ in later if a], "version bump")
    say(f"   next {len(later)} claims: median {ms(bench.result.bump_later)}")
    bench.scans("after the bump")
    api.call("configure", {})
    bench.configure()
    bench.restore()


UNFLAGGED_STALE = """
SELECT count(*) FROM apps
WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
  AND COALESCE(analysisversion, 0) <= :version
  AND COALESCE(analysed, '-infinity') < now() - make_interval(days => :days)
"""


def mass_phase(bench: Bench, api: ApiProcess) -> None:
    """STALE_ANALYSIS_DAYS lowered so that most analyses fall due at once: claims go on,
    each promoting within its budget; the first ten and every tenth are checked against
    the oracle while promotion is partial. The slowest request until all are flagged."""
    days, result = bench.args.mass_stale_days, bench.result
    env = {"STALE_ANALYSIS_DAYS": str(days)}
    say(f"-- mass promotion: the service restarted with {env}")
    api.call("configure", env)
    bench.configure(**env)
    policy = bench.policy
    (fell_due,) = bench.sql.run(UNFLAGGED_STALE, days=days, version=policy.analysis_version)[0]
    times, claimed, left, counts = [], [], fell_due, []
    before = len(result.failures)
    # Until none is left unflagged, or five claims in a row flag none (rows no selection
    # takes: an old row's invalid bundle ID).
    while len(times) < bench.args.mass_max_requests and left and counts[-5:] != [left] * 5:
        check = len(times) < 10 or len(times) % 10 == 0
        expected = bench.oracle(policy) if check else None
        ((appid, _, seconds),) = api.call("claims", 1)
        times.append(seconds)
        claimed += [appid] if appid else []
        if check:
            bench.check(f"mass claim {len(times)}", expected, appid, quiet=True)
        (left,) = bench.sql.run(UNFLAGGED_STALE, days=days, version=policy.analysis_version)[0]
        counts.append(left)
    result.mass = {"slowest_ms": max(times) * 1000, "median_ms": median(times) * 1000}
    say(
        f"   {fell_due:,} fell due; {len(times)} claims until the promoter flagged no more"
        f" ({left:,} left):"
        f" slowest {ms(max(times))}, median {ms(median(times))};"
        f" {len(result.failures) - before} oracle mismatches"
    )
    bench.unique(claimed, "mass promotion")
    api.call("configure", {})
    bench.configure()
    bench.restore()


def run_size(handler, url: str, n: int, args: argparse.Namespace, reuse: bool) -> SizeResult:
    result = SizeResult(apps=n)
    bench = Bench(handler, url, args, result)
    say()
    say(f"== {n:,} apps: {url} (load {load()})")
    if not reuse:
        build_and_upgrade(bench, n)
    bench.configure()
    bench.snapshot()
    api = ApiProcess(url)
    try:
        expected = bench.oracle()
        ((appid, _, seconds),) = api.call("claims", 1)
        bench.check(f"first claim ({ms(seconds)}, with the first promotion)", expected, appid)
        bench.sql.run("ANALYZE apps")
        bench.snapshot()
        bench.restore()
        bench.scans("the claim and the promoter")
        plan = bench.plan(
            handler.CLAIM_NEXT_APP, token=EXPLAIN_TOKEN, analyser=None, **bench.policy.sql_params()
        )
        say("   the claim's plan: " + "; ".join(x.strip() for x in plan if "Time:" in x))
        retry_tier(bench)
        latency_phase(bench, api)
        throughput_phase(bench)
        reports_phase(bench)
        path = app_status_phase(bench, api)
        http_phase(bench, path)
        bump_phase(bench, api)
        mass_phase(bench, api)
        stats = api.close()
        result.peak_rss_mb = max(result.peak_rss_mb, stats["peak_rss_mb"])
        result.boto3 = stats["boto3"]
    finally:
        api.kill()
        bench.configure()
        bench.restore()
        bench.sql.run("DROP TABLE IF EXISTS bench_snapshot")
        handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
        handler.use_runtime(None)
        bench.sql.run("VACUUM ANALYZE apps")
        bench.sql.close()
    return result


# ---------------------------------------------------------------------------------------
# Import time
# ---------------------------------------------------------------------------------------

IMPORT_HANDLER = (
    "import sys, time; t = time.perf_counter(); import handler;"
    " print(time.perf_counter() - t, 'boto3' in sys.modules)"
)
IMPORT_LIBS = (
    "import time; t = time.perf_counter(); import fastapi, mangum, pg8000.native;"
    " from aws_lambda_powertools import Logger, Metrics; print(time.perf_counter() - t)"
)


def python(code: str) -> str:
    # From bytecode (written by the first run), as a Lambda container imports the build.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "UPLOAD_PASSWORD", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
        and not k.startswith(("CURRENT_", "STALE_"))
    }
    return subprocess.run(
        [sys.executable, "-c", code], cwd=CODE, env=env, capture_output=True, text=True,
        check=True, timeout=120,
    ).stdout.strip()  # fmt: skip


def measure_imports(runs: int) -> tuple[float, float, bool]:
    """Medians of `import handler` and of its libraries alone, fresh interpreters in turn."""
    python(IMPORT_HANDLER)
    python(IMPORT_LIBS)
    handler_times, lib_times, boto3 = [], [], False
    for _ in range(runs):
        seconds, loaded = python(IMPORT_HANDLER).split()
        handler_times.append(float(seconds))
        boto3 = boto3 or loaded == "True"
        lib_times.append(float(python(IMPORT_LIBS)))
    return median(handler_times), median(lib_times), boto3


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--apps", type=int, action="append", required=True, help="apps (repeatable)")
    add("--server-url", default=claims_data.DEFAULT_SERVER, help="server for bench_<N>")
    add("--seed", type=int, default=1, help="random seed of the data (1)")
    add("--payload-bytes", type=int, default=1000, help="size of a stored analysis (1000)")
    add("--claims", type=int, default=40, help="claims per block of the latency rounds (40)")
    add("--rounds", type=int, default=25, help="latency rounds (25)")
    add("--clients", type=int, default=16, help="throughput clients (16)")
    add("--duration", type=float, default=3.0, help="throughput window, seconds (3)")
    add("--windows", type=int, default=4, help="throughput windows of each kind (4)")
    add("--import-runs", type=int, default=11, help="import timings (11)")
    add("--first-read-runs", type=int, default=5, help="new serve processes (5)")
    add("--http-claims", type=int, default=20, help="GET /queue over HTTP per serve (20)")
    add("--bump-claims", type=int, default=200, help="claims after the version bump (200)")
    add("--mass-stale-days", type=int, default=30, help="STALE_ANALYSIS_DAYS of the mass (30)")
    add("--mass-max-requests", type=int, default=2000, help="claims of the mass promotion")
    add("--no-baseline", action="store_true", help="no 10k run for growth_10k_to_1m")
    add("--reuse", action="store_true", help="measure bench_<N> as built before (no upgrade)")
    args = parser.parse_args(argv)
    if any(n < 1000 for n in args.apps):
        parser.error("--apps must be at least 1000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sorted(set(args.apps))
    if BASELINE_APPS not in sizes and not args.no_baseline:
        sizes.insert(0, BASELINE_APPS)
    if not claims_data.server_reachable(args.server_url):
        sys.path.insert(0, str(ROOT))
        import handler

        args.server_url = handler.start_embedded_postgres(ROOT / ".local" / "bench-pgdata")
        say(f"no server at the default URL; embedded PostgreSQL at {args.server_url}")
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    global CODE
    CODE = Path(tempfile.mkdtemp(prefix="bench-code-"))
    shutil.copy2(ROOT / "handler.py", CODE / "handler.py")
    for part in ("sql", "web"):
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, CODE / part)
    os.environ["BENCH_CODE_DIR"] = str(CODE)
    try:
        return run(args, sizes)
    finally:
        shutil.rmtree(CODE, ignore_errors=True)


def run(args: argparse.Namespace, sizes: list[int]) -> int:
    handler = import_handler()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h"], capture_output=True, text=True
    ).stdout.strip()
    say(f"claims benchmark at {commit}: {os.cpu_count()} CPUs, sizes {sizes}, load {load()}")
    handler_s, libs_s, boto3 = measure_imports(args.import_runs)
    say(
        f"-- import handler {handler_s * 1000:.0f} ms, its libraries {libs_s * 1000:.0f} ms"
        f" (medians of {args.import_runs}); boto3 imported: {boto3}"
    )
    server = claims_data.with_database(args.server_url, "postgres")
    results = {}
    started = time.perf_counter()
    for n in sizes:
        name = f"bench_{n}"
        url = (
            claims_data.with_database(server, name)
            if args.reuse
            else claims_data.recreate_database(server, name)
        )
        results[n] = run_size(handler, url, n, args, args.reuse)
    summary(results, handler_s / libs_s, boto3, time.perf_counter() - started)
    return 0


def interval(values: list[float]) -> tuple[float, float]:
    """A 95 % interval of the median, distribution-free (order statistics k and n-1-k,
    k = n/2 - 0.98 sqrt(n))."""
    ordered = sorted(values)
    k = max(0, int(len(ordered) / 2 - 0.98 * len(ordered) ** 0.5))
    return ordered[k], ordered[-1 - k]


def meets(value: float, op: str, limit: float) -> bool:
    return {"<=": value <= limit, ">=": value >= limit, "<": value < limit}[op]


def summary(results: dict[int, SizeResult], import_ratio: float, boto3: bool, run_s) -> None:
    largest, base = results[max(results)], results.get(BASELINE_APPS)
    floor = median(largest.floor)
    upgrade = largest.upgrade
    first_extras = [first - warm for first, warm in largest.first_reads]
    per_round = {
        kind: [ratio(r[kind], r["floor"]) for r in largest.rounds]
        for kind in ("service", "claim SQL")
    }
    figures = {
        "claim_vs_floor": median(per_round["service"]),
        "claim_sql_vs_floor": median(per_round["claim SQL"]),
        "growth_10k_to_1m": (
            ratio(median(largest.service), median(base.service)) if base else math.nan
        ),
        "throughput16_vs_floor": ratio(
            sum(largest.throughput["service"]), sum(largest.throughput["floor"])
        ),
        "import_vs_libs": import_ratio,
        "reports_max_s": max(largest.reports.values()),
        "app_status_max_ms": max(largest.app_status_ms.values()),
        "first_public_read_extra_ms": median(first_extras) * 1000,
        "http_claim_ms": median(largest.http_claims) * 1000,
        "bump_later_vs_floor": ratio(largest.bump_later, floor),
        "mass_slowest_request_ms": largest.mass.get("slowest_ms", math.nan),
        "peak_rss_mb": max(r.peak_rss_mb for r in results.values()),
        "upgrade_total_s": upgrade.total_s if upgrade else math.nan,
        "upgrade_longest_lock_s": upgrade.longest_lock_s if upgrade else math.nan,
    }
    failures = [f for r in results.values() for f in r.failures]
    boto3 = boto3 or any(r.boto3 for r in results.values())
    say()
    say(f"== at {largest.apps:,} apps (run {run_s:.0f} s, load {load()})")
    say(
        f"   claim medians: service {ms(median(largest.service))}, its SQL alone"
        f" {ms(median(largest.claim_sql))}, floor {ms(floor)}; throughput: service"
        f" {median(largest.throughput['service']):.0f}/s, floor"
        f" {median(largest.throughput['floor']):.0f}/s"
    )
    for kind, name in (("service", "claim_vs_floor"), ("claim SQL", "claim_sql_vs_floor")):
        low, high = interval(per_round[kind])
        say(
            f"   {name}: the median of {len(per_round[kind])} rounds' ratios, its 95 % interval"
            f" {low:.2f}-{high:.2f}"
        )
    say(f"   oracle, double claims, Seq Scans: {'all passed' if not failures else failures}")
    say(f"   boto3 on the API path: {'yes: MISS' if boto3 else 'no'}")
    for name, value in figures.items():
        op, limit = TARGETS[name]
        say(f"{name}={value:.3f} " + (f"target{op}{limit:g}" if op else "reported"))
    missed = [
        name
        for name, value in figures.items()
        if TARGETS[name][0] and value == value and not meets(value, *TARGETS[name])
    ]
    say(f"missed={','.join(missed) or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
