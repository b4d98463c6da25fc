"""The operators' web view at a million apps, timed through handler.api.

    python3 bench/web_view.py [--apps 1000000] [--runs 7] [--server-url URL] [--reuse]

1. The database `bench_web_<N>`: built as bench/claims.py builds its own (ledger state 006,
   bench/claims_data.py), upgraded to the head by handler.migrate as a deploy runs it,
   then VACUUM ANALYZE. --reuse measures the one a run left.
2. Seeded once: ANALYSERS named analysers, a week of their results (RESULTS_PER_HOUR an
   hour, 5 % failures, 1 % leases the back-off ended) in app_analyses, and 90 days of the
   report's hourly snapshots (the most queue_snapshots ever holds).
3. Timed through handler.api with API Gateway events and the admin token, ADMIN_WEB=full:
   the median of --runs after one warm-up, in ms, of every page's JSON: the overview's
   status and history counted (the process's cache cleared before each) and cached, the
   apps list (first page, failed apps, a prefix, a search inside bundle IDs), one app's
   story, the record of actions, the analysers, the admin API's OpenAPI document.
4. The report's extra work: handler.keep_queue_snapshot (the snapshot and the pruning)
   beside the report's count, and the size of queue_snapshots at its 90 days.

Ends with `name=value target` lines (docs/benchmarks.md, "The web view").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import claims
import claims_data
import claims_upgrade

ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "bench-admin-token"
ANALYSERS = 20
RESULTS_PER_HOUR = 300
PAGE_TARGET_MS = 50.0
CACHED_TARGET_MS = 5.0
# Counted at most once a minute per process: the overview's counts, as the report counts.
COUNTED_TARGET_MS = 5000.0
REPORT_EXTRA_TARGET_MS = 50.0

SEED_HISTORY = f"""
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, success, analyser,
                          analysis_source)
SELECT appid, json_build_object('success', outcome > 0.06), 4, at, outcome > 0.06,
       CASE WHEN outcome > 0.01 THEN 'pi-' || (1 + (random() * {ANALYSERS - 1})::int) END,
       CASE WHEN outcome <= 0.01 THEN 'queue-server' END
FROM (SELECT appid, random() AS outcome,
             now() - random() * interval '7 days' AS at
      FROM apps TABLESAMPLE SYSTEM (:percent)) AS drawn
ON CONFLICT DO NOTHING
"""
SEED_SNAPSHOTS = """
INSERT INTO queue_snapshots (hour, states, backlog, failed)
SELECT hour,
       jsonb_build_object('queued', 200000 + n, 'processing', 20, 'analysed', 700000 - n,
                          'failed', 90000),
       jsonb_build_object('queued', 200000 + n, 'lease_expired', 3, 'outdated_version', n,
                          'stale', 40000, 'retry_failed', 12, 'retry_due', 7),
       jsonb_build_object('app_not_found', 60000, 'analysis_failed', 25000,
                          'ipa_too_large', 5000)
FROM generate_series(1, 24 * 90) AS n,
     LATERAL (SELECT date_trunc('hour', now()) - make_interval(hours => n) AS hour) AS h
ON CONFLICT DO NOTHING
"""


def api_event(path: str, query: str = "") -> dict:
    event = claims.gateway_event(path, ADMIN_TOKEN)
    event["rawQueryString"] = query
    return event


def seed(handler, sql, n: int) -> None:
    if sql.run("SELECT count(*) FROM queue_snapshots")[0][0] >= 24 * 90:
        claims.say("-- seeded before: the analysers, a week of results, 90 days of snapshots")
        return
    started = time.perf_counter()
    operator = handler.Operator("bench", "bench")
    for number in range(1, ANALYSERS + 1):
        handler.add_analyser(handler.api_connection(), operator, f"pi-{number}")
    percent = min(100.0, 100.0 * RESULTS_PER_HOUR * 24 * 7 / n)
    sql.run(SEED_HISTORY, percent=percent)
    sql.run(SEED_SNAPSHOTS)
    sql.run("VACUUM ANALYZE app_analyses")
    sql.run("VACUUM ANALYZE queue_snapshots")
    claims.say(f"-- seeded in {time.perf_counter() - started:.1f} s")


def timed(handler, context, path: str, query: str = "", clear: bool = False, runs: int = 7):
    """The median ms of `runs` answers (after one warm-up); the cache cleared before each
    when `clear`. Fails on any answer but 200."""
    times = []
    for run in range(runs + 1):
        if clear:
            handler.runtime().cached.clear()
        started = time.perf_counter()
        answer = handler.api(api_event(path, query), context)
        elapsed = (time.perf_counter() - started) * 1000
        if answer["statusCode"] != 200:
            raise RuntimeError(f"{path}?{query}: {answer['statusCode']} {answer['body'][:300]}")
        if run:
            times.append(elapsed)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--apps", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--server-url", default=claims_data.DEFAULT_SERVER)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reuse", action="store_true", help="measure bench_web_<N> as left")
    args = parser.parse_args(argv)
    n = args.apps
    url = claims_data.bench_database(args.server_url, f"bench_web_{n}", args.reuse)
    claims.say(f"web view benchmark: {n:,} apps, {url}, load {claims.load()}")
    sql = claims_data.connect(url)
    if not args.reuse:
        started = time.perf_counter()
        claims_data.build_legacy_database(sql, ROOT / "sql", n, args.seed, 1000)
        claims.say(f"-- built at ledger 006 in {time.perf_counter() - started:.1f} s")
    claims.service_env(url, {"ADMIN_TOKEN": ADMIN_TOKEN, "ADMIN_WEB": "full"})
    handler = claims.import_handler()
    handler.use_runtime(None)
    started = time.perf_counter()
    claims_upgrade.run_ledger(handler)
    claims.say(f"-- the ledger to its head in {time.perf_counter() - started:.1f} s")
    sql.run("VACUUM ANALYZE apps")
    seed(handler, sql, n)
    context = handler.LocalContext(25, "bench-api")
    app_id = sql.run(
        "SELECT appid FROM app_analyses GROUP BY appid ORDER BY count(*) DESC LIMIT 1"
    )[0][0]
    runs = args.runs
    pages = {
        "status_counted": ("/admin/api/status", "", True, COUNTED_TARGET_MS),
        "status_cached": ("/admin/api/status", "", False, CACHED_TARGET_MS),
        "history_7d_counted": ("/admin/api/history", "window=7d", True, COUNTED_TARGET_MS),
        "history_24h_counted": ("/admin/api/history", "window=24h", True, COUNTED_TARGET_MS),
        "history_7d_cached": ("/admin/api/history", "window=7d", False, CACHED_TARGET_MS),
        "apps_first": ("/admin/api/apps", "", False, PAGE_TARGET_MS),
        "apps_failed": ("/admin/api/apps", "state=failed", False, PAGE_TARGET_MS),
        "apps_prefix": ("/admin/api/apps", "q=com.", False, PAGE_TARGET_MS),
        "apps_contains": ("/admin/api/apps", "has=photo", False, PAGE_TARGET_MS),
        "app_story": (f"/admin/api/apps/{app_id}", "", False, PAGE_TARGET_MS),
        "actions": ("/admin/api/actions", "", False, PAGE_TARGET_MS),
        "analysers": ("/admin/api/analysers", "", False, PAGE_TARGET_MS),
        "openapi": ("/admin/api/openapi.json", "", False, PAGE_TARGET_MS),
    }
    figures: dict[str, tuple[float, float]] = {}
    for figure, (path, query, clear, target) in pages.items():
        counted = 3 if clear else runs  # a count takes seconds: fewer runs
        figures[f"{figure}_ms"] = (timed(handler, context, path, query, clear, counted), target)
        claims.say(f"   {figure:<22}{figures[f'{figure}_ms'][0]:10.1f} ms  (target <= {target})")

    db, policy = handler.api_connection(), handler.settings().policy
    started = time.perf_counter()
    status = handler.queue_status(db, policy)
    count_ms = (time.perf_counter() - started) * 1000
    sql.run("DELETE FROM queue_snapshots WHERE hour = date_trunc('hour', now())")
    started = time.perf_counter()
    handler.keep_queue_snapshot(db, status)
    extra_ms = (time.perf_counter() - started) * 1000
    size = sql.run("SELECT pg_total_relation_size('queue_snapshots')")[0][0]
    rows = sql.run("SELECT count(*) FROM queue_snapshots")[0][0]
    claims.say(
        f"-- the report: its count {count_ms:.0f} ms, the snapshot and pruning {extra_ms:.1f} ms"
        f"; queue_snapshots {rows} rows, {size / 1024:.0f} kB"
    )
    figures["report_extra_ms"] = (extra_ms, REPORT_EXTRA_TARGET_MS)
    handler.use_runtime(None)
    sql.close()
    claims.say()
    missed = 0
    for figure, (value, target) in figures.items():
        met = value <= target
        missed += not met
        claims.say(f"{figure}={value:.1f} target<={target:g} {'met' if met else 'MISSED'}")
    claims.say(f"report_count_ms={count_ms:.0f}")
    claims.say(f"history_rows={rows}")
    claims.say(f"history_kb={size / 1024:.0f}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
