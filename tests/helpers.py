"""Arranging queue rows directly in the database, for tests and benchmarks."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import handler


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


# --- the oracle ----------------------------------------------------------------------
# The queue's candidate rule (README, "The queue") written out in Python, evaluated on
# the rows themselves; whatever /queue hands out must be the first candidate in its order.


def popularity(details) -> int:
    reviews = (details or {}).get("reviews")
    if isinstance(reviews, bool) or reviews is None:
        return 0
    text = str(reviews)
    return int(text) if re.fullmatch(r"[0-9]+", text) else 0


def is_candidate(row: dict, policy: handler.QueuePolicy, now: datetime) -> bool:
    status = row["status"]
    if status == "queued":
        return True
    if status == "processing":
        started = row["processing_started"]
        return started is None or started < now - timedelta(
            minutes=policy.processing_timeout_minutes
        )
    eligible = status == "analysed" or (status == "failed" and row["failure_retryable"])
    if not eligible:
        return False
    old_version = (row["analysisversion"] or 0) < policy.analysis_version
    stale = row["analysed"] is None or row["analysed"] < now - timedelta(days=policy.stale_days)
    return old_version or stale


def oracle_order(sql, policy: handler.QueuePolicy) -> list[str]:
    ((now,),) = sql.run("SELECT now()")
    columns = [
        "appid",
        "details",
        "status",
        "processing_started",
        "failure_retryable",
        "analysisversion",
        "analysed",
        "added",
    ]
    rows = [
        dict(zip(columns, r, strict=True))
        for r in sql.run(f"SELECT {', '.join(columns)} FROM apps")
    ]
    candidates = [r for r in rows if is_candidate(r, policy, now)]
    candidates.sort(key=lambda r: (-popularity(r["details"]), r["added"], r["appid"]))
    return [r["appid"] for r in candidates]


# --- API Gateway events --------------------------------------------------------------


def gateway_event(
    method: str,
    path: str,
    query: str = "",
    headers: dict[str, str] | None = None,
    body: bytes | str | None = None,
    base64_body: bool = False,
) -> dict:
    """An HTTP API (payload 2.0) event as API Gateway sends it to handler.api."""
    if isinstance(body, bytes):
        body = base64.b64encode(body).decode() if base64_body else body.decode("latin-1")
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": query,
        "headers": {"host": "api.example.com", **(headers or {})},
        "requestContext": {
            "http": {
                "method": method,
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": "203.0.113.9",
            },
            "requestId": "test",
            "stage": "$default",
        },
        "body": body,
        "isBase64Encoded": base64_body,
    }


# --- the CLI ---------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python handler.py ARGS` in its own process with env, as an operator runs it."""
    return subprocess.run(
        [sys.executable, str(handler.HERE / "handler.py"), *args],
        env=env,
        cwd=handler.HERE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
