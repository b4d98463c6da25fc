"""Time the upgrade through the real ledger runner, and how long apps is locked.

The upgrade runs as a deploy runs it: handler.migrate, the CloudFormation custom
resource, with a Create event (no ResponseURL) and the migration function's 600 s.
Meanwhile other sessions play the previous release:
* a reader (SELECT one app by bundle ID, as its GET /apps/:id did),
* an updater (UPDATE one queued app, as its nextApp and uploads did; rolled back),
* an inserter (INSERT a new app, as its addApp did; rolled back),
each back to back, PROBE_INTERVAL apart: a probe's latency is how long that statement
was blocked. A monitor samples, every MONITOR_INTERVAL, the locks on apps granted to the
service's sessions and the file being run (pg_stat_activity shows the file's text), and
the ledger (a file's row appears when its transaction commits).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from claims_data import connect

PROBE_INTERVAL = 0.005
MONITOR_INTERVAL = 0.02
STALL = 0.05  # a probe slower than this was blocked
MIGRATION_TIMEOUT_SECONDS = 600  # the migration function's Timeout (template.yaml)
LOCK_ORDER = (
    "AccessShareLock",
    "RowShareLock",
    "RowExclusiveLock",
    "ShareUpdateExclusiveLock",
    "ShareLock",
    "ShareRowExclusiveLock",
    "ExclusiveLock",
    "AccessExclusiveLock",
)
# Lock modes on apps that block the previous release's plain reads / its writes.
BLOCKS_READS = {"AccessExclusiveLock"}
BLOCKS_WRITES = {"ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock"}


class Probe(threading.Thread):
    def __init__(self, url: str, kind: str, statements: list[str], stop: threading.Event):
        super().__init__(daemon=True, name=f"probe-{kind}")
        self.url, self.kind, self.statements, self.stop = url, kind, statements, stop
        self.samples: list[tuple[float, float]] = []  # (started, seconds)
        self.error: str | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        connection = connect(self.url, f"bench-probe-{self.kind}")
        connection.run("SET statement_timeout = '15min'")
        self.ready.set()
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    for statement in self.statements:
                        connection.run(statement)
                except Exception as error:  # a probe must not end the measurement
                    self.error = f"{type(error).__name__}: {error}"
                    try:
                        connection.run("ROLLBACK")
                    except Exception:
                        connection = connect(self.url, f"bench-probe-{self.kind}")
                self.samples.append((started, time.monotonic() - started))
                time.sleep(PROBE_INTERVAL)
        finally:
            connection.close()

    def stalls(self) -> list[tuple[float, float]]:
        """(started, seconds) of the probes that were blocked."""
        return [(t, s) for t, s in self.samples if s > STALL]


class Monitor(threading.Thread):
    def __init__(self, url: str, files: dict[str, str], stop: threading.Event):
        super().__init__(daemon=True, name="lock-monitor")
        self.url, self.stop = url, stop
        self.prefixes = {name: text.strip()[:120] for name, text in files.items()}
        self.samples: list[tuple[float, frozenset[str], str | None]] = []
        self.commits: dict[str, float] = {}
        self.ready = threading.Event()

    def run(self) -> None:
        connection = connect(self.url, "bench-lock-monitor")
        connection.run("SET lock_timeout = '50ms'")
        (apps_oid,) = connection.run("SELECT 'apps'::regclass::oid")[0]
        self.commits = {f: 0.0 for (f,) in connection.run("SELECT filename FROM schema_migrations")}
        self.ready.set()
        label = None
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                # Every session of this database but the benchmark's own: the runner.
                rows = connection.run(
                    """SELECT a.query,
                              (SELECT array_agg(l.mode) FROM pg_locks l
                               WHERE l.pid = a.pid AND l.relation = :oid AND l.granted)
                       FROM pg_stat_activity a
                       WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                         AND a.application_name NOT LIKE 'bench-%'""",
                    oid=apps_oid,
                )
                modes: set[str] = set()
                for query, held in rows:
                    text = (query or "").strip()
                    label = next((n for n, p in self.prefixes.items() if text.startswith(p)), label)
                    modes.update(held or ())
                self.samples.append((now, frozenset(modes), label))
                try:
                    for (name,) in connection.run("SELECT filename FROM schema_migrations"):
                        self.commits.setdefault(name, time.monotonic())
                except Exception:  # noqa: S110 - the runner holds the ledger for a moment
                    pass
                time.sleep(MONITOR_INTERVAL)
        finally:
            connection.close()

    def label_at(self, moment: float) -> str | None:
        """The file the runner was running at a moment (the last sample before it)."""
        label = None
        for t, _, sample_label in self.samples:
            if t > moment:
                break
            label = sample_label or label
        return label

    def longest_hold(self, modes: set[str], name: str) -> float:
        """Longest run of consecutive samples of a file holding any of modes."""
        longest, run_start = 0.0, None
        for t, held, label in self.samples:
            if label == name and held & modes:
                run_start = t if run_start is None else run_start
                longest = max(longest, t - run_start + MONITOR_INTERVAL)
            else:
                run_start = None
        return longest

    def strongest(self, name: str) -> str:
        seen = set().union(*(held for _, held, label in self.samples if label == name))
        ranked = [m for m in LOCK_ORDER if m in seen]
        return ranked[-1] if ranked else "-"


@dataclasses.dataclass
class FileTiming:
    name: str
    seconds: float
    strongest_lock: str
    reads_blocked_s: float
    writes_blocked_s: float
    ae_held_s: float
    write_blocking_held_s: float


@dataclasses.dataclass
class UpgradeResult:
    total_s: float
    entry: str
    after_files_s: float  # from the last file's commit to the end (a promotion, say)
    applied: list[str]
    files: list[FileTiming]
    reads_blocked_s: float
    writes_blocked_s: float
    reads_blocked_total_s: float
    writes_blocked_total_s: float
    probe_errors: list[str]

    @property
    def longest_lock_s(self) -> float:
        return max(self.reads_blocked_s, self.writes_blocked_s)


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, seconds) intervals."""
    total, end = 0.0, float("-inf")
    for start, seconds in sorted(intervals):
        stop = start + seconds
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def run_ledger(handler) -> tuple[str, list[str]]:
    """The deploy's migration step: handler.migrate as CloudFormation invokes it."""
    event = {
        "RequestType": "Create",
        "RequestId": "bench",
        "StackId": "bench",
        "LogicalResourceId": "MigrationResource",
        "ResourceProperties": {"FunctionVersion": "1"},
    }
    reply = handler.migrate(event, handler.LocalContext(MIGRATION_TIMEOUT_SECONDS))
    if reply.get("Status") != "SUCCESS":
        raise RuntimeError(f"handler.migrate answered {reply.get('Status')}: {reply.get('Reason')}")
    applied = reply.get("Data", {}).get("Applied", "none")
    return "handler.migrate (Create event)", [] if applied == "none" else applied.split(",")


def measure_upgrade(
    handler, url: str, sql_dir: Path, read_appid: str, write_appid: str
) -> UpgradeResult:
    """Run the ledger over a 006 database, as a deploy does, with the previous release's
    probes running."""
    stop = threading.Event()
    reader = Probe(url, "read", [f"SELECT appid FROM apps WHERE appid = '{read_appid}'"], stop)
    updater = Probe(
        url,
        "update",
        ["BEGIN", f"UPDATE apps SET added = added WHERE appid = '{write_appid}'", "ROLLBACK"],
        stop,
    )
    inserter = Probe(
        url,
        "insert",
        ["BEGIN", "INSERT INTO apps (appid) VALUES ('com.bench.probe.insert')", "ROLLBACK"],
        stop,
    )
    handler.use_runtime(None)
    files = {path.name: path.read_text() for path in sorted(sql_dir.glob("*.sql"))}
    monitor = Monitor(url, files, stop)
    threads = [reader, updater, inserter, monitor]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.ready.wait(30)
    time.sleep(0.1)
    started = time.monotonic()
    try:
        entry, applied = run_ledger(handler)
        finished = time.monotonic()
    finally:
        time.sleep(0.2)
        stop.set()
        for thread in threads:
            thread.join(60)
        handler.use_runtime(None)

    def longest(probes: list[Probe], name: str | None = None) -> float:
        return max(
            (
                seconds
                for probe in probes
                for begun, seconds in probe.stalls()
                if name is None or monitor.label_at(begun + STALL) == name
            ),
            default=0.0,
        )

    writers = [updater, inserter]
    timings: list[FileTiming] = []
    window_start = started
    for name in sorted(monitor.commits):
        committed = monitor.commits[name]
        if committed < started:
            continue
        timings.append(
            FileTiming(
                name=name,
                seconds=committed - window_start,
                strongest_lock=monitor.strongest(name),
                reads_blocked_s=longest([reader], name),
                writes_blocked_s=longest(writers, name),
                ae_held_s=monitor.longest_hold(BLOCKS_READS, name),
                write_blocking_held_s=monitor.longest_hold(BLOCKS_WRITES, name),
            )
        )
        window_start = committed
    return UpgradeResult(
        total_s=finished - started,
        entry=entry,
        after_files_s=max(0.0, finished - window_start),
        applied=applied,
        files=timings,
        reads_blocked_s=longest([reader]),
        writes_blocked_s=longest(writers),
        reads_blocked_total_s=_union(reader.stalls()),
        writes_blocked_total_s=_union([s for p in writers for s in p.stalls()]),
        probe_errors=[
            f"{p.kind}: {p.error}" for p in (reader, updater, inserter) if p.error is not None
        ],
    )
