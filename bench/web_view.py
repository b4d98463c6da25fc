"""The operators' web view (ADMIN_WEB) at a million apps, timed through handler.api.

    python3 bench/web_view.py [--apps 1000000] [--runs 7] [--server-url URL]
                              [--reuse] [--drop] [--seed 1]

1. The database `bench_web_<N>` on the server (default
   postgresql://postgres@127.0.0.1:5432/postgres; it must allow CREATE DATABASE): built
   as bench/claims.py builds its own (bench/claims_data.py: ledger state 006, the
   production-like draws, a fixed seed), then upgraded to the head of the ledger by the
   real runner, handler.migrate with a CloudFormation Create event as a deploy runs it
   (bench/claims_upgrade.py), so 026-028 and their indexes are built as in production;
   then VACUUM ANALYZE, as autovacuum would have. --reuse measures the `bench_web_<N>`
   a run left (the ledger runs over it all the same: nothing to do at the head); --drop
   drops it at the end.
2. Operator actions, once per database: a year of them in SQL (refetches of random apps,
   sign-ins, refused sign-ins), STORY_ACTIONS more on the app whose story is timed
   (handler.act), and one bulk refetch through POST /admin/api/refetch (the
   first 1,000 failed apps of the most common failure reason), timed.
3. Timed in this process through handler.api, the Lambda entry point, with API Gateway
   (HTTP API, payload 2.0) events and the bearer admin token, ADMIN_WEB=full: medians of
   --runs after one warm-up, in milliseconds:
   * GET /admin/api/status uncached (the queue-status count; the process's cache cleared
     before each) and cached (target <= 5 ms);
   * GET /admin/api/apps: the first page unfiltered, of each state, of failed apps of
     the most common and of the rarest failure reason, of a bundle-ID prefix (`q=`),
     and a page 90 % of the way through the list (`after=`) (target <= 50 ms each);
   * GET /admin/api/apps/{appId}: the story of the app with the most history (<= 50 ms);
   * the selection of a bulk refetch (handler.apps_page with limit=1000, the select
     only) for each of the two reasons, and for all failed apps (reported).
4. EXPLAIN (ANALYZE, BUFFERS) of each page's statement as the API connection plans it
   (the lists with their values, as handler.apps_page does; the story's statements
   generically), summed up in one line: the scans and indexes, rows removed by filter,
   buffers, any Sort or Seq Scan, execution time; a list must read no whole table. For a
   page over its target, the whole plan.

Ends with `name=value` lines. handler.py is not changed by it; the figures of a run go
to docs/benchmarks.md (#the-web-view).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import quote, urlencode

import claims_data
import claims_db
import claims_upgrade
import pg8000.native

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ADMIN_TOKEN = "bench-admin-token"
UPLOAD_PASSWORD = "bench-upload-password"
# The synthetic record of a year of operator actions (SQL), and the actions on the app
# whose story is timed (through handler.act).
ACTION_REFETCHES = 100_000
ACTION_SIGN_INS = 2_000
STORY_ACTIONS = 120
PAGE_TARGET_MS = 50.0
CACHED_TARGET_MS = 5.0
UNCACHED_RUNS = 3


def say(text: str = "") -> None:
    print(text, flush=True)


def event(method: str, path: str, query: str = "", body: str | None = None) -> dict:
    """What API Gateway (HTTP API, payload format 2.0) hands the API function."""
    now = time.time()
    headers = {
        "accept": "application/json",
        "authorization": f"Bearer {ADMIN_TOKEN}",
        "host": "bench.execute-api.us-east-1.amazonaws.com",
        "user-agent": "curl/7.88.1",
        "x-forwarded-for": "203.0.113.9",
        "x-forwarded-port": "443",
        "x-forwarded-proto": "https",
    }
    if body is not None:
        headers["content-type"] = "application/json"
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": query,
        "headers": headers,
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "bench",
            "domainName": "bench.execute-api.us-east-1.amazonaws.com",
            "domainPrefix": "bench",
            "http": {
                "method": method,
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": "203.0.113.9",
                "userAgent": "curl/7.88.1",
            },
            "requestId": "bench",
            "routeKey": "$default",
            "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)),
            "timeEpoch": int(now * 1000),
        },
        "body": body,
        "isBase64Encoded": False,
    }


# -- the database


def prepare(args: argparse.Namespace, handler) -> tuple[str, pg8000.native.Connection]:
    name = f"bench_web_{args.apps}"
    server = claims_db.with_database(args.server_url, "postgres")
    if args.reuse:
        url = claims_db.with_database(server, name)
        sql = claims_db.connect(url, "bench-web")
        sql.run("SET statement_timeout = '10min'")
        say(f"-- reusing {name}")
    else:
        url = claims_db.recreate_database(server, name)
        sql = claims_db.connect(url, "bench-web")
        sql.run("SET statement_timeout = '10min'")
        say(f"-- build: {args.apps:,} apps at ledger state 006 in {name}, seed {args.seed}")
        started = time.perf_counter()
        steps = claims_data.build_legacy_database(sql, ROOT / "sql", args.apps, args.seed, 1000)
        for step, seconds in steps:
            say(f"   {step:<42}{seconds:8.2f} s")
        say(f"   build total {time.perf_counter() - started:.1f} s")
    configure(url)
    say("-- the ledger to its head: handler.migrate (a CloudFormation Create event)")
    started = time.perf_counter()
    entry, applied = claims_upgrade.run_ledger(handler)
    say(f"   {entry}: applied {', '.join(applied) or 'nothing'}")
    say(f"   upgrade {time.perf_counter() - started:.1f} s")
    return url, sql


def configure(url: str) -> None:
    os.environ.update(
        DATABASE_URL=url,
        ADMIN_TOKEN=ADMIN_TOKEN,
        UPLOAD_PASSWORD=UPLOAD_PASSWORD,
        ADMIN_WEB="full",
    )
    for name in ("CURRENT_ANALYSIS_VERSION", "STALE_ANALYSIS_DAYS", "PROCESSING_TIMEOUT_MINUTES"):
        os.environ.pop(name, None)
    import handler

    handler.use_runtime(None)


ACTIONS_SQL = """
INSERT INTO operator_actions (at, actor, source, action, app_id, outcome)
SELECT now() - random() * interval '365 days', 'session ' || substr(md5(i::text), 1, 12),
       '203.0.113.' || (i % 200), 'refetch', appid, 'queued'
FROM (SELECT appid, row_number() OVER () AS i
      FROM (SELECT appid FROM apps ORDER BY random() LIMIT :count) picked) p
"""
SIGN_INS_SQL = """
INSERT INTO operator_actions (at, actor, source, action)
SELECT now() - random() * interval '365 days',
       CASE WHEN i % 10 = 0 THEN 'sign-in' ELSE 'session ' || substr(md5(i::text), 1, 12) END,
       '203.0.113.' || (i % 200), CASE WHEN i % 10 = 0 THEN 'sign-in refused' ELSE 'sign-in' END
FROM generate_series(1, :count) AS i
"""


def story_app(sql) -> str:
    """The app with the most history rows (the longest story), a valid bundle ID."""
    (appid,) = sql.run(
        """SELECT h.appid FROM app_analyses h JOIN apps a ON a.appid = h.appid
           WHERE h.appid ~ '^[A-Za-z0-9][A-Za-z0-9.-]*[A-Za-z0-9]$'
           GROUP BY h.appid ORDER BY count(*) DESC, h.appid LIMIT 1"""
    )[0]
    return appid


def add_actions(handler, sql, story: str, common_reason: str) -> dict[str, float]:
    """A year of operator actions, once per database; returns the bulk refetch's time."""
    (present,) = sql.run("SELECT count(*) FROM operator_actions")[0]
    if present >= ACTION_REFETCHES:
        say(f"-- operator actions: {present:,} already recorded (a run before added them)")
        return {}
    say("-- operator actions")
    started = time.perf_counter()
    sql.run("SELECT setseed(0.5)")
    sql.run(ACTIONS_SQL, count=ACTION_REFETCHES)
    sql.run(SIGN_INS_SQL, count=ACTION_SIGN_INS)
    operator = handler.Operator(actor="session 0123456789ab", source="203.0.113.9")
    db = handler.api_connection()
    for i in range(STORY_ACTIONS):
        record = handler.ActionRecord(
            ("refetch", "force refetch", "sign-in")[i % 3], [(story, "queued")]
        )
        handler.act(db, operator, lambda session, record=record: (None, record))
    say(
        f"   {ACTION_REFETCHES:,} refetches of random apps and {ACTION_SIGN_INS:,} sign-ins"
        f" (SQL), {STORY_ACTIONS} actions on {story} (handler.act):"
        f" {time.perf_counter() - started:.1f} s"
    )
    body = json.dumps({"filter": {"state": "failed", "reason": common_reason}})
    started = time.perf_counter()
    answer = handler.api(event("POST", "/admin/api/refetch", body=body), context(handler))
    elapsed = (time.perf_counter() - started) * 1000
    if answer["statusCode"] != 200:
        raise SystemExit(f"the bulk refetch answered {answer['statusCode']}: {answer['body']}")
    done = json.loads(answer["body"])
    say(
        f"   bulk refetch (POST /admin/api/refetch, failed, reason {common_reason}):"
        f" {elapsed:.0f} ms, selected {done['selected']}, outcomes {done['outcomes']}"
    )
    return {"bulk_refetch_ms": elapsed}


def vacuum(sql) -> None:
    started = time.perf_counter()
    for table in ("apps", "app_analyses", "operator_actions"):
        sql.run(f"VACUUM ANALYZE {table}")
    elapsed = time.perf_counter() - started
    say(f"-- VACUUM ANALYZE apps, app_analyses, operator_actions: {elapsed:.1f} s")


# -- timing


def context(handler):
    return handler.LocalContext(25, "analysis-queue-ApiFunction")


def time_request(handler, path: str, query: str, runs: int, before=None) -> tuple[float, dict]:
    """The median of `runs` requests through handler.api after one warm-up (ms), and the
    last answer's body; `before()` runs ahead of each request, untimed."""
    seconds, answer = [], None
    for run in range(runs + 1):
        if before:
            before()
        started = time.perf_counter()
        answer = handler.api(event("GET", path, query), context(handler))
        elapsed = time.perf_counter() - started
        if answer["statusCode"] != 200:
            say(f"   !! GET {path}?{query} answered {answer['statusCode']}: {answer['body'][:300]}")
            return math.nan, {}
        if run:
            seconds.append(elapsed)
    return statistics.median(seconds) * 1000, json.loads(answer["body"])


def time_call(work, runs: int) -> tuple[float, object]:
    seconds, result = [], None
    for run in range(runs + 1):
        started = time.perf_counter()
        result = work()
        if run:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1000, result


# -- plans


def explain(sql, statement: str, params: dict, generic: bool = True) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of a statement as the API connection runs it: prepared,
    and planned generically (generic=False: with its values, a custom plan)."""
    text, make_values = pg8000.native.to_statement(statement)
    values = ", ".join(pg8000.native.literal(v) for v in make_values(params))
    mode = "force_generic_plan" if generic else "force_custom_plan"
    sql.run("BEGIN")
    try:
        sql.run(f"SET LOCAL plan_cache_mode = {mode}")
        sql.run(f"PREPARE bench_web_plan AS {text}")
        return [
            r[0] for r in sql.run(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_web_plan({values})")
        ]
    finally:
        sql.run("ROLLBACK")
        sql.run("DEALLOCATE ALL")


def summary(lines: list[str]) -> tuple[str, bool, bool]:
    """One line: the plan's nodes, rows removed by filter, the top node's buffers,
    execution time; whether it sorts, and whether it reads a whole table (Seq Scan)."""
    nodes = [
        line.strip().removeprefix("->").strip().split("  (cost=")[0]
        for line in lines
        if "(cost=" in line
    ]
    removed = sum(int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", "\n".join(lines)))
    buffers = next((line.strip() for line in lines if line.strip().startswith("Buffers:")), "")
    execution = next(
        (line.split(":")[1].strip() for line in lines if line.startswith("Execution Time")), "?"
    )
    sorts = any(node.startswith(("Sort", "Incremental Sort")) for node in nodes)
    seq_scan = any("Seq Scan" in node for node in nodes)
    text = (
        f"{' > '.join(nodes)}; rows removed by filter {removed:,};"
        f" {buffers.removeprefix('Buffers: ') or 'no buffers'}; execution {execution}"
    )
    return text, sorts, seq_scan


# -- the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--apps", type=int, default=1_000_000, help="apps (1,000,000)")
    parser.add_argument("--runs", type=int, default=7, help="timed requests per figure (7)")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the data (1)")
    parser.add_argument(
        "--server-url",
        default=claims_db.DEFAULT_SERVER,
        help=f"the PostgreSQL server (default {claims_db.DEFAULT_SERVER})",
    )
    parser.add_argument("--reuse", action="store_true", help="measure bench_web_<N> as it is")
    parser.add_argument("--drop", action="store_true", help="drop bench_web_<N> at the end")
    args = parser.parse_args(argv)
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    os.environ.setdefault("POWERTOOLS_METRICS_NAMESPACE", "AnalysisQueueBench")
    import handler

    probe = claims_db.connect(claims_db.with_database(args.server_url, "postgres"))
    version = probe.run("SHOW server_version")[0][0]
    probe.close()
    say(
        f"web view benchmark: {args.apps:,} apps, PostgreSQL {version}, {os.cpu_count()} CPUs,"
        f" Python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}"
    )
    try:
        _, sql = prepare(args, handler)
        try:
            return measure(handler, sql, args)
        finally:
            sql.close()
            handler.use_runtime(None)
    finally:
        if args.drop:
            name = f"bench_web_{args.apps}"
            admin = claims_db.connect(claims_db.with_database(args.server_url, "postgres"))
            admin.run(f"DROP DATABASE IF EXISTS {pg8000.native.identifier(name)} WITH (FORCE)")
            admin.close()
            say(f"-- dropped {name}")


def measure(handler, sql, args: argparse.Namespace) -> int:
    reasons = sql.run(
        "SELECT failure_reason, count(*) FROM apps WHERE status = 'failed'"
        " AND failure_reason IS NOT NULL GROUP BY 1 ORDER BY 2 DESC, 1"
    )
    (common, _), (rare, _) = reasons[0], reasons[-1]
    story = story_app(sql)
    figures: dict[str, float] = add_actions(handler, sql, story, common)
    vacuum(sql)
    handler.use_runtime(None)

    states = dict(sql.run("SELECT status, count(*) FROM apps GROUP BY 1"))
    total = sum(states.values())
    deep_keys = [
        k
        for (k,) in sql.run(
            'SELECT lower(appid) COLLATE "C" FROM apps ORDER BY 1 OFFSET :o LIMIT 20',
            o=int(total * 0.9),
        )
    ]
    deep = next(k for k in deep_keys if handler.is_valid_bundle_id(k))
    prefix = "com.wonka.app7"
    (prefix_n,) = sql.run("SELECT count(*) FROM apps WHERE lower(appid) LIKE :p", p=prefix + "%")[0]
    (history_n,) = sql.run("SELECT count(*) FROM app_analyses WHERE appid = :a", a=story)[0]
    (actions_n,) = sql.run("SELECT count(*) FROM operator_actions")[0]
    say(
        f"-- the data: {total:,} apps ("
        + ", ".join(f"{s} {n:,}" for s, n in sorted(states.items()))
        + "); failure reasons: "
        + ", ".join(f"{r} {n:,}" for r, n in reasons)
        + f"; {actions_n:,} operator actions"
    )
    say(
        f"   prefix q={prefix}: {prefix_n:,} apps; the deep page starts after {deep}"
        f" (90 % of the list); the story: {story}, {history_n} history rows"
    )

    runs = args.runs
    say(f"-- timed through handler.api, medians of {runs} after a warm-up (ms)")
    status_path = "/admin/api/status"
    figures["overview_uncached_ms"], status = time_request(
        handler, status_path, "", UNCACHED_RUNS, before=lambda: handler.runtime().cached.clear()
    )
    figures["overview_cached_ms"], _ = time_request(handler, status_path, "", runs)
    pages = {
        "apps_first_page_ms": {},
        **{f"apps_state_{s}_ms": {"state": s} for s in handler.APP_STATES},
        "apps_failed_common_reason_ms": {"state": "failed", "reason": common},
        "apps_failed_rare_reason_ms": {"state": "failed", "reason": rare},
        "apps_prefix_ms": {"q": prefix},
        "apps_deep_page_ms": {"after": deep},
    }
    counts = {}
    for name, query in pages.items():
        figures[name], body = time_request(handler, "/admin/api/apps", urlencode(query), runs)
        counts[name] = len(body.get("apps", []))
    figures["app_story_ms"], story_body = time_request(
        handler, f"/admin/api/apps/{quote(story)}", "", runs
    )
    db = handler.api_connection()
    selections = {
        "bulk_select_common_reason_ms": handler.AppFilter(state="failed", reason=common),
        "bulk_select_rare_reason_ms": handler.AppFilter(state="failed", reason=rare),
        "bulk_select_failed_ms": handler.AppFilter(state="failed"),
    }
    for name, where in selections.items():
        figures[name], page = time_call(
            lambda where=where: handler.apps_page(db, where, limit=handler.BULK_REFETCH_LIMIT), runs
        )
        counts[name] = len(page["apps"])
    say(
        f"   overview: {status['status']['total']:,} apps counted at {status['counted']};"
        f" rows per answer: {counts}; story: {len(story_body.get('history', []))} history"
        f" entries, {len(story_body.get('actions', []))} actions"
    )

    say(
        "-- EXPLAIN (ANALYZE, BUFFERS), as the API connection plans them: the lists with"
        " their values (handler.apps_page), the story's statements generically"
    )
    slow_plans: list[str] = []
    plans_ok = True
    statements = {
        **{
            name: (
                handler.APPS_PAGE,
                {
                    "after": query.get("after", ""),
                    "limit": handler.APPS_PAGE_SIZE + 1,
                    **handler.AppFilter.from_query(query).params(),
                },
            )
            for name, query in pages.items()
        },
        **{
            name: (
                handler.APPS_PAGE,
                {"after": "", "limit": handler.BULK_REFETCH_LIMIT + 1, **where.params()},
            )
            for name, where in selections.items()
        },
    }
    policy = handler.settings().policy
    story_params = {"appid": story, "document_limit": handler.LAMBDA_PAYLOAD_LIMIT_BYTES // 4}
    statements["app_story_ms (history)"] = (handler.APP_HISTORY, {**story_params, "limit": 50})
    statements["app_story_ms (app)"] = (handler.FIND_APP, story_params)
    statements["app_story_ms (rule)"] = (
        handler.APP_RULE,
        {"appid": story, **policy.sql_params()},
    )
    statements["app_story_ms (actions)"] = (handler.APP_ACTIONS, {"appid": story, "limit": 100})
    for name, (statement, params) in statements.items():
        params = {k: v for k, v in params.items() if f":{k}" in statement}
        is_list = name.startswith(("apps_", "bulk_"))
        lines = explain(sql, statement, params, generic=not is_list)
        text, _, seq_scan = summary(lines)
        # A list may sort the few rows a partial index found; it must never read the
        # whole table.
        plans_ok &= not (is_list and seq_scan)
        say(f"   {name.removesuffix('_ms')}: {text}")
        # Slow: a list over the page target (a bulk selection too, as a yardstick), or a
        # part of the story that reads a whole table.
        slow = figures.get(name.split(" ")[0], math.nan) > PAGE_TARGET_MS if is_list else seq_scan
        if slow:
            slow_plans.append(name)
            if not name.startswith("bulk_"):
                say("      the whole plan, as the API runs it:")
                for line in lines:
                    say("         " + line)

    say()
    targets = {
        "overview_uncached_ms": None,
        "overview_cached_ms": CACHED_TARGET_MS,
        **dict.fromkeys(pages, PAGE_TARGET_MS),
        "app_story_ms": PAGE_TARGET_MS,
        **dict.fromkeys(selections, None),
        "bulk_refetch_ms": None,
    }
    misses = []
    for name, target in targets.items():
        if name not in figures:
            continue
        value = figures[name]
        if target is None:
            verdict = "(reported)"
        else:
            ok = value <= target
            verdict = f"{'PASS' if ok else 'MISS'} (target <= {target:g})"
            if not ok:
                misses.append(name)
        say(f"{name}={value:.1f}  {verdict}")
    say(f"list_plans_without_seq_scan={'yes' if plans_ok else 'no'}")
    if misses:
        say(f"over target: {', '.join(misses)} (plans above: {', '.join(slow_plans)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
