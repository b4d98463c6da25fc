"""A queue in every state, and the queue-status document it reads as: the scheduled
report (tests/test_entry_report.py) and `queue-status --json` (tests/test_cli.py) are held
to the one expectation, since they are one document."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import handler
from helpers import insert_app


def arrange_every_state(sql) -> None:
    """Apps in every state under the default policy (version 4, 180 days, 120 min,
    RETRY_BACKOFF 1h,6h,1d): retries due, waiting and past their last step, a held app,
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
    # Held by an operator: no candidate, however popular.
    insert_app(sql, "app.queued.held", reviews="9999", held=True)
    # Retryable failures at the current version under RETRY_BACKOFF 1h,6h,1d: a first
    # failure half an hour ago (its retry falls due in the next hour), and a fourth in a
    # row two days ago (past the last step: it waits for staleness or a version bump).
    insert_app(
        sql,
        "app.failed.retry.soon",
        status="failed",
        reviews="20",
        version=4,
        retryable=True,
        analysed=datetime.now(UTC) - _minutes(30),
    )
    insert_app(
        sql,
        "app.failed.retry.exhausted",
        status="failed",
        reviews="30",
        version=4,
        retryable=True,
        streak=4,
        analysed=datetime.now(UTC) - _minutes(60 * 48),
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
    assert status["counts"] == {"queued": 5, "processing": 2, "analysed": 3, "failed": 7}
    assert status["total"] == 17
    assert status["failed_retryable"] == 5
    assert status["failed_by_reason"] == [
        {"reason": "analysis_failed", "apps": 5},
        {"reason": "app_not_found", "apps": 1},
        {"reason": "ipa_too_large", "apps": 1},
    ]
    assert status["backlog"] == {
        "queued": 4,
        "lease_expired": 1,
        "outdated_version": 1,
        "stale": 1,
        "retry_failed": 1,
        # The retries due (a first failure a day and three hours ago): the lowest tier.
        "retry_due": 2,
    }
    assert status["backlog_total"] == 10
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
        "retries_next_hour": 1,
        "retries_waiting": 1,
        "retries_exhausted": 1,
        "held_apps": 1,
    }
    assert status["eta_hours"] == 34.3  # 10 apps at 7 finished per 24 h: 34.29 h
    assert status["paused"] == {
        "paused": False,
        "paused_at": None,
        "paused_by": None,
        "reason": None,
    }
    assert (status["broken_analysers"], status["paused_analysers"]) == (0, 0)
    assert status["failure_ratio_1h"] == 0.0  # 2 results in the last hour, no failure
    # The last ping is pi-named's, a minute ago (revoked since: it pinged all the same);
    # of the active analysers, only the heartbeat of 12 minutes ago counts.
    assert abs(status["minutes_since_last_ping"] - 1.0) <= 0.5
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
        "consecutive_failures",
        "failing_since",
        "broken",
        "paused",
    }
    assert (named["name"], named["online"], named["results_24h"]) == ("pi-named", False, 0)
    assert (named["broken"], named["paused"], named["failing_since"]) == (False, None, None)
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
        "retry_backoff": "1h,6h,1d",
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
    "paused",
    "broken_analysers",
    "paused_analysers",
    "failure_ratio_1h",
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
    # The lowest tier, last whatever its popularity: retries due, in claim order.
    ("app.failed.retry.fresh", 7000, "retry_due"),
    ("app.failed.retry.fresh2", 0, "retry_due"),
]
