"""handler.report, the scheduled queue-status report, as EventBridge invokes it through
Lambda on a real PostgreSQL: its log record and EMF document, field by field; and the
commands it runs when invoked directly."""

from __future__ import annotations

import time
from datetime import UTC, datetime

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
from queue_status import (
    EXPECTED_TOP_BACKLOG,
    arrange_every_state,
    assert_the_status_of_every_state,
)

pytestmark = pytest.mark.usefixtures("lambda_container")


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
    # The metrics the alarms and the dashboard read, and no more (REPORT_METRICS): the
    # rest of the status (held apps, retries, the backlog by reason, failures by class)
    # is in the log record above, checked by assert_the_status_of_every_state.
    expected = {
        "Backlog": 10,
        "ActiveAnalysers": 1,
        "EtaHours": 34.3,
        "BrokenAnalysers": 0,
        "FailureRatioLastHour": 0,
        "AnalysedLastHour": 2,
    }
    assert set(units) == {*expected, "MinutesSinceLastPing", "OldestLeaseMinutes"}
    assert set(document) == {"_aws", "service", *units}
    # Counts are Counts; hours and minutes have no CloudWatch unit and name theirs.
    unitless = {"EtaHours", "FailureRatioLastHour"}
    assert units == {
        **{name: "Count" for name in expected if name not in unitless},
        "EtaHours": "None",
        "FailureRatioLastHour": "None",
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
    failed_by_reason=st.dictionaries(
        st.text(min_size=1, max_size=20), st.integers(min_value=0, max_value=10**9), max_size=6
    ),
    minutes_since_last_ping=st.none() | st.floats(min_value=0, max_value=1e6),
)
def test_the_report_publishes_only_the_metrics_alarms_and_dashboard_read(
    failed_by_reason, minutes_since_last_ping
):
    """Whatever the queue holds, the report's metrics are REPORT_METRICS (each a billed
    custom metric; at most 8, with the two log metric filters within CloudWatch's ten
    free): all of them, MinutesSinceLastPing only once an analyser pinged."""
    status = handler.QueueStatus(
        counts={"failed": sum(failed_by_reason.values())},
        failed_by_reason=failed_by_reason,
        throughput={"analysed_24h": 5, "analysed_1h": 2, "failed_1h": 1, "outdated_24h": 0},
        eta_hours=None,
        minutes_since_last_ping=minutes_since_last_ping,
    )
    values = handler.queue_metrics(status)
    assert len(handler.REPORT_METRICS) <= 8
    expected = set(handler.REPORT_METRICS)
    if minutes_since_last_ping is None:
        expected.discard("MinutesSinceLastPing")
    assert set(values) == expected
    assert values["AnalysedLastHour"] == 2
    assert values["FailureRatioLastHour"] == handler.failure_ratio(status.throughput) == 0.333


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
        ({"command": "queue-refetch", "failedBy": "no such/name", "apply": True}, "failedBy"),
        ({"command": "queue-refetch", "since": "1h", "failed": True, "apply": True}, "since"),
        ({"command": "queue-refetch", "failedBy": "pi", "since": "soon", "apply": True}, "since"),
        ({"command": "why"}, "appId"),
        ({"command": "why", "appId": "not a bundle id"}, "appId"),
        ({"command": "why", "appIds": ["com.example.app"]}, "appIds"),
        ({"command": "queue-hold", "appId": "com.example.app", "force": "yes"}, "force"),
        ({"command": "queue-hold", "appId": "com.example.app", "reason": 5}, "reason"),
        ({"command": "queue-hold", "appid": "com.example.app"}, "appid"),
        ({"command": "queue-release", "appId": "com.example.app", "force": True}, "force"),
        ({"command": "queue-pause", "reason": "x" * 501}, "reason"),
        ({"command": "queue-pause", "why": "upgrade"}, "why"),
        ({"command": "queue-resume", "reason": "done"}, "reason"),
        ({"command": "analysers-pause"}, "name"),
        ({"command": "analysers-pause", "name": "bad name"}, "name"),
        ({"command": "analysers-resume", "name": "pi", "force": True}, "force"),
    ],
)
def test_report_commands_reject_malformed_options(database_url, sql, event, complaint):
    insert_app(sql, "com.example.app", status="analysed", version=4, analysed=datetime.now(UTC))
    before = [*table_digest(sql), *operators_state(sql)]
    with pytest.raises(handler.BadInput, match=complaint):
        handler.report(event, LambdaContext())
    assert [*table_digest(sql), *operators_state(sql)] == before


def operators_state(sql) -> list:
    """The holds, the pauses and the operators' record."""
    return [
        sql.run("SELECT appid, held_at, held_by, hold_reason FROM apps ORDER BY appid"),
        sql.run("SELECT name, paused_at, paused_by FROM analysers ORDER BY name"),
        sql.run("SELECT paused_at, paused_by, reason FROM queue_pause"),
        sql.run("SELECT count(*) FROM operator_actions"),
    ]


def test_report_operator_commands_act_log_and_record(database_url, sql, capsys):
    """The report function's why, queue-hold, queue-release, queue-pause, queue-resume,
    analysers-pause and analysers-resume: each answers as the CLI's command does (the
    same outcome), logs one "operator command" record with that answer, and each change is
    recorded as the report function's, by the invocation's request id."""
    insert_app(sql, "com.Example.App", status="analysed", version=4, analysed=datetime.now(UTC))
    sql.run(
        "INSERT INTO analysers (name, token_hash) VALUES ('pi-kitchen', :hash)",
        hash=handler.token_hash("aqa_kitchen"),
    )
    context = LambdaContext("analysis-queue-ReportFunction")
    events = [
        ({"command": "why", "appId": "com.example.app"}, None),
        ({"command": "queue-hold", "appId": "com.example.app", "reason": "legal"}, "held"),
        ({"command": "queue-hold", "appId": "com.example.app", "force": True}, "already_held"),
        ({"command": "why", "appId": "com.example.app"}, None),
        ({"command": "queue-release", "appId": "com.example.app"}, "released"),
        ({"command": "queue-pause", "reason": "upgrade"}, "paused"),
        ({"command": "queue-resume"}, "resumed"),
        ({"command": "analysers-pause", "name": "pi-kitchen"}, "paused"),
        ({"command": "analysers-resume", "name": "pi-kitchen"}, "resumed"),
        ({"command": "analysers-resume", "name": "pi-kitchen"}, "unchanged"),
    ]
    answers = []
    for event, outcome in events:
        capsys.readouterr()
        answer = handler.report(event, context)
        logs, emf = output_records(capsys.readouterr())
        assert one_record(logs, "operator command")["report_action"] == answer
        assert emf == []
        assert answer["command"] == event["command"]
        assert answer.get("outcome") == outcome, event
        answers.append(answer)
    assert (answers[0]["appId"], answers[0]["candidate"], answers[0]["held"]) == (
        "com.Example.App",
        False,
        "fresh",
    )
    assert (answers[3]["held"], answers[3]["hold"]["reason"]) == ("hold", "legal")
    assert answers[3]["hold"]["by"] == f"report function ({context.aws_request_id})"
    recorded = sql.run("SELECT actor, source, action FROM operator_actions ORDER BY at, id")
    assert {(actor, source) for actor, source, _ in recorded} == {
        ("report function", context.aws_request_id)
    }
    assert [action for _, _, action in recorded] == [
        "hold app",
        "release app",
        "pause queue",
        "resume queue",
        "pause analyser",
        "resume analyser",
    ]
    with pytest.raises(handler.NoSuchApp):
        handler.report({"command": "why", "appId": "com.example.nope"}, context)
    with pytest.raises(handler.UnknownAnalyser):
        handler.report({"command": "analysers-pause", "name": "pi-nope"}, context)
