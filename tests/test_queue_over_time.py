"""The queue over time (docs/web-view.md, "The queue over time"), from what the database
records:

* the scheduled report keeps one snapshot an hour (the states, the backlog, the failed
  apps by reason, as it counted them) and deletes the ones older than 90 days, in one
  transaction; a report again within the hour changes nothing;
* results, failures and expired leases per hour, and per analyser, come from
  app_analyses: each result as stored, the back-off's lease_expired record as an expired
  lease, never as an analyser's failure;
* /admin/api/history answers both windows, every series one entry per hour, and refuses
  any other window; the claim's path writes nothing of it.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta

import pytest
from kit import ADMIN_TOKEN, configure_service

import handler
from helpers import LambdaContext, call_api, gateway_event, insert_app, load_event


@pytest.fixture
def web(monkeypatch, database_url):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")


def history_answer(query: str = "") -> tuple[int, dict]:
    event = gateway_event(
        "GET", "/admin/api/history", query=query, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    answer = call_api(event)
    return answer["statusCode"], json.loads(answer["body"])


def this_hour(sql) -> datetime:
    return sql.run("SELECT date_trunc('hour', now())")[0][0]


def stored(sql, app_id: str, at: datetime, success: bool, analyser: str | None, source=None):
    """One history row, as a result stored at `at` leaves it."""
    insert_app(sql, app_id, status="analysed" if success else "failed")
    sql.run(
        """INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, success,
                                     analyser, analysis_source)
           VALUES (:appid, CAST(:analysis AS json), 4, :at, :success, :analyser, :source)""",
        appid=app_id,
        analysis=json.dumps({"success": success}),
        at=at,
        success=success,
        analyser=analyser,
        source=source,
    )


def snapshots(sql) -> list[list]:
    return sql.run("SELECT hour, states, backlog, failed FROM queue_snapshots ORDER BY hour")


def test_the_report_keeps_one_snapshot_an_hour_and_deletes_those_past_90_days(web, sql):
    insert_app(sql, "com.example.waiting")
    insert_app(sql, "com.example.broken", status="failed", reason="app_not_found")
    hour = this_hour(sql)
    for days in (91, 89):
        sql.run(
            "INSERT INTO queue_snapshots (hour, states, backlog, failed)"
            " VALUES (:hour, '{}', '{}', '{}')",
            hour=hour - timedelta(days=days),
        )
    status = handler.report(load_event("schedule.json"), LambdaContext())
    kept = snapshots(sql)
    assert [row[0] for row in kept] == [hour - timedelta(days=89), hour]
    assert kept[1][1:] == [status["counts"], status["backlog"], {"app_not_found": 1}]
    assert kept[1][1]["queued"] == 1 and sum(kept[1][2].values()) == status["backlog_total"]

    # Again within the hour, with the queue changed: the hour's first count stays.
    insert_app(sql, "com.example.another")
    taken = sql.run("SELECT taken FROM queue_snapshots WHERE hour = :hour", hour=hour)
    handler.report(load_event("schedule.json"), LambdaContext())
    assert snapshots(sql) == kept
    assert sql.run("SELECT taken FROM queue_snapshots WHERE hour = :hour", hour=hour) == taken


@pytest.mark.private_database  # a role granted on its tables
def test_a_role_that_may_not_write_snapshots_still_gets_its_report(web, sql, monkeypatch):
    """An API role granted before sql/036 (no default privileges): the report's record and
    metrics all the same, and a warning that names the grant."""
    role = f"no_snapshots_{uuid.uuid4().hex[:8]}"
    sql.run(f"CREATE ROLE {role}")
    sql.run(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO {role}")
    sql.run(f"REVOKE ALL ON queue_snapshots FROM {role}")
    warnings = []
    monkeypatch.setattr(handler.logger, "warning", lambda msg, **kw: warnings.append(msg))
    try:
        db = handler.api_connection()
        db.run(f"SET ROLE {role}")
        status = handler.queue_status(db, handler.settings().policy)
        assert handler.keep_queue_snapshot(db, status) is False
        db.run("RESET ROLE")
    finally:
        handler.use_runtime(None)
        sql.run(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
        sql.run(f"DROP ROLE {role}")
    assert snapshots(sql) == []
    assert warnings == ["no queue snapshot kept: the database role may not write queue_snapshots"]


def test_results_failures_and_expired_leases_per_hour_and_per_analyser(web, sql):
    hour = this_hour(sql)
    stored(sql, "com.example.a", hour - timedelta(hours=2, minutes=-5), True, "pi-b")
    stored(sql, "com.example.b", hour - timedelta(hours=2, minutes=-50), True, "Pi-a")
    stored(sql, "com.example.c", hour - timedelta(hours=2, minutes=-59), False, "pi-b")
    stored(sql, "com.example.d", hour + timedelta(minutes=1), True, None)  # shared password
    stored(sql, "com.example.e", hour - timedelta(hours=30), False, "pi-b")  # out of 24 h
    stored(sql, "com.example.f", hour - timedelta(days=8), True, "pi-b")  # out of 7 days
    # A lease that expired max_lease_attempts times: the back-off's record, now.
    insert_app(
        sql, "com.example.stuck", status="processing", processing_started=hour - timedelta(days=1)
    )
    sql.run("UPDATE apps SET lease_attempts = 3 WHERE appid = 'com.example.stuck'")
    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    assert sql.run("SELECT status FROM apps WHERE appid = 'com.example.stuck'") == [["failed"]]

    status, day = history_answer("window=24h")
    assert status == 200 and day["window"] == "24h"
    assert len(day["hours"]) == 24
    assert datetime.fromisoformat(day["hours"][-1]) == hour
    assert datetime.fromisoformat(day["hours"][0]) == hour - timedelta(hours=23)
    every = ("results", "failures", "expiredLeases", "backlog", "states", "failedByReason")
    assert {name: len(day[name]) for name in every} == dict.fromkeys(every, 24)
    assert (day["results"][-3:], day["failures"][-3:], day["expiredLeases"][-3:]) == (
        [2, 0, 1],
        [1, 0, 0],
        [0, 0, 1],
    )
    assert sum(day["results"]) == 3 and sum(day["failures"]) == 1
    by_name = {a["name"]: a for a in day["analysers"]}
    assert [a["name"] for a in day["analysers"]] == ["Pi-a", "pi-b", None]  # the shared last
    assert (by_name["pi-b"]["results"][-3], by_name["pi-b"]["failures"][-3]) == (1, 1)
    assert (sum(by_name[None]["results"]), sum(by_name[None]["failures"])) == (1, 0)

    status, week = history_answer()  # 7 days by default
    assert status == 200 and week["window"] == "7d" and len(week["hours"]) == 168
    assert (sum(week["results"]), sum(week["failures"]), sum(week["expiredLeases"])) == (3, 2, 1)
    assert week["backlog"] == [None] * 168  # no report has counted yet
    assert week["lastSnapshot"] is None


def test_the_snapshots_are_drawn_in_their_hours(web, sql):
    hour = this_hour(sql)
    backlog = {"queued": 7, "stale": 2}
    for hours_ago, queued in ((0, 7), (5, 4)):
        sql.run(
            "INSERT INTO queue_snapshots (hour, states, backlog, failed) VALUES"
            " (:hour, CAST(:states AS jsonb), CAST(:backlog AS jsonb), '{\"app_not_found\": 3}')",
            hour=hour - timedelta(hours=hours_ago),
            states=json.dumps({"queued": queued, "failed": 3}),
            backlog=json.dumps({**backlog, "queued": queued}),
        )
    _, day = history_answer("window=24h")
    assert day["backlog"][-1] == 9 and day["backlog"][-6] == 6
    assert day["backlog"].count(None) == 22
    assert day["states"][-6] == {"queued": 4, "failed": 3}  # as the snapshot holds it
    assert day["failedByReason"][-1] == {"app_not_found": 3}
    taken = sql.run("SELECT taken FROM queue_snapshots WHERE hour = :hour", hour=hour)[0][0]
    assert datetime.fromisoformat(day["lastSnapshot"]) == taken


@pytest.mark.parametrize("query", ["window=30d", "window=24H", "window=24h&window=7d"])
def test_any_other_window_is_refused(web, query):
    status, answer = history_answer(query)
    assert status == 400, answer
    assert "window" in answer["detail"]


def test_a_claim_and_a_result_write_no_history_of_their_own(web, sql):
    """Nothing on the claim's path writes queue_snapshots: only the report does."""
    insert_app(sql, "com.example.claimed")
    headers = {"Authorization": "Bearer test-upload-password"}
    answer = call_api(gateway_event("GET", "/queue", headers=headers))
    assert answer["statusCode"] == 200, answer
    assert snapshots(sql) == []
