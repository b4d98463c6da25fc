"""The invariants bench/claims.py checks while it measures, as tests at test size.

The benchmark builds 10k to 1M apps and, besides its timings, checks that no statement
of the queue reads apps by a sequential scan, that claims are the oracle's, and that
concurrent claimers never share an app. Those checks are here, on a few thousand rows
made by one INSERT ... SELECT over generate_series, in every state the claim reads:
queued, live and expired leases (one without a start time), fresh and stale analyses,
old, current and newer analysis versions, retryable and final failures; and a queue
whose apps mostly fail (RETRY_POPULATE), where thousands of retries back off and a few
are due, handed out in the lowest tier.

What else the benchmark checks is tested elsewhere: claims against the oracle on random
small states and while promotion is partial (test_claims_follow_the_oracle.py:
test_oracle_on_random_states, test_claims_follow_the_oracle_while_promotion_is_partial),
32 claimers on a plain connection (test_claims_follow_the_oracle.py:
test_32_concurrent_claimers_never_share_an_app), queue positions
(test_claims_follow_the_oracle.py: test_queue_positions_match_the_oracle), the first
claim after upgrading a previous release's database (test_adoption.py), and no boto3 on the API path
(test_entry_secrets.py: test_boto3_is_imported_only_when_a_secret_is_read). Its timings and
targets are measurements, not tests.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections import Counter

import pg8000.native
import pytest
from kit import ANALYSER, configure_service

import handler
from helpers import oracle_order, oracle_tiers, run_together

ROWS = 5000
# The benchmark's phases: the service as deployed, restarted with the analysers' version
# bumped, and restarted with STALE_ANALYSIS_DAYS lowered over most analyses at once (with
# a 1 ms promotion budget each claim runs one batch of the promoter, so claims go on
# while promotion is partial, as they do at a million apps with the default budget).
PHASES = {
    "as deployed": {},
    "version bump": {"CURRENT_ANALYSIS_VERSION": "5"},
    "mass promotion": {"STALE_ANALYSIS_DAYS": "30", "PROMOTION_BUDGET_MS": "1"},
}
CANDIDATE_CLASSES = {"queued", "lease_expired", "outdated_version", "stale", "retry_failed"}

# One row in a hundred of each state (k = i % 100). Analysis ages are whole days and a
# half, so no row is within hours of a staleness cutoff (30 or 180 days), and leases are
# 5 or 300 minutes old (the timeout is 120): the oracle's now() and the claim's agree.
# Popularity takes 211 values (JSON strings and numbers; missing and non-numeric count
# as 0) and `added` 7 days, so the claim order's ties on popularity, then on popularity
# and age, are common, within a source and between sources. Bundle IDs are zero-padded:
# they sort the same in any collation and in Python (the oracle).
POPULATE = """
INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added, status,
                  processing_started, failure_reason, failure_retryable)
SELECT id.appid,
       jsonb_strip_nulls(jsonb_build_object(
           'appId', id.appid, 'title', 'App ' || i,
           'reviews', CASE WHEN i % 19 = 0 THEN NULL
                           WHEN i % 17 = 0 THEN to_jsonb(text 'n/a')
                           WHEN i % 3 = 0 THEN to_jsonb(i * 7919 % 211)
                           ELSE to_jsonb((i * 7919 % 211)::text) END)),
       CASE WHEN s.status IN ('analysed', 'failed') THEN jsonb_build_object(
           'success', s.status = 'analysed', 'bundleID', id.appid) END,
       s.version,
       now() - (s.age_days + 0.5) * interval '1 day',
       date_trunc('day', now()) - interval '1000 days' + i % 7 * interval '1 day',
       s.status,
       now() - s.lease_minutes * interval '1 minute',
       CASE WHEN s.status = 'failed' THEN 'analysis_failed' END,
       CASE WHEN s.status = 'failed' THEN s.k NOT IN (95, 96) END
FROM generate_series(1, :rows) AS i
CROSS JOIN LATERAL (SELECT format('com.plan.app%s', lpad(i::text, 6, '0')) AS appid) id
CROSS JOIN LATERAL (SELECT i % 100 AS k, (i / 100) * 7 % 170 + 1 AS spread) m
CROSS JOIN LATERAL (SELECT
    m.k,
    CASE WHEN m.k < 25 THEN 'queued'              -- 0-24
         WHEN m.k < 29 THEN 'processing'          -- 25-26 live, 27 expired, 28 no start
         WHEN m.k BETWEEN 92 AND 96 THEN 'failed' -- 92-94 retryable, 95-96 final
         ELSE 'analysed' END AS status,
    CASE WHEN m.k BETWEEN 86 AND 91 THEN (ARRAY[NULL, -1, 0, 1, 2, 3])[m.k - 85]
         WHEN m.k IN (92, 95) THEN 3
         WHEN m.k >= 97 THEN 5                    -- newer than the current version
         WHEN m.k >= 29 THEN 4 END AS version,
    CASE WHEN m.k < 29 THEN NULL
         WHEN m.k BETWEEN 80 AND 85 OR m.k = 93 THEN 190 + m.spread  -- stale
         ELSE m.spread END AS age_days,
    CASE WHEN m.k IN (25, 26) THEN 5 WHEN m.k = 27 THEN 300 END AS lease_minutes
) s
"""

UNFLAGGED_STALE = """
SELECT count(*) FROM apps
WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
  AND COALESCE(analysisversion, 0) <= :version
  AND COALESCE(analysed, '-infinity') < now() - make_interval(days => :days)
"""


def populate(sql) -> None:
    sql.run(POPULATE, rows=ROWS)


def candidate_classes(sql, policy: handler.QueuePolicy) -> dict[str, str]:
    """Each candidate's class by the service's own words (handler.CANDIDATE_REASON)."""
    rows = sql.run(
        f"SELECT appid, {handler.CANDIDATE_REASON} FROM apps WHERE {handler.CANDIDATE}",
        **policy.sql_params(),
    )
    return dict(rows)


def claim(client) -> str:
    answer = client.get("/queue", headers=ANALYSER)
    assert answer.status_code == 200, answer.text
    return answer.text


# --- plans ------------------------------------------------------------------------------


def service_plan(statement: str, params: dict, promoter: bool) -> list[str]:
    """EXPLAIN (nothing runs) of a statement planned the way the service plans it, on the
    service's own API connection (handler.api_connection(), with the settings it opens with):
    the API's statements are prepared once per connection and run with generic plans
    (plan_cache_mode = force_generic_plan, handler.Runtime); the promoter's run inside
    their batch's transaction after handler.PLAN_WITH_VALUES (custom plans, with the
    cutoffs' values). pg8000 prepares without parameter types, as PREPARE does here, so
    the server infers the same types. pg_prepared_statements tells which kind of plan
    EXPLAIN EXECUTE produced."""
    text, make_values = pg8000.native.to_statement(statement)
    values = ", ".join(pg8000.native.literal(value) for value in make_values(params))
    with handler.api_connection().raw_connection() as connection:
        assert connection.run("SHOW plan_cache_mode") == [["force_generic_plan"]]
        assert connection.run("SHOW jit") == [["off"]]
        connection.run("BEGIN")
        try:
            if promoter:
                connection.run(handler.PLAN_WITH_VALUES)
            connection.run(f"PREPARE plan_probe AS {text}")
            try:
                lines = [row[0] for row in connection.run(f"EXPLAIN EXECUTE plan_probe({values})")]
                ((generic, custom),) = connection.run(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                    " WHERE name = 'plan_probe'"
                )
            finally:
                connection.run("DEALLOCATE plan_probe")  # not ALL: the service's are there too
        finally:
            connection.run("ROLLBACK")
    assert (generic, custom) == ((0, 1) if promoter else (1, 0)), statement
    return lines


def queue_statements(sql, policy: handler.QueuePolicy) -> dict[str, tuple[str, dict, bool]]:
    """(statement, parameters, planned with values?) of everything GET /queue and
    GET /apps/{appId} may run that reads apps by more than its primary key. The queue
    position is asked for the app at the end of the queue, where it counts the most."""
    ((appid, popularity, added),) = sql.run(
        "SELECT appid, app_popularity(details), added FROM apps WHERE status = 'queued'"
        " ORDER BY app_popularity(details), added DESC, appid DESC LIMIT 1"
    )
    token = str(uuid.UUID(int=0))  # EXPLAIN runs nothing; the column is uuid
    policy_params = policy.sql_params()
    promotion = {
        **policy_params,
        "horizon_seconds": handler.PROMOTION_HORIZON_SECONDS,
        "batch": handler.PROMOTION_BATCH,
    }
    return {
        "CLAIM_NEXT_APP": (
            handler.CLAIM_NEXT_APP,
            {**policy_params, "token": token, "analyser": None},
            False,
        ),
        "CLAIM_NAMED_APP": (
            handler.CLAIM_NAMED_APP,
            {**policy_params, "token": token, "appid": appid.upper(), "analyser": None},
            False,
        ),
        "FIND_APP": (
            handler.FIND_APP,
            {"appid": appid, "document_limit": handler.LAMBDA_PAYLOAD_LIMIT_BYTES},
            False,
        ),
        "QUEUE_POSITION": (
            handler.QUEUE_POSITION,
            {
                **policy_params,
                "popularity": popularity,
                "added": added,
                "appid": appid,
                "limit": handler.QUEUE_POSITION_BOUND + 1,
            },
            False,
        ),
        "PROMOTE_EXPIRED_LEASES": (handler.PROMOTE_EXPIRED_LEASES, promotion, True),
        "PROMOTE_STALE_BATCH": (handler.PROMOTE_STALE_BATCH, promotion, True),
        "CLEAR_STALE_DUE_FLAGS": (
            handler.CLEAR_STALE_DUE_FLAGS,
            {**policy_params, "batch": handler.PROMOTION_BATCH, "after": ""},
            True,
        ),
        "PROMOTE_DUE_RETRIES": (handler.PROMOTE_DUE_RETRIES, promotion, True),
        "CLEAR_RETRY_FLAGS": (
            handler.CLEAR_RETRY_FLAGS,
            {"batch": handler.PROMOTION_BATCH},
            True,
        ),
    }


@pytest.mark.parametrize("analyzed", [True, False], ids=["analyzed", "no statistics"])
@pytest.mark.parametrize("phase", ["as deployed", "version bump"])
def test_no_statement_of_the_queue_scans_apps(
    client, sql, database_url, monkeypatch, phase, analyzed
):
    """No Seq Scan on apps in the plans of the claim (next and named), the promoter's
    statements (its retry flagging and clearing included), the app lookup and the queue
    position, after the phase's first
    claim (which promotes and, on a policy change, clears flags), in the two phases where
    bench/claims.py checks plans at 10k to 1M apps.

    The table is large enough that an index read is the planner's honest choice:
    with these rows at 1,000 apps (the benchmark's smallest size), the promoter's
    statements planned before any ANALYZE read the whole (then 40-page) table; from about
    1,250 apps no plan does, and ROWS is four times that. Like the benchmark, nothing is
    forced: enable_seqscan stays on. "analyzed" plans after ANALYZE (the benchmark's
    plans); "no statistics" before any ANALYZE, the planner knowing the table only by its
    size (the benchmark checks the claim and promotion before its ANALYZE too, on the
    statistics the upgrade left). Where autovacuum runs (the embedded server) it may have
    analysed the table first: then both cases are the analysed one.

    Not after the mass promotion (nor does the benchmark check plans there): at this size
    it flags over 40 % of the table, and the flag-clearing pass's first batch of
    PROMOTION_BATCH rows is then nearly every flagged row, which a sequential scan of
    5,000 rows reads more cheaply than the index; at a million apps it is not.
    """
    populate(sql)
    configure_service(monkeypatch, database_url, **PHASES[phase])
    claim(client)
    if analyzed:
        sql.run("ANALYZE apps")
    policy = handler.settings().policy
    scans = {}
    for title, (statement, params, promoter) in queue_statements(sql, policy).items():
        lines = service_plan(statement, params, promoter)
        found = [line.strip() for line in lines if "Seq Scan on apps" in line]
        if found:
            scans[title] = found
    assert scans == {}


# The web view's list filters (handler.AppFilter), each planned as apps_page plans them.
LIST_FILTERS = {
    "every app": {},
    "after a page": {"after": "com.example.app02"},
    "a prefix": {"prefix": "com.example.app1"},
    "a state": {"state": "queued"},
    "the leased": {"state": "processing"},
    "failures of a reason": {"state": "failed", "reason": "app_not_found"},
}


def test_no_page_of_the_apps_list_scans_apps(client, sql, database_url, monkeypatch):
    """The web view's list and its search inside bundle IDs read apps through indexes
    with every filter: the rows not leased in bundle-ID order (sql/037, which holds no
    leased row, so a claim never writes it) or one reason's failures (sql/028), the leased
    ones through apps_processing_started; planned with the filter's values, as apps_page
    plans them (handler.PLAN_WITH_VALUES), on statistics (a table the web view reads has
    them: the upgrade's ANALYZE, autovacuum). The search's window is a hundred apps here:
    the service's (10,000) is twice this table, whose every row the planner would then
    rightly read at once to join its matches."""
    populate(sql)
    configure_service(monkeypatch, database_url)
    claim(client)
    sql.run("ANALYZE apps")
    scans = {}
    for title, chosen in LIST_FILTERS.items():
        where = handler.AppFilter(
            state=chosen.get("state"), reason=chosen.get("reason"), prefix=chosen.get("prefix", "")
        )
        params = {"after": chosen.get("after"), "limit": handler.APPS_PAGE_SIZE + 1}
        params |= where.params()
        search = {"scan": 100, "contains": "app"}
        for kind, statement, extra in (
            ("page", handler.APPS_PAGE, {}),
            ("search", handler.APPS_CONTAINING, search),
        ):
            lines = service_plan(statement, params | extra, promoter=True)
            found = [line.strip() for line in lines if "Seq Scan on apps" in line]
            if found:
                scans[f"{kind}, {title}"] = found
    assert scans == {}


def run_plan(connection, statement: str, params: dict) -> dict:
    """The statement run under EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) as a prepared
    statement (on the API connection: a generic plan, as the service runs it), in a
    transaction rolled back; its top plan node."""
    text, make_values = pg8000.native.to_statement(statement)
    values = ", ".join(pg8000.native.literal(value) for value in make_values(params))
    connection.run("BEGIN")
    try:
        connection.run(f"PREPARE run_probe AS {text}")
        try:
            ((plans,),) = connection.run(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE run_probe({values})"
            )
        finally:
            connection.run("DEALLOCATE run_probe")  # not ALL: the service's are there too
    finally:
        connection.run("ROLLBACK")
    return plans[0]["Plan"]


def pages_read(sql, statement: str, **params) -> int:
    """Pages the statement's run touches (buffers hit or read), TOAST's included: a large
    stored document is read from its TOAST chunks each time an expression takes it
    apart, so this counts how often the statement reads it."""
    top = run_plan(sql, statement, params)
    return top["Shared Hit Blocks"] + top["Shared Read Blocks"]


def test_the_public_read_renders_each_document_once(sql):
    """GET /apps/{appId} (FIND_APP) answers a document with its size, and leaves out one
    too large for a Lambda answer. PostgreSQL reads a stored document again (from its
    TOAST chunks) and renders it again for each use of ::text, so measuring and sending
    it cost three renders: a 10 MB analysis took 0.14 s of the database a read, which
    anyone may ask for. Now each is rendered once; the pages are counted against those
    of one read of each document."""
    sql.run(
        """INSERT INTO apps (appid, status, analysisversion, analysed, details, analysis)
           SELECT 'com.example.large', 'analysed', 4, now(),
                  jsonb_build_object('reviews', '5', 'notes', string_agg(md5(n::text), ' ')),
                  jsonb_build_object('success', true, 'log', string_agg(md5(n::text), ' '))
           FROM generate_series(1, 40000) AS n"""
    )
    once = {
        column: pages_read(
            sql,
            f"SELECT octet_length({column}::text) FROM apps WHERE appid = :appid",
            appid="com.example.large",
        )
        for column in ("details", "analysis")
    }
    assert min(once.values()) > 100  # each is in TOAST: the count below is its reads
    read = pages_read(
        sql,
        handler.FIND_APP,
        appid="com.example.large",
        document_limit=handler.LAMBDA_PAYLOAD_LIMIT_BYTES,
    )
    # details: rendered once, and read twice for its popularity (app_popularity, inlined:
    # the pattern, then the number); analysis: rendered once, and read for its success
    assert read <= 3 * once["details"] + 2 * once["analysis"] + 20, (read, once)


def rows_read(statement: str, params: dict) -> int:
    """Rows of apps the statement's scans read (kept or filtered out, every loop), run as
    the API connection runs it."""
    with handler.api_connection().raw_connection() as connection:
        top = run_plan(connection, statement, params)

    def read(node: dict) -> int:
        own = 0
        if node.get("Relation Name") == "apps":
            seen = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            own = seen * node["Actual Loops"]
        return own + sum(read(child) for child in node.get("Plans", ()))

    return read(top)


LIVE_LEASES = 2000


# Leases a claim cannot hand out, anywhere in apps_processing_started: live ones just
# taken, about to end, and taken "ahead" (a clock's skew, still live), each kind on
# another side of the ranges an expired lease is read by, never read; and expired ones
# whose attempts are used up (their apps wait for the promoter to back them off), read in
# their range (no index leaves them out) but not fetched again by their key.
@pytest.mark.parametrize(
    ("started", "attempts", "reads_each"),
    [("1 minute", 1, 0), ("119 minutes", 1, 0), ("-100 minutes", 1, 0), ("300 minutes", 3, 1)],
)
def test_a_claim_and_a_queue_position_read_no_live_lease(
    client, sql, database_url, monkeypatch, started, attempts, reads_each
):
    """What a claim and a public queue position read does not grow with the leases out.
    Both look for expired leases the promoter has not flagged; written as one OR, that
    read every live lease (2,000 of them: 4 ms a claim at a million apps instead of 0.3,
    and in bench/claims.py's throughput windows every claim left one more). The table is
    analysed before the leases go out, so the planner counts few of them, as it does in
    production between two ANALYZEs."""
    populate(sql)
    # As in production between two ANALYZEs: the statistics count next to no leases out.
    sql.run(
        "UPDATE apps SET status = 'queued', processing_started = NULL WHERE status = 'processing'"
    )
    configure_service(monkeypatch, database_url)
    claim(client)
    sql.run("ANALYZE apps")
    policy = handler.settings().policy
    every = queue_statements(sql, policy)
    statements = {title: every[title] for title in ("CLAIM_NEXT_APP", "QUEUE_POSITION")}
    before = {title: rows_read(s, params) for title, (s, params, _) in statements.items()}
    sql.run(
        """INSERT INTO apps (appid, status, processing_started, lease_attempts)
           SELECT format('com.plan.lease%s', n), 'processing',
                  now() - CAST(:started AS interval), :attempts
           FROM generate_series(1, :n) AS n""",
        started=started,
        attempts=attempts,
        n=LIVE_LEASES,
    )
    after = {title: rows_read(s, params) for title, (s, params, _) in statements.items()}
    grown = {title: after[title] - before[title] for title in statements}
    print("ROWS", before, after)
    assert all(rows < reads_each * LIVE_LEASES + 50 for rows in grown.values()), (before, after)


# --- retries at scale ----------------------------------------------------------------------

# A queue whose apps mostly fail: one row in a hundred of each kind (k = i % 100). Two
# queued (candidates), fresh analyses, and retryable failures at the current version, each
# the 1st to 4th in a row (i / 100 % 4 + 1): most backing off (their retry a step away:
# half RETRY_BACKOFF's step old for their count) or spent (the 4th, past the last step),
# two in a hundred due (a step and a half old). Ages are far from every step (the
# oracle's now() and the claim's agree), and the promoter flags only the due few.
RETRY_POPULATE = """
INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added, status,
                  failure_reason, failure_retryable, failure_streak)
SELECT id.appid,
       jsonb_build_object('appId', id.appid, 'reviews', (i * 7919 % 211)::text),
       CASE WHEN m.k >= 2 THEN jsonb_build_object(
           'success', m.k < 40, 'bundleID', id.appid) END,
       CASE WHEN m.k >= 2 THEN 4 END,
       CASE WHEN m.k >= 40 THEN now() - step.seconds * CASE WHEN m.k >= 98 THEN 1.5 ELSE 0.5 END
                                      * interval '1 second'
            WHEN m.k >= 2 THEN now() - interval '3 days' END,
       date_trunc('day', now()) - interval '1000 days' + i % 7 * interval '1 day',
       CASE WHEN m.k < 2 THEN 'queued' WHEN m.k < 40 THEN 'analysed' ELSE 'failed' END,
       CASE WHEN m.k >= 40 THEN 'analysis_failed' END,
       CASE WHEN m.k >= 40 THEN true END,
       CASE WHEN m.k >= 40 THEN m.streak ELSE 0 END
FROM generate_series(1, :rows) AS i
CROSS JOIN LATERAL (SELECT format('com.retry.app%s', lpad(i::text, 6, '0')) AS appid) id
CROSS JOIN LATERAL (SELECT i % 100 AS k, i / 100 % 4 + 1 AS streak) m
CROSS JOIN LATERAL (SELECT (ARRAY[3600, 21600, 86400, 86400])[m.streak] AS seconds) step
"""


def retry_statements(sql, policy: handler.QueuePolicy) -> dict[str, tuple[str, dict, bool]]:
    """(statement, parameters, planned with values?) of the claims and the promoter's
    retry statements, the named claim asked for the last due retry in claim order."""
    ((appid,),) = sql.run(
        "SELECT appid FROM apps WHERE retry_due ORDER BY app_popularity(details), added DESC,"
        " appid DESC LIMIT 1"
    )
    every = queue_statements(sql, policy)
    titles = ("CLAIM_NEXT_APP", "PROMOTE_DUE_RETRIES", "CLEAR_RETRY_FLAGS")
    named = every["CLAIM_NAMED_APP"]
    return {
        **{title: every[title] for title in titles},
        "CLAIM_NAMED_APP": (named[0], {**named[1], "appid": appid.upper()}, named[2]),
    }


def due_retries(sql, policy: handler.QueuePolicy) -> int:
    ((count,),) = sql.run(
        f"SELECT count(*) FROM apps WHERE {handler.RETRY_DUE}", **policy.sql_params()
    )
    return count


@pytest.mark.parametrize("analyzed", [True, False], ids=["analyzed", "no statistics"])
def test_due_retries_are_claimed_by_index_reads_among_many_backing_off(
    client, sql, database_url, monkeypatch, analyzed
):
    """Thousands of retryable failures backing off or spent, a few due: the promoter
    flags exactly the due ones (one range of apps_retry_watch per step), and no plan of
    the claims (next and named) or of the promoter's retry statements reads apps by a
    sequential scan. Then the claims hand out every candidate, and after them the due
    retries in claim order, as the oracle says, the last claim empty."""
    sql.run(RETRY_POPULATE, rows=ROWS)
    configure_service(monkeypatch, database_url)
    policy = handler.settings().policy
    expected = oracle_order(sql, policy)
    candidates, retries = oracle_tiers(sql, policy)
    # Two queued in a hundred; two due in a hundred, but for the 4th failures (spent).
    due = [i for i in range(1, ROWS + 1) if i % 100 >= 98 and i // 100 % 4 < 3]
    assert (len(candidates), len(retries)) == (ROWS // 50, len(due))
    assert claim(client) == expected[0]  # promotes
    ((flagged,),) = sql.run("SELECT count(*) FROM apps WHERE retry_due")
    assert flagged == due_retries(sql, policy) == len(retries)
    if analyzed:
        sql.run("ANALYZE apps")
    scans = {}
    for title, (statement, params, promoter) in retry_statements(sql, policy).items():
        found = [
            line.strip()
            for line in service_plan(statement, params, promoter)
            if "Seq Scan on apps" in line
        ]
        if found:
            scans[title] = found
    assert scans == {}
    got = [claim(client) for _ in range(len(expected))]
    assert [expected[0], *got] == [*expected, ""]


BACKING_OFF = 4000


def test_a_claim_reads_no_retry_backing_off(client, sql, database_url, monkeypatch):
    """What a claim reads does not grow with the retryable failures backing off: the
    lowest tier reads the promoter's flagged rows (apps_retry_order), never the failures
    waiting for their retry. Measured when nothing but due retries is left, the claim
    reading the retry tier: before and after BACKING_OFF more failures backing off."""
    sql.run(RETRY_POPULATE, rows=ROWS)
    configure_service(monkeypatch, database_url)
    policy = handler.settings().policy
    candidates, _ = oracle_tiers(sql, policy)
    assert [claim(client) for _ in candidates] == candidates
    sql.run("ANALYZE apps")
    statement = handler.CLAIM_NEXT_APP
    params = {**policy.sql_params(), "token": str(uuid.UUID(int=0)), "analyser": None}
    before = rows_read(statement, params)
    sql.run(
        """INSERT INTO apps (appid, status, analysisversion, analysed, failure_reason,
                             failure_retryable, failure_streak, analysis)
           SELECT format('com.retry.waiting%s', n), 'failed', 4,
                  now() - interval '30 minutes', 'analysis_failed', true, n % 3 + 1,
                  '{"success": false}'
           FROM generate_series(1, :n) AS n""",
        n=BACKING_OFF,
    )
    after = rows_read(statement, params)
    assert after - before < 50, (before, after)
    first_retry = oracle_tiers(sql, policy)[1][0]
    assert claim(client) == first_retry


# --- claims in a row ----------------------------------------------------------------------

CLAIMS_IN_A_ROW = 120
# The promoter's batch scaled down with the table (2,000 at 10k to 1M apps), so that the
# mass promotion takes a few dozen claims here, as it takes many at a million apps.
SCALED_BATCH = 100


def test_claims_in_a_row_are_the_oracles_order(client, sql, database_url, monkeypatch):
    """Through each of the benchmark's phases in turn, each a restart of the service,
    GET /queue hands out the oracle's candidates in the oracle's order, claim after
    claim (the benchmark checks the first claim of each series, and the first ten and
    every tenth while promotion is partial). The claims reach every class of candidate.
    In the mass promotion the first claims clear the flags the old policy set and then
    flag the newly stale rows one batch per claim, and each of those claims is right,
    reading the unflagged stale rows itself; promotion is done within CLAIMS_IN_A_ROW."""
    monkeypatch.setattr(handler, "PROMOTION_BATCH", SCALED_BATCH)
    populate(sql)
    sql.run("ANALYZE apps")
    reached = set()
    for phase, env in PHASES.items():
        configure_service(monkeypatch, database_url, **env)
        policy = handler.settings().policy
        expected = oracle_order(sql, policy)
        classes = candidate_classes(sql, policy)
        assert len(expected) > CLAIMS_IN_A_ROW
        got, unflagged = [], []
        for _ in range(CLAIMS_IN_A_ROW):
            got.append(claim(client))
            unflagged += sql.run(
                UNFLAGGED_STALE, days=policy.stale_days, version=policy.analysis_version
            )[0]
        assert got == expected[: len(got)], phase
        reached |= {classes[appid] for appid in got}
        if phase == "mass promotion":
            partial = [left for left in unflagged if left > 0]
            assert len(partial) > 10 and partial[0] > 10 * SCALED_BATCH
            assert unflagged[-1] == 0
    assert reached == CANDIDATE_CLASSES


# --- concurrent claimers ------------------------------------------------------------------

CLAIMERS = 16  # the benchmark's largest number of concurrent clients


def test_concurrent_claimers_share_no_app_and_miss_none(database_url, sql):
    """CLAIMERS claimers, each a container of its own (a handler.Runtime from the
    service's settings: its own connection, generic plans, timeouts, promoter memo),
    claim until the queue is empty, all at once from the first claim (which runs each
    one's promoter, as a container's first claim does). No app is handed out twice, the
    apps handed out are exactly the oracle's candidates, and each row is processing under
    the token its claimer got, as the benchmark checks after its throughput windows."""
    populate(sql)
    sql.run("ANALYZE apps")
    policy = handler.settings().policy
    candidates = set(oracle_order(sql, policy))
    start = threading.Barrier(CLAIMERS)
    claimed: list[list[tuple[str, str]]] = [[] for _ in range(CLAIMERS)]
    errors: list[BaseException] = []

    def claimer(mine: list[tuple[str, str]]) -> None:
        runtime = handler.Runtime(handler.load_settings())
        config = runtime.settings
        try:
            db = runtime.api_connection()
            db.run("SELECT 1")  # connected, as a warm container is
            start.wait(timeout=60)
            while True:
                got = handler.claim_next_app(
                    db, config.policy, promotion_budget_seconds=config.promotion_budget_ms / 1000
                )
                if got is None:
                    return
                mine.append(got)
        except BaseException as error:  # asserted in the test's own thread
            errors.append(error)
        finally:
            runtime.close()

    run_together([functools.partial(claimer, mine) for mine in claimed], timeout=120)
    assert errors == []
    tokens = dict(pair for mine in claimed for pair in mine)
    appids = [appid for mine in claimed for appid, _ in mine]
    assert [appid for appid, n in Counter(appids).items() if n > 1] == []
    assert set(appids) == candidates
    assert sum(1 for mine in claimed if mine) > 1  # the work was shared
    rows = sql.run(
        "SELECT appid, status, CAST(analysis_claim_token AS text) FROM apps"
        " WHERE appid = ANY(CAST(:ids AS text[]))",
        ids=appids,
    )
    assert {appid: (status, token) for appid, status, token in rows} == {
        appid: ("processing", token) for appid, token in tokens.items()
    }
