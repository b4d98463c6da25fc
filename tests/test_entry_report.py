"""handler.report, the scheduled queue-status report, as EventBridge invokes it through
Lambda on a real PostgreSQL: its log record and EMF document, field by field; and the
commands it runs when invoked directly."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import handler
from helpers import (
    LambdaContext,
    app_row,
    history,
    insert_app,
    load_event,
    one_record,
    output_records,
    table_digest,
)

pytestmark = pytest.mark.usefixtures("lambda_container")


def arrange_every_state(sql) -> None:
    """Apps in every state under the default policy (version 4, 180 days, 120 min),
    their recent results, and two analysers' pings."""
    insert_app(sql, "app.queued.big", reviews="500", added=datetime(2025, 1, 1, tzinfo=UTC))
    insert_app(sql, "app.queued.small", reviews="50")
    insert_app(sql, "app.queued.mid", reviews="60")
    insert_app(sql, "app.queued.unknown", reviews="n/a")  # popularity 0
    insert_app(
        sql,
        "app.processing.live",
        status="processing",
        reviews="9000",
        processing_started=datetime.now(UTC) - _minutes(5),
    )
    insert_app(
        sql,
        "app.processing.expired",
        status="processing",
        reviews="400",
        processing_started=datetime.now(UTC) - _minutes(200),
    )
    insert_app(
        sql,
        "app.analysed.fresh",
        status="analysed",
        reviews="8000",
        version=4,
        analysed=datetime.now(UTC) - _minutes(60 * 24),
    )
    insert_app(
        sql,
        "app.analysed.stale",
        status="analysed",
        reviews="300",
        version=4,
        analysed=datetime.now(UTC) - _minutes(60 * 24 * 200),
    )
    insert_app(
        sql,
        "app.analysed.oldversion",
        status="analysed",
        reviews="200",
        version=3,
        analysed=datetime.now(UTC) - _minutes(60 * 24),
    )
    insert_app(
        sql,
        "app.failed.retry.fresh",
        status="failed",
        reviews="7000",
        version=4,
        retryable=True,
        analysed=datetime.now(UTC) - _minutes(60 * 24),
    )
    insert_app(
        sql,
        "app.failed.retry.old",
        status="failed",
        reviews="100",
        version=3,
        retryable=True,
        analysed=datetime.now(UTC) - _minutes(60 * 24),
    )
    insert_app(
        sql,
        "app.failed.final",
        status="failed",
        reviews="6000",
        version=3,
        retryable=False,
        reason="app_not_found",
        analysed=datetime.now(UTC) - _minutes(60 * 24 * 300),
    )
    insert_app(
        sql,
        "app.failed.final.fresh",
        status="failed",
        version=4,
        retryable=False,
        reason="ipa_too_large",
        analysed=datetime.now(UTC) - _minutes(60),
    )
    insert_app(
        sql,
        "app.failed.retry.fresh2",
        status="failed",
        version=4,
        retryable=True,
        analysed=datetime.now(UTC) - _minutes(60 * 3),
    )
    # History: 2 successes in the last hour, 4 more and a failure in the last day, one
    # success 3 days ago, one 10 days ago (outside the 7-day window).
    for appid, minutes, success in (
        ("app.analysed.fresh", 20, True),
        ("app.analysed.fresh", 40, True),
        ("app.analysed.fresh", 60 * 3, True),
        ("app.analysed.stale", 60 * 5, True),
        ("app.analysed.stale", 60 * 8, True),
        ("app.analysed.stale", 60 * 10, True),
        ("app.failed.retry.fresh", 60 * 2, False),
        ("app.analysed.oldversion", 60 * 24 * 3, True),
        ("app.analysed.oldversion", 60 * 24 * 10, True),
    ):
        sql.run(
            "INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, success)"
            " VALUES (:appid, CAST('{}' AS jsonb), 4,"
            " now() - make_interval(mins => :minutes), :success)",
            appid=appid,
            minutes=minutes,
            success=success,
        )
    sql.run(
        "INSERT INTO analyser_heartbeats (analyser_id, last_seen) VALUES"
        " ('pi-kitchen', now() - interval '12 minutes'), ('pi-attic', now() - interval '3 hours')"
    )
    # A named analyser that pinged a minute ago and was revoked: active nowhere.
    sql.run(
        "INSERT INTO analysers (name, token_hash, last_seen, revoked)"
        " VALUES ('pi-named', :hash, now() - interval '1 minute', now())",
        hash=handler.token_hash("aqa_revoked"),
    )


def assert_the_status_of_every_state(status: dict) -> None:
    """The queue-status document of arrange_every_state's queue, field by field: the one
    expectation the scheduled report's record and answer (here) and `queue-status --json`
    (tests/test_cli.py) are both held to, since they are one document."""
    assert status["counts"] == {"queued": 4, "processing": 2, "analysed": 3, "failed": 5}
    assert status["total"] == 14
    assert status["failed_retryable"] == 3
    assert status["failed_by_reason"] == [
        {"reason": "analysis_failed", "apps": 3},
        {"reason": "app_not_found", "apps": 1},
        {"reason": "ipa_too_large", "apps": 1},
    ]
    assert status["backlog"] == {
        "queued": 4,
        "lease_expired": 1,
        "outdated_version": 1,
        "stale": 1,
        "retry_failed": 1,
    }
    assert status["backlog_total"] == 8
    assert status["expired_leases"] == 1
    assert status["throughput"] == {
        "analysed_1h": 2,
        "failed_1h": 0,
        "analysed_24h": 6,
        "failed_24h": 1,
        "analysed_7d": 7,
        "failed_7d": 1,
        "outdated_24h": 0,
    }
    assert status["held_back"] == {
        "lease_expired_failures": 0,
        "abandoned_leases": 0,
        "outdated_settling": 0,
        "refetch_waiting": 0,
    }
    assert status["eta_hours"] == 27.4  # 8 apps at 7 finished per 24 h: 27.43 h
    assert abs(status["minutes_since_last_ping"] - 12.0) <= 0.5
    assert status["analysers_last_hour"] == 1
    # One named analyser (pi-named, revoked): its keys are snake_case like the rest.
    (named,) = status["analysers"]
    assert set(named) == {
        "name",
        "created",
        "rotated",
        "previous_token_valid_until",
        "revoked",
        "last_seen",
        "online",
        "holding",
        "last_result",
        "results_24h",
        "failures_24h",
        "outdated_version",
    }
    assert (named["name"], named["online"], named["results_24h"]) == ("pi-named", False, 0)
    processing = status["processing"]
    assert [(p["appid"], p["expired"]) for p in processing] == [
        ("app.processing.expired", True),
        ("app.processing.live", False),
    ]
    assert abs(processing[0]["age_minutes"] - 200) < 1
    assert abs(processing[1]["age_minutes"] - 5) < 1
    assert all(isinstance(datetime.fromisoformat(p["started"]), datetime) for p in processing)
    assert [(t["appid"], t["popularity"], t["reason"]) for t in status["top_backlog"]] == (
        EXPECTED_TOP_BACKLOG
    )
    assert status["top_backlog"][0]["added"] == "2025-01-01T00:00:00+00:00"
    assert status["policy"] == {
        "analysis_version": 4,
        "stale_days": 180,
        "processing_timeout_minutes": 120,
        "max_lease_attempts": 3,
    }
    assert set(status) == set(QUEUE_STATUS_KEYS)
    keys = all_keys(status)
    assert all(key == key.lower() for key in keys), keys  # snake_case throughout


# The top-level keys of the queue-status document (docs/monitoring.md).
QUEUE_STATUS_KEYS = (
    "counts",
    "total",
    "failed_retryable",
    "failed_by_reason",
    "backlog",
    "backlog_total",
    "expired_leases",
    "throughput",
    "eta_hours",
    "minutes_since_last_ping",
    "analysers_last_hour",
    "processing",
    "held_back",
    "analysers",
    "top_backlog",
    "policy",
)


def all_keys(value) -> list[str]:
    """Every object key in a JSON value, at any depth."""
    if isinstance(value, dict):
        return [key for k, v in value.items() for key in (k, *all_keys(v))]
    if isinstance(value, list):
        return [key for item in value for key in all_keys(item)]
    return []


def _minutes(value: float) -> timedelta:
    return timedelta(minutes=value)


EXPECTED_TOP_BACKLOG = [
    ("app.queued.big", 500, "queued"),
    ("app.processing.expired", 400, "lease_expired"),
    ("app.analysed.stale", 300, "stale"),
    ("app.analysed.oldversion", 200, "outdated_version"),
    ("app.failed.retry.old", 100, "retry_failed"),
    ("app.queued.mid", 60, "queued"),
    ("app.queued.small", 50, "queued"),
    ("app.queued.unknown", 0, "queued"),
]


def test_scheduled_report_log_and_metrics(database_url, sql, capsys):
    arrange_every_state(sql)
    capsys.readouterr()
    context = LambdaContext("analysis-queue-ReportFunction")
    returned = handler.report(load_event("schedule.json"), context)
    logs, emf = output_records(capsys.readouterr())

    record = one_record(logs, "queue status")
    assert record["level"] == "INFO"
    assert record["service"] == "analysis-queue"
    assert record["function_name"] == "analysis-queue-ReportFunction"
    assert record["function_arn"] == context.invoked_function_arn
    assert record["function_request_id"] == context.aws_request_id
    assert record["function_memory_size"] == 512
    assert isinstance(record["cold_start"], bool)
    status = record["queue_status"]
    assert_the_status_of_every_state(status)
    assert returned == status

    (document,) = emf
    assert document["service"] == "analysis-queue"
    meta = document["_aws"]
    assert abs(meta["Timestamp"] / 1000 - time.time()) < 60
    (directive,) = meta["CloudWatchMetrics"]
    assert directive["Namespace"] == "AnalysisQueue"
    assert directive["Dimensions"] == [["service"]]
    units = {metric["Name"]: metric["Unit"] for metric in directive["Metrics"]}
    expected = {
        "Backlog": 8,
        "Queued": 4,
        "Processing": 2,
        "Failed": 5,
        "AnalysedLast24h": 6,
        "OutdatedResultsLast24h": 0,
        "ActiveAnalysers": 1,
        "EtaHours": 27.4,
        # The dashboard's: the backlog by reason, results in the last hour, failed apps
        # by class (zero for the classes no app is in).
        "BacklogQueued": 4,
        "ExpiredLeases": 1,
        "BacklogOutdatedVersion": 1,
        "BacklogStale": 1,
        "BacklogRetryFailed": 1,
        "AnalysedLastHour": 2,
        "FailedLastHour": 0,
        "FailedAnalysisFailed": 3,
        "FailedAppNotFound": 1,
        "FailedIpaTooLarge": 1,
        "FailedIosVersionTooLow": 0,
        "FailedPaidApp": 0,
        "FailedInvalidBundleId": 0,
        "FailedLeaseExpired": 0,
        "FailedOther": 0,
    }
    assert set(units) == {*expected, "MinutesSinceLastPing", "OldestLeaseMinutes"}
    assert set(document) == {"_aws", "service", *units}
    # Counts are Counts; hours and minutes have no CloudWatch unit and name theirs.
    assert units == {
        **{name: "Count" for name in expected if name != "EtaHours"},
        "EtaHours": "None",
        "MinutesSinceLastPing": "None",
        "OldestLeaseMinutes": "None",
    }
    for name, value in expected.items():
        assert document[name] in ([value], value), name
    ping = document["MinutesSinceLastPing"]
    ping = ping[0] if isinstance(ping, list) else ping
    assert ping == status["minutes_since_last_ping"]
    oldest = document["OldestLeaseMinutes"]
    oldest = oldest[0] if isinstance(oldest, list) else oldest
    assert abs(oldest - 200) < 1  # app.processing.expired's lease


def test_report_with_no_throughput_and_no_ping(database_url, sql, capsys):
    insert_app(sql, "app.queued.only", reviews="1")
    capsys.readouterr()
    handler.report(load_event("schedule.json"), LambdaContext())
    logs, emf = output_records(capsys.readouterr())
    status = one_record(logs, "queue status")["queue_status"]
    assert status["backlog_total"] == 1
    assert status["eta_hours"] is None  # nothing finished in a day: unbounded
    assert status["minutes_since_last_ping"] is None
    (document,) = emf
    names = {metric["Name"] for metric in document["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    # The ETA alarm sees a huge value; the ping alarm treats the missing metric as breaching.
    assert document["EtaHours"] in ([1e6], 1e6)
    assert "MinutesSinceLastPing" not in names
    assert document["Backlog"] in ([1], 1)
    assert document["OldestLeaseMinutes"] in ([0], 0)  # nothing is being processed


@settings(deadline=None)
@given(
    st.dictionaries(
        st.one_of(
            st.sampled_from([*handler.FAILURE_REASON_METRICS, "unclassified"]),
            st.text(min_size=1, max_size=20),
        ),
        st.integers(min_value=0, max_value=10**9),
        max_size=12,
    )
)
def test_failed_apps_by_class_add_up_to_the_failed_apps(failed_by_reason):
    """Whatever reasons failed apps carry (the service's, an analyser's own, none), each is
    counted once: its class's metric, or FailedOther; the classes add up to Failed."""
    status = handler.QueueStatus(
        counts={"failed": sum(failed_by_reason.values())},
        failed_by_reason=failed_by_reason,
        throughput={"analysed_24h": 0, "analysed_1h": 0, "failed_1h": 0, "outdated_24h": 0},
        eta_hours=None,
    )
    values = handler.queue_metrics(status)
    classes = [*handler.FAILURE_REASON_METRICS.values(), handler.OTHER_FAILURES_METRIC]
    assert sum(values[name] for name in classes) == values["Failed"]
    for reason, name in handler.FAILURE_REASON_METRICS.items():
        assert values[name] == failed_by_reason.get(reason, 0)
    others = sum(n for r, n in failed_by_reason.items() if r not in handler.FAILURE_REASON_METRICS)
    assert values[handler.OTHER_FAILURES_METRIC] == others


def test_report_priority_report_command(database_url, sql, capsys):
    arrange_every_state(sql)
    before = table_digest(sql)
    capsys.readouterr()
    result = handler.report({"command": "priority-report", "limit": 3}, LambdaContext())
    assert result["command"] == "priority-report"
    assert [(a["appid"], a["popularity"], a["reason"]) for a in result["apps"]] == (
        EXPECTED_TOP_BACKLOG[:3]
    )
    logs, emf = output_records(capsys.readouterr())
    assert one_record(logs, "priority report")["priority_report"] == result["apps"]
    assert emf == []
    assert table_digest(sql) == before

    default = handler.report({"command": "priority-report"}, LambdaContext())
    assert len(default["apps"]) == len(EXPECTED_TOP_BACKLOG)


def outcome_counts(**apps: int) -> list[dict]:
    """The report's `outcomes`: each of the refetch vocabulary, in its order, zeros kept."""
    return [{"outcome": name, "apps": apps.get(name, 0)} for name in handler.REFETCH_OUTCOMES]


def test_report_queue_refetch_command_dry_run_then_apply(database_url, sql, capsys):
    analysis = {"success": True, "trackers": {"a": "b"}}
    insert_app(
        sql,
        "com.example.done",
        status="analysed",
        version=4,
        analysed=datetime.now(UTC),
        analysis=analysis,
    )
    insert_app(sql, "com.example.other", status="analysed", version=4, analysed=datetime.now(UTC))
    before = table_digest(sql)

    dry = handler.report(
        {"command": "queue-refetch", "appIds": ["COM.example.DONE", "com.example.nope"]},
        LambdaContext(),
    )
    assert dry == {
        "command": "queue-refetch",
        "applied": False,
        "selected": 1,
        "queuedNow": 1,  # what --apply would do now
        "outcomes": outcome_counts(queued=1),
        "apps": [{"appId": "com.example.done", "status": "analysed", "outcome": "queued"}],
        "batches": 1,
        "complete": True,
        "unknown": ["com.example.nope"],  # named, not in the queue
    }
    assert table_digest(sql) == before
    with pytest.raises(handler.BadInput, match="apply must be true or false"):
        handler.report(
            {"command": "queue-refetch", "appIds": ["com.example.done"], "apply": "true"},
            LambdaContext(),
        )
    assert table_digest(sql) == before

    capsys.readouterr()
    done = handler.report(
        {"command": "queue-refetch", "appIds": ["com.example.done"], "apply": True},
        LambdaContext(),
    )
    assert done == {**dry, "applied": True, "unknown": []}
    logs, _ = output_records(capsys.readouterr())
    assert one_record(logs, "queue refetch")["queue_refetch"] == done
    row = app_row(sql, "com.example.done")
    assert row["status"] == "queued"
    assert row["analysis"] == analysis  # visible until the new result arrives
    assert history(sql, "com.example.done") == [[analysis, 4, True]]
    assert app_row(sql, "com.example.other")["status"] == "analysed"


def test_report_queue_refetch_failed_apps(database_url, sql):
    insert_app(
        sql,
        "app.failed.retry",
        status="failed",
        retryable=True,
        version=4,
        analysed=datetime.now(UTC),
    )
    insert_app(
        sql,
        "app.failed.final",
        status="failed",
        retryable=False,
        reason="app_not_found",
        version=4,
        analysed=datetime.now(UTC),
    )
    retryable = handler.report({"command": "queue-refetch", "failed": True}, LambdaContext())
    assert [app["appId"] for app in retryable["apps"]] == ["app.failed.retry"]
    every = handler.report(
        {"command": "queue-refetch", "failed": True, "includeNonRetryable": True, "limit": 5},
        LambdaContext(),
    )
    assert sorted(app["appId"] for app in every["apps"]) == ["app.failed.final", "app.failed.retry"]
    assert app_row(sql, "app.failed.retry")["status"] == "failed"


def test_report_unknown_command_fails_clearly(database_url, sql):
    insert_app(sql, "com.example.app")
    before = table_digest(sql)
    with pytest.raises(handler.BadInput, match="unknown command 'queue-purge'"):
        handler.report({"command": "queue-purge", "apply": True}, LambdaContext())
    assert table_digest(sql) == before


@pytest.mark.parametrize(
    ("event", "complaint"),
    [
        # A misspelt key must not turn "these apps" into "every analysed app".
        ({"command": "queue-refetch", "appId": ["com.example.app"], "apply": True}, "appId"),
        ({"command": "queue-refetch", "appIds": "com.example.app", "apply": True}, "appIds"),
        ({"command": "queue-refetch", "appIds": ["not a bundle id"], "apply": True}, "appIds"),
        ({"command": "queue-refetch", "limit": "5", "apply": True}, "limit"),
        ({"command": "queue-refetch", "limit": 0, "apply": True}, "limit"),
        ({"command": "queue-refetch", "failed": "yes", "apply": True}, "failed"),
        ({"command": "priority-report", "limit": -1}, "limit"),
        ({"command": "priority-report", "top": 5}, "top"),
    ],
)
def test_report_commands_reject_malformed_options(database_url, sql, event, complaint):
    insert_app(sql, "com.example.app", status="analysed", version=4, analysed=datetime.now(UTC))
    before = table_digest(sql)
    with pytest.raises(handler.BadInput, match=complaint):
        handler.report(event, LambdaContext())
    assert table_digest(sql) == before
