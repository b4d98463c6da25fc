"""Long operator commands at 300,000 apps: the bulk refetch in batches, and migrate's
progress, as an operator runs them (the CLI in its own process).

    python bench/operations.py [--apps 300000] [--server-url URL]

Two databases, made afresh on the server (an embedded PostgreSQL is started when nothing
answers at the default URL), with --apps analysed apps generated inside PostgreSQL:

refetch (bench_ops_refetch): migrated, then
  1. the old way, for comparison: the whole selection in one transaction under the
     API's statement timeout (STATEMENT_TIMEOUT_MS, 5 s), rolled back either way;
  2. the batched walk as a dry run in this process, under tracemalloc: Python's peak;
  3. `queue-refetch --apply --yes`: wall time, batches (its last progress line), the
     process's peak RSS (ru_maxrss from wait4), and that every app is queued.
migrate (bench_ops_migrate): the ledger up to 012, the apps (all analysed 400 days ago:
  stale under the default policy), then `migrate`: its progress lines (each file's
  duration, the promotion's slices, VACUUM), wall time, peak RSS.

It prints what it measures, then `name=value` lines.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import claims_db  # noqa: E402

os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

FILL = """
INSERT INTO apps (appid, details, analysis, analysisversion, analysed, status)
SELECT 'com.bench.app' || lpad(n::text, 7, '0'),
       jsonb_build_object('title', 'App ' || n, 'reviews', (n::bigint * 7919 % 100000)::text),
       '{"success": true, "trackers": {"Google Firebase Analytics": "Google"}}', 4,
       now() - interval '400 days', 'analysed'
FROM generate_series(1, :count) n
"""


def say(text: str) -> None:
    print(text, flush=True)


def fresh_database(server_url: str, name: str, count: int, ledger_dir: Path | None) -> str:
    import handler

    url = claims_db.recreate_database(server_url, name)
    db = handler.SharedConnection(
        lambda: handler.connection_arguments(handler.load_settings({"DATABASE_URL": url}))
    )
    try:
        handler.apply_migrations(db, directory=ledger_dir)
    finally:
        db.discard()
    sql = claims_db.connect(url)
    try:
        started = time.monotonic()
        sql.run(FILL, count=count)
        sql.run("VACUUM (ANALYZE) apps")
        say(f"{name}: {count} analysed apps in {time.monotonic() - started:.1f} s")
    finally:
        sql.close()
    return url


# The command runs as a grandchild: a child's ru_maxrss starts at its parent's resident
# size when it forks (Linux keeps it across exec), and this process holds a lot by then.
# This small intermediate forks the command and reports its exit code and peak RSS.
MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def run_cli(url: str, *args: str) -> tuple[float, int, str, int]:
    """(wall seconds, exit code, stderr, peak RSS in KiB) of `handler.py ARGS`; stdout
    (one line per app) is discarded."""
    with tempfile.TemporaryFile(mode="w+") as errors:
        started = time.monotonic()
        measured = subprocess.run(
            [sys.executable, "-c", MEASURE, sys.executable, str(ROOT / "handler.py"), *args],
            env={**os.environ, "DATABASE_URL": url},
            stdout=subprocess.PIPE,
            stderr=errors,
            cwd=ROOT,
            text=True,
            check=True,
        )
        elapsed = time.monotonic() - started
        code, rss = (int(value) for value in measured.stdout.split())
        errors.seek(0)
        return elapsed, code, errors.read(), rss


def bench_refetch(server_url: str, count: int) -> dict[str, str]:
    import handler

    url = fresh_database(server_url, "bench_ops_refetch", count, None)
    handler.use_runtime(handler.Runtime(handler.load_settings({"DATABASE_URL": url})))
    db = handler.api_connection()
    figures: dict[str, str] = {}

    # 1. The old way: one transaction over the whole selection.
    started = time.monotonic()

    def everything(session: handler.Session) -> None:
        policy = handler.QueuePolicy()
        selection = handler.RefetchRequest().selection()
        rule = {**policy.sql_params(), "force": False, **selection}
        rows = session.records(handler.REFETCH_SELECT_ANALYSED, limit=None, **rule)
        handler.refetch_apps(
            session, rows, handler.REFETCH_LOCK_ANALYSED, policy, False, **selection
        )
        raise RuntimeError("rolled back on purpose")

    try:
        db.transaction(everything)
    except RuntimeError:
        outcome = "completed (rolled back)"
    except Exception as error:
        outcome = f"failed: {handler.cli_error_line(error)[:80]}"
    old_seconds = time.monotonic() - started
    say(f"old single transaction: {outcome} after {old_seconds:.1f} s")
    figures["old_single_transaction_seconds"] = f"{old_seconds:.1f}"
    figures["old_single_transaction"] = outcome.split(":")[0].split(" (")[0]

    # 2. The batched walk, dry, in process: Python's peak memory.
    tracemalloc.start()
    started = time.monotonic()
    progress = handler.refetch_in_batches(db, handler.RefetchRequest(), lambda *_: None)
    walk_seconds = time.monotonic() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    say(
        f"dry walk in process: {progress.selected} selected in {progress.batches} batches,"
        f" {walk_seconds:.1f} s, Python peak {peak / 1e6:.1f} MB"
    )
    figures.update(
        dry_walk_seconds=f"{walk_seconds:.1f}",
        dry_walk_batches=str(progress.batches),
        dry_walk_python_peak_mb=f"{peak / 1e6:.1f}",
    )
    handler.use_runtime(None)

    # 3. The operator's command.
    seconds, code, errors, rss = run_cli(url, "queue-refetch", "--apply", "--yes")
    last = [line for line in errors.splitlines() if line.startswith("queue-refetch:")]
    say(f"queue-refetch --apply --yes: exit {code}, {seconds:.1f} s, peak RSS {rss / 1024:.0f} MB")
    say(f"  {last[-1] if last else errors.strip()[-300:]}")
    batches = re.search(r"(\d+) batches committed", last[-1] if last else "")
    sql = claims_db.connect(url)
    try:
        ((queued,),) = sql.run("SELECT count(*) FROM apps WHERE status = 'queued'")
        ((history,),) = sql.run("SELECT count(*) FROM app_analyses")
    finally:
        sql.close()
    say(f"  queued now: {queued} of {count}; history rows: {history}")
    figures.update(
        refetch_exit=str(code),
        refetch_seconds=f"{seconds:.1f}",
        refetch_batches=batches.group(1) if batches else "?",
        refetch_peak_rss_mb=f"{rss / 1024:.0f}",
        refetch_queued=str(queued),
    )
    return figures


def bench_migrate(server_url: str, count: int) -> dict[str, str]:
    import handler

    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as scratch:
        ledger_dir = Path(scratch)
        for path in sorted(handler.SQL_DIR.glob("*.sql")):
            if path.name[:3] <= "012":
                shutil.copy(path, ledger_dir / path.name)
        url = fresh_database(server_url, "bench_ops_migrate", count, ledger_dir)
    seconds, code, errors, rss = run_cli(url, "migrate")
    lines = [line for line in errors.splitlines() if not line.startswith("{")]
    say(f"migrate: exit {code}, {seconds:.1f} s, peak RSS {rss / 1024:.0f} MB; its lines:")
    for line in lines:
        say(f"  {line}")
    slices = [line for line in lines if line.startswith("promotion:")]
    vacuum = next((line for line in lines if line.startswith("VACUUM")), "")
    return {
        "migrate_exit": str(code),
        "migrate_seconds": f"{seconds:.1f}",
        "migrate_progress_lines": str(len(lines)),
        "migrate_promotion_lines": str(len(slices)),
        "migrate_vacuum": vacuum.split(": ", 1)[-1],
        "migrate_peak_rss_mb": f"{rss / 1024:.0f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--apps", type=int, default=300_000, help="apps (300000)")
    parser.add_argument(
        "--server-url",
        default=claims_db.DEFAULT_SERVER,
        help="server for the bench_ops_* databases (an embedded PostgreSQL is started when"
        " nothing answers there)",
    )
    args = parser.parse_args(argv)
    if not claims_db.server_reachable(args.server_url):
        import handler

        args.server_url = handler.start_embedded_postgres(ROOT / ".local" / "bench-pgdata")
        say(f"no server at the default URL; embedded PostgreSQL at {args.server_url}")
    figures = {"apps": str(args.apps)}
    figures.update(bench_refetch(args.server_url, args.apps))
    figures.update(bench_migrate(args.server_url, args.apps))
    for name, value in figures.items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
