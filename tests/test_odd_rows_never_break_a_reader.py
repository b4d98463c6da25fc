"""Data the schema allows never breaks a route, the report or a command.

Operators edit rows by hand, the old server and the previous release write them too, and
clocks differ: so every column is given values the schema admits but the service never
writes (infinite and far-off times, extreme integers, JSON of every shape, a missing or
empty queue_policy row, pings "in the future"), and every reader is run over them: each
API route, queue-status (data and text), priority-report, queue-refetch (dry run and
apply), the scheduled report and migrate's promotion. None may fail: routes answer what
they document (never 500), the others return.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ANALYSER

import handler
from helpers import LambdaContext, load_event, refetch_apps

TIMES = st.sampled_from(
    [
        "infinity",
        "-infinity",
        "294276-12-31 00:00:00+00",
        "4713-01-01 00:00:00+00 BC",
        "1970-01-01 00:00:00+00",
        "now() + interval '3 days'",
        "now() - interval '3 hours'",
        "now()",
    ]
)
OPTIONAL_TIMES = st.one_of(st.none(), TIMES)
INTEGERS = st.sampled_from([None, -2147483648, -1, 0, 4, 5, 2147483647])
DOCUMENTS = st.sampled_from(
    [
        None,
        "null",
        "[]",
        '"text"',
        "{}",
        '{"reviews": {"a": 1}}',
        '{"reviews": "99999999999999999999999999"}',
        '{"reviews": -5, "version": {"x": 1}}',
        '{"reviews": 1e20}',
        '{"reviews": true, "appId": 7}',
        '{"success": "maybe", "analysis_source": 5, "version": []}',
        '{"success": false, "reason": 3, "retryable": "no"}',
    ]
)
TEXTS = st.sampled_from([None, "", "lease_expired", "x" * 2000, "é\u2028\U0001f600"])


def time_sql(value: str | None) -> str:
    """A time as SQL: a literal, or an expression on now()."""
    if value is None:
        return "NULL"
    if value.startswith("now()"):
        return value
    return f"CAST('{value}' AS timestamptz)"


ROWS = st.fixed_dictionaries(
    {
        "status": st.sampled_from(["queued", "processing", "analysed", "failed"]),
        "details": DOCUMENTS,
        "analysis": DOCUMENTS,
        "analysisversion": INTEGERS,
        "analysed": OPTIONAL_TIMES,
        "added": TIMES,
        "processing_started": OPTIONAL_TIMES,
        "failure_reason": TEXTS,
        "failure_retryable": st.sampled_from([None, True, False]),
        "due": st.booleans(),
        "lease_attempts": st.sampled_from([-2147483648, 0, 2, 3, 2147483647]),
        "refetch_requested": st.booleans(),
    }
)
POLICY_ROWS = st.sampled_from(["as migrated", "missing", "empty", "odd"])


def arrange(sql, row: dict, last_seen: str, history_time: str, policy_row: str) -> None:
    for table in ("app_analyses", "apps", "analyser_heartbeats"):
        sql.run(f"DELETE FROM {table}")
    times = {name: time_sql(row[name]) for name in ("analysed", "added", "processing_started")}
    sql.run(
        f"""INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added,
                status, processing_started, failure_reason, failure_retryable, due,
                lease_attempts, refetch_requested)
            VALUES ('odd.app', CAST(:details AS jsonb), CAST(:analysis AS jsonb), :version,
                {times["analysed"]}, {times["added"]}, :status, {times["processing_started"]},
                :reason, :retryable, :due, :attempts, :refetch)""",
        details=row["details"],
        analysis=row["analysis"],
        version=row["analysisversion"],
        status=row["status"],
        reason=row["failure_reason"],
        retryable=row["failure_retryable"],
        due=row["due"],
        attempts=row["lease_attempts"],
        refetch=row["refetch_requested"],
    )
    sql.run("INSERT INTO apps (appid) VALUES ('plain.app')")
    sql.run(
        f"""INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, success)
            VALUES ('odd.app', '{{}}', :version, {time_sql(history_time)}, false)""",
        version=row["analysisversion"],
    )
    sql.run(
        "INSERT INTO analyser_heartbeats (analyser_id, last_seen)"
        f" VALUES ('pi', {time_sql(last_seen)})"
    )
    sql.run("DELETE FROM queue_policy")
    if policy_row == "as migrated":
        sql.run("INSERT INTO queue_policy (singleton) VALUES (true)")
    elif policy_row == "empty":
        sql.run("INSERT INTO queue_policy (singleton, applied) VALUES (true, 'infinity')")
    elif policy_row == "odd":
        sql.run("INSERT INTO queue_policy VALUES (true, -2147483648, 2147483647, 0, '-infinity')")


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(row=ROWS, last_seen=TIMES, history_time=TIMES, policy_row=POLICY_ROWS)
def test_every_reader_survives_what_the_schema_allows(
    client, sql, database_url, row, last_seen, history_time, policy_row
):
    arrange(sql, row, last_seen, history_time, policy_row)
    handler.runtime().clock.advance(handler.PROMOTE_EVERY_SECONDS)
    policy = handler.settings().policy
    answers = {
        "GET /apps": client.get("/apps/ODD.APP"),
        "GET /queue?appId": client.get("/queue?appId=odd.app", headers=ANALYSER),
        "GET /queue": client.get("/queue", headers=ANALYSER),
        "GET /healthz": client.get("/healthz"),
        "GET /healthz/analyser": client.get("/healthz/analyser"),
        "POST /uploadAnalysis": client.post(
            "/uploadAnalysis?appId=odd.app&analysisVersion=4",
            json={"success": True},
            headers=ANALYSER,
        ),
        "POST /reportAnalysisFailure": client.post(
            "/reportAnalysisFailure?appId=odd.app&analysisVersion=4",
            content=b"usb error",
            headers={**ANALYSER, "Content-Type": "text/plain"},
        ),
    }
    for route, answer in answers.items():
        # 409: a result the rules refuse; 503 from /healthz/analyser: no analyser online.
        allowed = (200, 503) if route == "GET /healthz/analyser" else (200, 409)
        assert answer.status_code in allowed, (route, answer.status_code, answer.text)
        if answer.headers.get("content-type", "").startswith("application/json"):
            json.loads(answer.text)
    assert answers["GET /healthz"].json()["status"] == "ok"
    assert answers["GET /queue"].text in ("odd.app", "plain.app")

    db = handler.api_connection()
    status = handler.queue_status(db, policy)
    assert handler.format_queue_status(status)
    json.dumps(status.document())
    assert len(handler.priority_report(db, policy, 10)) <= 2
    assert refetch_apps(db, ["odd.app"], False, policy)
    reported = handler.report(load_event("schedule.json"), LambdaContext())
    json.dumps(reported)
    refetch_apps(db, ["odd.app"], True, policy, force=True)
    assert handler.upgrade_database(db) == []
    ((recorded,),) = sql.run("SELECT count(*) FROM queue_policy")
    assert recorded == 1, "the promoter puts the policy row back"


# A lease's start, as SQL, and whether the lease is over (handler.lease_expired) under the
# default 120-minute lease: more than a lease ago, never, or more than a lease ahead of the
# database's clock (only a foreign write makes that; +infinity is one). Starts are kept a
# quarter of a lease from every boundary, the promoter's 60-second horizon included.
LEASE_STARTS = {
    "infinity": True,
    "now() + interval '3 days'": True,
    "now() + interval '150 minutes'": True,
    "now() + interval '90 minutes'": False,
    "now()": False,
    "now() - interval '90 minutes'": False,
    "now() - interval '150 minutes'": True,
    "-infinity": True,
    None: True,
}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    start=st.sampled_from(sorted(LEASE_STARTS, key=str)),
    attempts=st.sampled_from([1, 2, 3]),
    refetch_waits=st.booleans(),
    reader=st.sampled_from(["claim", "named claim", "promoter", "refetch", "report"]),
)
def test_every_reader_judges_a_lease_by_one_rule(
    client, sql, start, attempts, refetch_waits, reader
):
    """A lease that started in the future, or at infinity, ends like any other: every
    reader that judges a lease's age (the claims, the promoter's flags and back-off,
    refetch's live-lease test, the report) takes it as expired once its start is more
    than a lease ahead, and as live within a lease ahead (a clock's skew)."""
    for table in ("app_analyses", "apps"):
        sql.run(f"DELETE FROM {table}")
    sql.run(
        f"""INSERT INTO apps (appid, status, processing_started, analysis_claim_token,
                              lease_attempts, refetch_requested)
            VALUES ('lease.app', 'processing', {time_sql(start)}, gen_random_uuid(),
                    :attempts, :refetch)""",
        attempts=attempts,
        refetch=refetch_waits,
    )
    expired = LEASE_STARTS[start]
    at_limit = attempts >= handler.QueuePolicy().max_lease_attempts
    # What the promoter, which every claim runs first, makes of it.
    if expired and at_limit:
        after_promotion = "queued" if refetch_waits else "failed"
    else:
        after_promotion = "processing"
    handler.runtime().clock.advance(handler.PROMOTE_EVERY_SECONDS)
    policy = handler.settings().policy
    db = handler.api_connection()
    if reader in ("claim", "named claim"):
        path = "/queue" if reader == "claim" else "/queue?appId=lease.app"
        handed_out = client.get(path, headers=ANALYSER).text == "lease.app"
        assert handed_out == (after_promotion == "queued" or (expired and not at_limit))
    elif reader == "promoter":
        handler.promote_due_apps(db, policy, force=True)
        ((status, due),) = sql.run("SELECT status, due FROM apps")
        assert (status, due) == (after_promotion, expired and not at_limit)
    elif reader == "refetch":
        (selected,) = refetch_apps(db, ["lease.app"], True, policy)
        assert selected["outcome"] == ("queued" if expired else "waiting")
    else:
        status = handler.queue_status(db, policy)
        assert [app["expired"] for app in status.processing] == [expired]
        assert status.held_back["abandoned_leases"] == int(expired and at_limit)
        assert status.expired_leases == int(expired and not at_limit)


TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8)
LOGS = st.one_of(
    TEXT,
    st.sampled_from(["App not found", "USB error", "DeviceOSVersionTooLow", ""]),
    st.integers(),
    st.none(),
    st.lists(TEXT, max_size=2),
)
FAILURE_RECORDS = st.fixed_dictionaries(
    {"success": st.just(False)},
    optional={
        "reason": st.one_of(TEXT, st.sampled_from(sorted(handler.NON_RETRYABLE_REASONS)), LOGS),
        "retryable": st.one_of(st.booleans(), st.integers(0, 1), TEXT, st.none()),
        "logs": LOGS,
    },
)
STORED_DOCUMENTS = st.one_of(
    FAILURE_RECORDS,
    st.fixed_dictionaries({"success": st.one_of(st.just(True), TEXT, st.none())}),
    st.lists(st.booleans(), max_size=2),
    TEXT,
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(document=STORED_DOCUMENTS)
def test_the_state_a_stored_result_says_is_derive_analysis_states(sql, document):
    """When a lease ends without its result (refused as older than the stored one), the
    app goes back to the state its stored result says: read from the parts of the stored
    document that decide it (STORED_RESULT_PARTS), it is what derive_analysis_state makes
    of the whole document, for any document the schema holds."""
    sql.run("DELETE FROM apps")
    sql.run(
        "INSERT INTO apps (appid, analysis) VALUES ('stored.app', CAST(:document AS jsonb))",
        document=json.dumps(document),
    )
    (parts,) = handler.api_connection().records(handler.STORED_RESULT_PARTS, appids=["stored.app"])
    assert handler.stored_result_state(parts) == handler.derive_analysis_state(document)
