"""Arranging queue rows directly in the database, for tests and benchmarks."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta


def days_ago(days: float) -> datetime:
    return datetime.now(UTC) - timedelta(days=days)


def minutes_ago(minutes: float) -> datetime:
    return datetime.now(UTC) - timedelta(minutes=minutes)


def insert_app(
    sql,
    appid: str,
    *,
    status: str = "queued",
    reviews=None,
    added: datetime | None = None,
    analysed: datetime | None = None,
    version: int | None = None,
    processing_started: datetime | None = None,
    retryable: bool | None = None,
    reason: str | None = None,
    analysis=None,
) -> None:
    """One apps row in a given state, as the service would have left it."""
    details = {"appId": appid, "title": appid}
    if reviews is not None:
        details["reviews"] = reviews
    if analysis is None and status == "analysed":
        analysis = {"success": True, "bundleID": appid, "trackers": {}}
    if analysis is None and status == "failed":
        analysis = {"success": False, "logs": "boom", "reason": reason, "retryable": retryable}
    if status == "failed" and reason is None:
        reason = "analysis_failed"
    sql.run(
        """INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added, status,
                             processing_started, failure_reason, failure_retryable)
           VALUES (:appid, CAST(:details AS jsonb), CAST(:analysis AS jsonb), :version,
                   :analysed, COALESCE(CAST(:added AS timestamptz), now()), :status,
                   :started, :reason, :retryable)""",
        appid=appid,
        details=json.dumps(details),
        analysis=None if analysis is None else json.dumps(analysis),
        version=version,
        analysed=analysed,
        added=added,
        status=status,
        started=processing_started,
        reason=reason if status == "failed" else None,
        retryable=retryable if status == "failed" else None,
    )


def app_row(sql, appid: str) -> dict:
    columns = [
        "appid",
        "status",
        "analysis",
        "analysisversion",
        "analysed",
        "processing_started",
        "failure_reason",
        "failure_retryable",
        "claim_token",
        "due",
    ]
    # The service's claim token is apps.analysis_claim_token (uuid), compared as the text
    # the X-Analysis-Claim-Token header carries.
    selected = [
        "CAST(analysis_claim_token AS text)" if name == "claim_token" else name for name in columns
    ]
    rows = sql.run(f"SELECT {', '.join(selected)} FROM apps WHERE appid = :appid", appid=appid)
    return dict(zip(columns, rows[0], strict=True)) if rows else None


def history(sql, appid: str) -> list:
    return sql.run(
        "SELECT analysis, analysisversion, success FROM app_analyses WHERE appid = :appid"
        " ORDER BY id",
        appid=appid,
    )


def table_digest(sql) -> list:
    """Everything the API could change, to prove a rejected request changed nothing."""
    return [
        sql.run("SELECT * FROM apps ORDER BY appid"),
        sql.run("SELECT * FROM app_analyses ORDER BY id"),
        sql.run("SELECT analyser_id, pings FROM analyser_heartbeats ORDER BY analyser_id"),
    ]
