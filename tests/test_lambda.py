"""The Lambda entry points as Lambda calls them, on a real PostgreSQL.

* handler.api: every API event in events/ (configured by events/env.json, as sam local
  does), with its status, body and headers.
* handler.migrate: the custom resource end to end, answering a local HTTP server that
  stands in for CloudFormation's pre-signed ResponseURL.
* handler.report: the scheduled queue-status report (its log record and EMF document,
  field by field) and the commands it runs when invoked directly.
* Secrets from Secrets Manager and SSM (moto), cached, never logged; boto3 is imported
  only when a secret is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import handler
from conftest import configure_service, connect
from helpers import app_row, history, insert_app, table_digest
from live import TcpProxy

EVENTS = handler.HERE / "events"
UNREACHABLE_DATABASE = "postgresql://postgres@127.0.0.1:9/unreachable"
LEDGER_FILES = sorted(path.name for path in handler.SQL_DIR.glob("*.sql"))

# Every file in events/ and the test that invokes it through its entry point.
EVENT_TESTS = {
    "add-app.json": "test_event_add_app",
    "cfn-create.json": "test_custom_resource_create_applies_the_ledger",
    "cfn-delete.json": "test_custom_resource_delete_touches_no_database",
    "cfn-update.json": "test_custom_resource_update_applies_pending_files",
    "env.json": "test_event_env_json_configures_every_function",
    "get-app.json": "test_event_get_app",
    "healthz-analyser.json": "test_event_healthz_analyser",
    "healthz.json": "test_event_healthz",
    "ping.json": "test_event_ping",
    "queue-exact-app.json": "test_event_queue_exact_app",
    "queue.json": "test_event_queue",
    "report-failure.json": "test_event_report_failure",
    "schedule.json": "test_scheduled_report_log_and_metrics",
    "upload-analysis.json": "test_event_upload_analysis",
}


def LambdaContext(
    name: str = "analysis-queue-Function", remaining_ms: int = 600_000
) -> handler.LocalContext:
    return handler.LocalContext(remaining_ms / 1000, function_name=name)


def load_event(name: str) -> dict:
    return json.loads((EVENTS / name).read_text())


def env_json(function: str) -> dict[str, str]:
    return json.loads((EVENTS / "env.json").read_text())[function]


def configure_function(monkeypatch, function: str, url: str, **extra: str) -> None:
    """The service configured as `sam local --env-vars events/env.json` configures
    `function`, with DATABASE_URL pointing at `url`."""
    variables = {k: v for k, v in env_json(function).items() if k != "DATABASE_URL"}
    configure_service(monkeypatch, url, **{**variables, **extra})
    for name in ("UPLOAD_PASSWORD", "ADMIN_TOKEN"):
        if name not in variables and name not in extra:
            monkeypatch.delenv(name, raising=False)
    handler.use_runtime(None)


@pytest.fixture(autouse=True)
def _isolated():
    """Each test starts without cached settings, connection or secrets."""
    from aws_lambda_powertools.utilities import parameters

    parameters.clear_caches()
    yield
    parameters.clear_caches()
    handler.use_runtime(None)


@pytest.fixture
def api(database_url, monkeypatch):
    """Invoke handler.api with an event from events/ (optionally changed)."""
    configure_function(monkeypatch, "ApiFunction", database_url)

    def invoke(name: str, headers: dict[str, str] | None = None) -> dict:
        event = load_event(name)
        event["headers"] = {**event["headers"], **(headers or {})}
        return handler.api(event, LambdaContext("analysis-queue-ApiFunction"))

    return invoke


def json_answer(answer: dict) -> object:
    assert answer["headers"]["content-type"] == "application/json"
    assert answer["isBase64Encoded"] is False
    assert int(answer["headers"]["content-length"]) == len(answer["body"].encode())
    return json.loads(answer["body"])


def text_answer(answer: dict) -> str:
    assert answer["headers"]["content-type"] == "text/plain; charset=utf-8"
    assert answer["isBase64Encoded"] is False
    return answer["body"]


# ---------------------------------------------------------------------------------------
# events/: every file, through its entry point.
# ---------------------------------------------------------------------------------------


def test_every_event_file_has_its_test():
    assert sorted(path.name for path in EVENTS.glob("*.json")) == sorted(EVENT_TESTS)
    for test_name in EVENT_TESTS.values():
        assert callable(globals().get(test_name)), test_name


def test_event_env_json_configures_every_function(database_url, monkeypatch):
    # The API events carry the tokens env.json gives ApiFunction.
    api_env = env_json("ApiFunction")
    assert load_event("ping.json")["headers"]["authorization"] == (
        f"Bearer {api_env['UPLOAD_PASSWORD']}"
    )
    assert load_event("add-app.json")["headers"]["authorization"] == (
        f"Bearer {api_env['ADMIN_TOKEN']}"
    )
    # Its empty values mean "not set", and DB_* are unused next to DATABASE_URL.
    configure_function(monkeypatch, "ApiFunction", database_url)
    config = handler.settings()
    assert (config.upload_password, config.admin_token) == (
        "local-upload-password",
        "local-admin-token",
    )
    assert config.upload_password_secret is None and config.admin_token_secret is None
    assert config.db_host is None and config.db_secret_id is None
    # MigrationFunction and ReportFunction run with their env.json blocks.
    configure_function(monkeypatch, "MigrationFunction", database_url)
    assert handler.settings().upload_password is None
    create = {**load_event("cfn-create.json"), "ResponseURL": ""}
    assert handler.migrate(create, LambdaContext())["Status"] == "SUCCESS"
    configure_function(monkeypatch, "ReportFunction", database_url)
    status = handler.report(load_event("schedule.json"), LambdaContext())
    assert status["total"] == 0 and status["backlog_total"] == 0


def test_event_ping(api, sql):
    answer = api("ping.json")
    assert answer["statusCode"] == 200
    assert text_answer(answer) == "online"
    # Known by source address and User-Agent (no X-Analyser-Id in the event).
    assert sql.run(
        "SELECT analyser_id, source_address, user_agent, pings FROM analyser_heartbeats"
    ) == [["203.0.113.10 curl/7.88.1", "203.0.113.10", "curl/7.88.1", 1]]
    api("ping.json")
    assert sql.run("SELECT pings FROM analyser_heartbeats") == [[2]]

    wrong = api("ping.json", {"authorization": "Bearer local-admin-token"})
    assert wrong["statusCode"] == 401
    assert json_answer(wrong) == {"detail": "Please provide correct password."}
    assert wrong["headers"]["www-authenticate"] == "Bearer"
    assert sql.run("SELECT pings FROM analyser_heartbeats") == [[2]]


def test_event_queue(api, sql):
    insert_app(sql, "com.example.app", reviews="20")
    insert_app(sql, "com.example.other", reviews="3")

    first = api("queue.json")
    assert first["statusCode"] == 200
    assert text_answer(first) == "com.example.app"
    token = first["headers"]["x-analysis-claim-token"]
    assert len(token) >= 20
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["claim_token"]) == ("processing", token)
    assert row["processing_started"] is not None

    second = api("queue.json")
    assert text_answer(second) == "com.example.other"
    assert second["headers"]["x-analysis-claim-token"] != token

    empty = api("queue.json")
    assert (empty["statusCode"], text_answer(empty)) == (200, "")
    assert "x-analysis-claim-token" not in empty["headers"]


def test_event_queue_exact_app(api, sql):
    insert_app(sql, "com.example.popular", reviews="999999")
    insert_app(sql, "com.example.app", reviews="1")

    answer = api("queue-exact-app.json")
    assert answer["statusCode"] == 200
    assert text_answer(answer) == "com.example.app"
    assert (
        app_row(sql, "com.example.app")["claim_token"]
        == (answer["headers"]["x-analysis-claim-token"])
    )
    assert app_row(sql, "com.example.popular")["status"] == "queued"
    # Now under a live lease: not a candidate, so exact-app mode answers empty.
    again = api("queue-exact-app.json")
    assert (again["statusCode"], text_answer(again)) == (200, "")
    assert "x-analysis-claim-token" not in again["headers"]


def test_event_upload_analysis(api, sql):
    event_body = json.loads(load_event("upload-analysis.json")["body"])
    unknown = api("upload-analysis.json")
    assert unknown["statusCode"] == 404
    assert json_answer(unknown) == {"detail": "unknown app com.example.app"}
    assert sql.run("SELECT count(*) FROM apps") == [[0]]

    insert_app(sql, "com.example.app", reviews="1234")
    assert text_answer(api("queue.json")) == "com.example.app"
    answer = api("upload-analysis.json")
    assert answer["statusCode"] == 200
    body = json_answer(answer)
    assert body["rowCount"] == 1
    (row,) = body["rows"]
    assert row["appid"] == "com.example.app"
    assert row["details"] == {
        "appId": "com.example.app",
        "title": "com.example.app",
        "reviews": "1234",
    }
    analysed = datetime.fromisoformat(row["analysed"])
    assert abs((datetime.now(UTC) - analysed).total_seconds()) < 60

    stored = app_row(sql, "com.example.app")
    assert (stored["status"], stored["analysisversion"]) == ("analysed", 4)
    assert stored["analysis"] == event_body
    assert stored["claim_token"] is None and stored["processing_started"] is None
    assert history(sql, "com.example.app") == [[event_body, 4, True]]


def test_event_report_failure(api, sql):
    insert_app(sql, "com.example.app")
    assert text_answer(api("queue.json")) == "com.example.app"
    answer = api("report-failure.json")
    assert answer["statusCode"] == 200
    body = json_answer(answer)
    assert body["rowCount"] == 1
    assert [row["appid"] for row in body["rows"]] == ["com.example.app"]

    stored = app_row(sql, "com.example.app")
    assert stored["status"] == "failed"
    assert (stored["failure_reason"], stored["failure_retryable"]) == ("app_not_found", False)
    assert stored["analysis"] == {
        "success": False,
        "logs": load_event("report-failure.json")["body"],
        "reason": "app_not_found",
        "retryable": False,
    }
    assert history(sql, "com.example.app")[0][1:] == [4, False]
    # Not retryable: never handed out again.
    assert text_answer(api("queue.json")) == ""


def test_event_add_app(api, sql):
    created = api("add-app.json")
    assert created["statusCode"] == 201
    body = json_answer(created)
    assert body["appId"] == "com.example.app"
    assert body["status"] == "queued"
    assert body["details"] == {"title": "Example", "reviews": "1234"}
    assert (body["analysis"], body["analysed"], body["analysisVersion"]) == (None, None, None)
    assert app_row(sql, "com.example.app")["status"] == "queued"

    existing = api("add-app.json")
    assert existing["statusCode"] == 200
    assert json_answer(existing) == body
    assert sql.run("SELECT count(*) FROM apps") == [[1]]

    # The analysers' token is not the admin token.
    before = table_digest(sql)
    analyser = api("add-app.json", {"authorization": "Bearer local-upload-password"})
    assert analyser["statusCode"] == 401
    assert json_answer(analyser) == {"detail": "Please provide correct password."}
    assert table_digest(sql) == before


def test_event_get_app(api, sql):
    missing = api("get-app.json")
    assert missing["statusCode"] == 404
    assert json_answer(missing) == {"detail": "unknown app com.example.app"}

    insert_app(sql, "com.example.app", reviews="5")
    insert_app(sql, "com.example.bigger", reviews="50")
    queued = api("get-app.json")
    assert queued["statusCode"] == 200
    body = json_answer(queued)
    assert body["appId"] == "com.example.app"
    assert body["status"] == "queued"
    assert body["queuePosition"] == 2
    assert body["details"] == {
        "appId": "com.example.app",
        "title": "com.example.app",
        "reviews": "5",
    }
    assert body["analysis"] is None and body["analysisVersion"] is None

    sql.run("DELETE FROM apps")
    insert_app(
        sql, "com.example.app", status="failed", reason="paid_app", retryable=False, version=4
    )
    failed = json_answer(api("get-app.json"))
    assert failed["status"] == "failed"
    assert failed["failure"] == {"reason": "paid_app", "retryable": False}
    assert "queuePosition" not in failed


def test_event_healthz(api, monkeypatch):
    answer = api("healthz.json")
    assert answer["statusCode"] == 200
    assert json_answer(answer) == {"status": "ok"}

    configure_function(monkeypatch, "ApiFunction", UNREACHABLE_DATABASE)
    down = api("healthz.json")
    assert down["statusCode"] == 503
    assert json_answer(down) == {"detail": "database unavailable, try again shortly"}


def test_event_healthz_analyser(api):
    before = api("healthz-analyser.json")
    assert before["statusCode"] == 503
    assert json_answer(before) == {"status": "offline", "minutesSinceLastPing": None}

    assert api("ping.json")["statusCode"] == 200
    after = api("healthz-analyser.json")
    assert after["statusCode"] == 200
    assert json_answer(after) == {"status": "online", "minutesSinceLastPing": 0.0}


# ---------------------------------------------------------------------------------------
# The custom resource (handler.migrate), answering a local stand-in for the ResponseURL.
# ---------------------------------------------------------------------------------------


class ResponseURL:
    """A local HTTP server standing in for CloudFormation's pre-signed S3 URL: records
    each PUT (path, Content-Type, body). Answers 503 to the first `fail_first` PUTs. It
    serves on 127.0.0.1 only and stops by itself after `lifetime` seconds."""

    def __init__(self, fail_first: int = 0, lifetime: float = 60.0):
        self.replies: list[tuple[str, str | None, bytes]] = []
        self.attempts = 0
        self._arrived = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.attempts += 1
                if outer.attempts <= fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                outer.replies.append((self.path, self.headers.get("Content-Type"), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                outer._arrived.set()

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self._server.timeout = 0.05
        self._stop = threading.Event()
        deadline = time.monotonic() + lifetime

        def serve() -> None:
            while not self._stop.is_set() and time.monotonic() < deadline:
                self._server.handle_request()
            self._server.server_close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/cfn-response/stack?X-Amz-Signature=abc123"

    def reply(self) -> dict:
        """The one reply received (JSON), checked for what CloudFormation requires."""
        assert self._arrived.wait(5), "no reply arrived"
        assert len(self.replies) == 1, self.replies
        path, content_type, body = self.replies[0]
        assert path == "/cfn-response/stack?X-Amz-Signature=abc123"
        assert content_type == ""  # a pre-signed S3 PUT is signed without one
        assert len(body) < 4096
        return json.loads(body)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def response_url():
    server = ResponseURL()
    yield server
    server.close()


def cfn_event(name: str, response: ResponseURL, **changes) -> dict:
    event = load_event(name)
    event["ResponseURL"] = response.url
    event.update(changes)
    return event


def migrate(event: dict, remaining_ms: int = 600_000) -> dict:
    return handler.migrate(event, LambdaContext("analysis-queue-MigrationFunction", remaining_ms))


def ledger(url: str) -> list:
    connection = connect(url)
    try:
        return connection.run(
            "SELECT filename, checksum, applied_at FROM schema_migrations ORDER BY filename"
        )
    finally:
        connection.close()


def table_exists(sql, name: str) -> bool:
    return sql.run("SELECT to_regclass(:name) IS NOT NULL", name=name)[0][0]


@pytest.fixture
def sql_dir(tmp_path, monkeypatch):
    """A copy of sql/ that handler reads instead; returns a function adding a file."""
    directory = tmp_path / "sql"
    shutil.copytree(handler.SQL_DIR, directory)
    monkeypatch.setattr(handler, "SQL_DIR", directory)

    def add(name: str, text: str) -> Path:
        path = directory / name
        path.write_text(text)
        return path

    return add


def assert_echoes(reply: dict, event: dict, physical_id: str) -> None:
    assert reply["PhysicalResourceId"] == physical_id
    for field in ("StackId", "RequestId", "LogicalResourceId"):
        assert reply[field] == event[field]
    assert reply["NoEcho"] is False


def test_custom_resource_create_applies_the_ledger(empty_database, monkeypatch, response_url):
    configure_function(monkeypatch, "MigrationFunction", empty_database)
    event = cfn_event("cfn-create.json", response_url)
    returned = migrate(event)

    reply = response_url.reply()
    assert returned == reply
    assert reply["Status"] == "SUCCESS"
    assert_echoes(reply, event, "analysis-queue-migrations")
    assert reply["Data"] == {"Applied": ",".join(LEDGER_FILES)}
    assert reply["Reason"] == f"applied {len(LEDGER_FILES)} file(s): {','.join(LEDGER_FILES)}"
    applied = ledger(empty_database)
    assert [row[0] for row in applied] == LEDGER_FILES
    assert [row[1] for row in applied] == [
        hashlib.sha256((handler.SQL_DIR / name).read_bytes()).hexdigest() for name in LEDGER_FILES
    ]

    # CloudFormation may send Create again: nothing is pending, the same id answers.
    again = ResponseURL()
    try:
        migrate(cfn_event("cfn-create.json", again))
        second = again.reply()
    finally:
        again.close()
    assert second["Status"] == "SUCCESS"
    assert second["PhysicalResourceId"] == "analysis-queue-migrations"
    assert second["Data"] == {"Applied": "none"}
    assert ledger(empty_database) == applied


def test_custom_resource_update_applies_pending_files(database_url, sql, sql_dir, response_url):
    before = ledger(database_url)
    sql_dir("900_lambda_note.sql", "CREATE TABLE lambda_note (id integer);\n")
    event = cfn_event("cfn-update.json", response_url, PhysicalResourceId="queue-db-ledger-7")
    migrate(event)

    reply = response_url.reply()
    assert reply["Status"] == "SUCCESS"
    assert_echoes(reply, event, "queue-db-ledger-7")  # the id it was given, unchanged
    assert reply["Data"] == {"Applied": "900_lambda_note.sql"}
    assert "900_lambda_note.sql" in reply["Reason"]
    after = ledger(database_url)
    assert after[:-1] == before
    assert after[-1][0] == "900_lambda_note.sql"
    assert table_exists(sql, "lambda_note")


def test_custom_resource_update_without_pending_files(database_url, response_url):
    before = ledger(database_url)
    migrate(cfn_event("cfn-update.json", response_url))
    reply = response_url.reply()
    assert (reply["Status"], reply["Data"]) == ("SUCCESS", {"Applied": "none"})
    assert reply["PhysicalResourceId"] == "analysis-queue-migrations"
    assert ledger(database_url) == before


def test_custom_resource_delete_touches_no_database(monkeypatch, response_url):
    # An unreachable database: any attempt to touch it would answer FAILED.
    configure_function(monkeypatch, "MigrationFunction", UNREACHABLE_DATABASE)
    event = cfn_event("cfn-delete.json", response_url)
    started = time.monotonic()
    returned = migrate(event)
    assert time.monotonic() - started < 3

    reply = response_url.reply()
    assert returned == reply
    assert reply["Status"] == "SUCCESS"
    assert_echoes(reply, event, "analysis-queue-migrations")
    assert reply["Data"] == {}
    assert "Delete" in reply["Reason"]


def test_custom_resource_delete_leaves_the_ledger(database_url, sql, sql_dir, response_url):
    sql_dir("900_lambda_note.sql", "CREATE TABLE lambda_note (id integer);\n")
    before = ledger(database_url)
    migrate(cfn_event("cfn-delete.json", response_url))
    assert response_url.reply()["Status"] == "SUCCESS"
    assert ledger(database_url) == before
    assert not table_exists(sql, "lambda_note")


def test_custom_resource_rollback_update_touches_no_database(monkeypatch, response_url):
    configure_function(monkeypatch, "MigrationFunction", UNREACHABLE_DATABASE)
    event = load_event("cfn-update.json")
    # A rollback sends the old (lower) version again.
    event["ResourceProperties"], event["OldResourceProperties"] = (
        event["OldResourceProperties"],
        event["ResourceProperties"],
    )
    assert int(event["ResourceProperties"]["FunctionVersion"]) < int(
        event["OldResourceProperties"]["FunctionVersion"]
    )
    event["ResponseURL"] = response_url.url
    migrate(event)

    reply = response_url.reply()
    assert reply["Status"] == "SUCCESS"
    assert_echoes(reply, event, "analysis-queue-migrations")
    assert reply["Data"] == {}
    assert "Rollback" in reply["Reason"]


def test_custom_resource_version_10_after_9_is_not_a_rollback(monkeypatch, response_url):
    # Versions compare as numbers ("10" sorts before "9" as text): this Update migrates,
    # so it reaches the (unreachable) database and fails.
    configure_function(monkeypatch, "MigrationFunction", UNREACHABLE_DATABASE)
    event = cfn_event("cfn-update.json", response_url)
    event["ResourceProperties"]["FunctionVersion"] = "10"
    event["OldResourceProperties"]["FunctionVersion"] = "9"
    migrate(event)
    reply = response_url.reply()
    assert reply["Status"] == "FAILED"
    assert reply["Reason"] == (
        "migration failed: cannot connect to the database at 127.0.0.1:9: connection refused"
    )


def test_custom_resource_broken_file_fails_and_leaves_the_ledger(
    database_url, sql, sql_dir, response_url
):
    sql_dir(
        "900_broken.sql",
        "CREATE TABLE lambda_half_done (id integer);\nSELECT id FROM no_such_table;\n",
    )
    before = ledger(database_url)
    event = cfn_event("cfn-update.json", response_url)
    returned = migrate(event)

    reply = response_url.reply()
    assert returned == reply
    assert reply["Status"] == "FAILED"
    assert_echoes(reply, event, "analysis-queue-migrations")
    assert reply["Reason"] == (
        'migration failed: 900_broken.sql: 42P01: relation "no_such_table" does not exist'
    )
    assert reply["Data"] == {}
    assert ledger(database_url) == before
    assert not table_exists(sql, "lambda_half_done")  # the file rolled back whole


def test_custom_resource_reply_stays_under_4096_bytes(database_url, sql_dir, response_url):
    sql_dir(
        "900_loud.sql",
        "DO $$ BEGIN RAISE EXCEPTION 'loud failure: %', repeat('x', 3000000); END $$;\n",
    )
    before = ledger(database_url)
    started = time.monotonic()
    migrate(cfn_event("cfn-update.json", response_url))
    assert time.monotonic() - started < 10

    reply = response_url.reply()  # asserts < 4096 bytes
    assert reply["Status"] == "FAILED"
    assert reply["Reason"].startswith("migration failed: 900_loud.sql: P0001: loud failure: xxx")
    assert reply["PhysicalResourceId"] == "analysis-queue-migrations"
    assert ledger(database_url) == before


def test_custom_resource_reply_names_many_applied_files_under_4096_bytes(
    database_url, sql_dir, response_url
):
    head = int(max(path.name for path in handler.SQL_DIR.glob("*.sql"))[:3])
    names = [
        f"{index:03d}_{'long_migration_name_' * 4}{index}.sql"
        for index in range(head + 1, head + 61)
    ]
    for name in names:
        sql_dir(name, "SELECT 1;\n")
    migrate(cfn_event("cfn-update.json", response_url))
    reply = response_url.reply()  # asserts < 4096 bytes
    assert reply["Status"] == "SUCCESS"
    assert reply["Data"]["Applied"].startswith(names[0])
    assert reply["Reason"].startswith(f"applied {len(names)} file(s): {names[0]}")
    assert [row[0] for row in ledger(database_url)][-len(names) :] == names


@hypothesis_settings(max_examples=300, deadline=None)
@given(
    reason=st.text(max_size=20_000),
    applied=st.text(max_size=10_000),
    physical_id=st.one_of(st.none(), st.text(min_size=1, max_size=200)),
)
def test_cfn_reply_is_always_under_4096_bytes(reason, applied, physical_id):
    event = {**load_event("cfn-update.json"), "PhysicalResourceId": physical_id}
    body = handler.cfn_reply(event, "FAILED", reason, {"Applied": applied})
    assert len(body) < 4096
    reply = json.loads(body)
    assert reply["PhysicalResourceId"] == (physical_id or "analysis-queue-migrations")
    assert reply["RequestId"] == event["RequestId"]
    # The head of the reason (the error, or the files applied) is kept.
    assert reply["Reason"][:99] == reason[:99]


def test_custom_resource_exception_still_answers(monkeypatch, response_url):
    configure_function(monkeypatch, "MigrationFunction", "mysql://root@127.0.0.1:3306/queue")
    event = cfn_event("cfn-create.json", response_url)
    returned = migrate(event)
    reply = response_url.reply()
    assert returned == reply
    assert reply["Status"] == "FAILED"
    assert reply["Reason"] == (
        "migration failed: misconfigured: DATABASE_URL must start with postgresql://"
    )
    assert reply["PhysicalResourceId"] == "analysis-queue-migrations"


def test_custom_resource_malformed_event_still_answers(monkeypatch, response_url):
    configure_function(monkeypatch, "MigrationFunction", UNREACHABLE_DATABASE)
    event = cfn_event("cfn-update.json", response_url, ResourceProperties=None)
    migrate(event)
    reply = response_url.reply()
    assert reply["Status"] == "FAILED"
    assert reply["Reason"].startswith("migration failed: AttributeError")

    other = ResponseURL()
    try:
        migrate(cfn_event("cfn-create.json", other, RequestType="Replace"))
        unknown = other.reply()
    finally:
        other.close()
    assert unknown["Status"] == "FAILED"
    assert unknown["Reason"] == "unknown RequestType 'Replace'"


def test_custom_resource_answers_before_the_lambda_timeout(
    database_url, sql, sql_dir, response_url
):
    sql_dir(
        "900_slow.sql",
        "CREATE TABLE lambda_slow (id integer);\nSELECT pg_sleep(30);\n",
    )
    before = ledger(database_url)
    remaining_ms = handler.CFN_REPLY_MARGIN_SECONDS * 1000 + 1000  # one second of work
    started = time.monotonic()
    returned = migrate(cfn_event("cfn-update.json", response_url), remaining_ms=remaining_ms)
    elapsed = time.monotonic() - started
    assert elapsed < remaining_ms / 1000 - 5  # answered well before Lambda's timeout

    reply = response_url.reply()
    assert returned == reply
    assert reply["Status"] == "FAILED"
    assert reply["Reason"].startswith(
        "migration failed: TimeoutError: migrations did not finish within"
    )
    assert reply["PhysicalResourceId"] == "analysis-queue-migrations"

    # The runner's session was ended on the server, long before its pg_sleep(30) ends:
    # its transaction rolled back, its locks are gone, and nothing commits later.
    name = urlsplit(database_url).path.lstrip("/")
    deadline = time.monotonic() + 5
    while sql.run(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = :name AND query LIKE '%pg_sleep%'"
        " AND pid <> pg_backend_pid()",
        name=name,
    ) != [[0]]:
        assert time.monotonic() < deadline, "the timed-out migration is still running"
        time.sleep(0.05)
    assert time.monotonic() - started < 10
    assert ledger(database_url) == before
    assert not table_exists(sql, "lambda_slow")
    assert sql.run("SELECT pg_try_advisory_lock(:key)", key=handler.MIGRATIONS_LOCK_KEY) == [[True]]
    sql.run("SELECT pg_advisory_unlock(:key)", key=handler.MIGRATIONS_LOCK_KEY)


def test_custom_resource_without_time_left_answers_at_once(database_url, sql_dir, response_url):
    sql_dir("900_lambda_note.sql", "CREATE TABLE lambda_note (id integer);\n")
    before = ledger(database_url)
    migrate(cfn_event("cfn-update.json", response_url), remaining_ms=5_000)
    reply = response_url.reply()
    assert reply["Status"] == "FAILED"
    assert reply["Reason"] == "migration failed: TimeoutError: no time left to run the migrations"
    time.sleep(0.5)  # a runner left behind would have applied the file by now
    assert ledger(database_url) == before


def test_custom_resource_reply_is_retried(database_url):
    flaky = ResponseURL(fail_first=1)
    try:
        migrate(cfn_event("cfn-update.json", flaky))
        reply = flaky.reply()
    finally:
        flaky.close()
    assert flaky.attempts == 2
    assert reply["Status"] == "SUCCESS"


# ---------------------------------------------------------------------------------------
# The scheduled report (handler.report) and its direct commands.
# ---------------------------------------------------------------------------------------


def output_records(captured) -> tuple[list[dict], list[dict]]:
    """(log records from stderr, EMF documents from stdout), every line JSON."""
    logs = [json.loads(line) for line in captured.err.splitlines() if line.strip()]
    emf = [json.loads(line) for line in captured.out.splitlines() if line.strip()]
    return logs, emf


def one_record(records: list[dict], message: str) -> dict:
    found = [record for record in records if record.get("message") == message]
    assert len(found) == 1, records
    return found[0]


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
    assert status["counts"] == {"queued": 4, "processing": 2, "analysed": 3, "failed": 5}
    assert status["total"] == 14
    assert status["failed_retryable"] == 3
    assert status["backlog"] == {
        "queued": 4,
        "lease_expired": 1,
        "stale": 1,
        "outdated_version": 1,
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
    }
    assert status["eta_hours"] == 27.4  # 8 apps at 7 finished per 24 h: 27.43 h
    assert abs(status["minutes_since_last_ping"] - 12.0) <= 0.2
    assert status["analysers_last_hour"] == 1
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
    }
    assert "policy_text" not in status
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
        "ExpiredLeases": 1,
        "Failed": 5,
        "AnalysedLast24h": 6,
        "EtaHours": 27.4,
    }
    assert set(units) == {*expected, "MinutesSinceLastPing"}
    assert set(document) == {"_aws", "service", *units}
    # Counts are Counts; hours and minutes have no CloudWatch unit and name theirs.
    assert units == {
        **{name: "Count" for name in expected if name != "EtaHours"},
        "EtaHours": "None",
        "MinutesSinceLastPing": "None",
    }
    for name, value in expected.items():
        assert document[name] in ([value], value), name
    ping = document["MinutesSinceLastPing"]
    ping = ping[0] if isinstance(ping, list) else ping
    assert ping == status["minutes_since_last_ping"]


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
        {"command": "queue-refetch", "appIds": ["COM.example.DONE"]}, LambdaContext()
    )
    assert dry == {"command": "queue-refetch", "applied": False, "apps": ["com.example.done"]}
    assert table_digest(sql) == before
    with pytest.raises(ValueError, match="apply must be true or false"):
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
    assert done == {"command": "queue-refetch", "applied": True, "apps": ["com.example.done"]}
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
    assert retryable["apps"] == ["app.failed.retry"]
    every = handler.report(
        {"command": "queue-refetch", "failed": True, "includeNonRetryable": True, "limit": 5},
        LambdaContext(),
    )
    assert sorted(every["apps"]) == ["app.failed.final", "app.failed.retry"]
    assert app_row(sql, "app.failed.retry")["status"] == "failed"


def test_report_unknown_command_fails_clearly(database_url, sql):
    insert_app(sql, "com.example.app")
    before = table_digest(sql)
    with pytest.raises(ValueError, match="unknown command 'queue-purge'"):
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
    with pytest.raises(ValueError, match=complaint):
        handler.report(event, LambdaContext())
    assert table_digest(sql) == before


# ---------------------------------------------------------------------------------------
# Secrets: Secrets Manager and SSM through Powertools Parameters (moto), cached, never
# logged; boto3 only when a secret is read.
# ---------------------------------------------------------------------------------------

UPLOAD_SECRET = "sm-upload-8f3a1c9e77d2"
ADMIN_SECRET = "ssm-admin-5b60e4d21a9f"


@pytest.fixture
def secret_api(aws, database_url, monkeypatch):
    """The API with UPLOAD_PASSWORD in Secrets Manager and ADMIN_TOKEN in SSM."""
    aws.client("secretsmanager").create_secret(Name="queue/upload", SecretString=UPLOAD_SECRET)
    aws.client("ssm").put_parameter(Name="/queue/admin", Value=ADMIN_SECRET, Type="SecureString")
    configure_function(
        monkeypatch,
        "ApiFunction",
        database_url,
        UPLOAD_PASSWORD="",
        ADMIN_TOKEN="",
        UPLOAD_PASSWORD_SECRET="secretsmanager:queue/upload",
        ADMIN_TOKEN_SECRET="ssm:/queue/admin",
    )

    def invoke(name: str, token: str | None) -> dict:
        event = load_event(name)
        event["headers"] = {**event["headers"], "authorization": f"Bearer {token}"}
        if token is None:
            del event["headers"]["authorization"]
        return handler.api(event, LambdaContext("analysis-queue-ApiFunction"))

    return invoke


def test_tokens_from_secrets_manager_and_ssm(secret_api, sql):
    assert handler.settings().upload_password is None
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    assert secret_api("ping.json", "local-upload-password")["statusCode"] == 401
    assert secret_api("ping.json", ADMIN_SECRET)["statusCode"] == 401
    assert secret_api("ping.json", None)["statusCode"] == 401
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 201
    assert secret_api("add-app.json", UPLOAD_SECRET)["statusCode"] == 401
    assert secret_api("queue.json", UPLOAD_SECRET)["body"] == "com.example.app"
    assert app_row(sql, "com.example.app")["status"] == "processing"


def test_secrets_are_cached_for_max_age(secret_api, aws):
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 201
    # Rotated, then deleted: within SECRETS_MAX_AGE_SECONDS (300) the cached values
    # still answer, without asking AWS.
    aws.client("secretsmanager").put_secret_value(
        SecretId="queue/upload", SecretString="rotated-upload"
    )
    aws.client("ssm").put_parameter(
        Name="/queue/admin", Value="rotated-admin", Type="SecureString", Overwrite=True
    )
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    assert secret_api("ping.json", "rotated-upload")["statusCode"] == 401
    aws.client("secretsmanager").delete_secret(
        SecretId="queue/upload", ForceDeleteWithoutRecovery=True
    )
    aws.client("ssm").delete_parameter(Name="/queue/admin")
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 200


def test_secrets_are_read_again_after_max_age(secret_api, aws, monkeypatch):
    monkeypatch.setenv("SECRETS_MAX_AGE_SECONDS", "0")
    handler.use_runtime(None)
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    aws.client("secretsmanager").put_secret_value(
        SecretId="queue/upload", SecretString="rotated-upload"
    )
    aws.client("ssm").put_parameter(
        Name="/queue/admin", Value="rotated-admin", Type="SecureString", Overwrite=True
    )
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 401
    assert secret_api("ping.json", "rotated-upload")["statusCode"] == 200
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 401
    assert secret_api("add-app.json", "rotated-admin")["statusCode"] == 201


def test_unreadable_secret_answers_503(secret_api, aws, capsys):
    aws.client("secretsmanager").delete_secret(
        SecretId="queue/upload", ForceDeleteWithoutRecovery=True
    )
    answer = secret_api("ping.json", UPLOAD_SECRET)
    assert answer["statusCode"] == 503
    assert json_answer(answer) == {"detail": "the server cannot read its token for this route"}
    # The admin route's token (SSM) is still there.
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 201
    logs = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    record = one_record(logs, "secret unavailable")
    assert record["secret"] == "secretsmanager:queue/upload"
    assert record["level"] == "WARNING"


def test_binary_secret_is_not_a_token(secret_api, aws):
    aws.client("secretsmanager").put_secret_value(SecretId="queue/upload", SecretBinary=b"x")
    answer = secret_api("ping.json", "x")
    assert answer["statusCode"] == 503
    assert json_answer(answer) == {"detail": "the server has no token configured for this route"}


def test_secret_values_are_never_logged(secret_api, database_url, caplog, capsys, response_url):
    caplog.set_level(logging.DEBUG)
    answers = [
        secret_api("ping.json", UPLOAD_SECRET),
        secret_api("ping.json", UPLOAD_SECRET + "x"),
        secret_api("ping.json", ADMIN_SECRET),
        secret_api("queue.json", "wrong"),
        secret_api("queue.json", None),
        secret_api("add-app.json", UPLOAD_SECRET),
        secret_api("add-app.json", ADMIN_SECRET),
        secret_api("upload-analysis.json", ADMIN_SECRET),
        secret_api("report-failure.json", UPLOAD_SECRET),
        secret_api("get-app.json", UPLOAD_SECRET),
    ]
    assert [a["statusCode"] for a in answers] == [200, 401, 401, 401, 401, 401, 201, 401, 200, 200]
    migrate(cfn_event("cfn-update.json", response_url))
    assert response_url.reply()["Status"] == "SUCCESS"
    handler.report(load_event("schedule.json"), LambdaContext())

    captured = capsys.readouterr()
    logged = captured.out + captured.err + caplog.text
    assert "queue status" in captured.err  # the capture works
    for record in caplog.records:
        logged += " ".join(str(arg) for arg in (record.args or ()))
    for secret in (UPLOAD_SECRET, ADMIN_SECRET):
        assert secret not in logged
        for answer in answers:
            assert secret not in answer["body"]
            assert secret not in json.dumps(answer["headers"])


def test_database_credentials_from_secrets_manager(aws, database_url, monkeypatch):
    with contextlib.ExitStack() as stack:
        check_database_credentials(aws, database_url, monkeypatch, stack)


def check_database_credentials(aws, database_url, monkeypatch, stack):
    aws.client("secretsmanager").create_secret(
        Name="queue/db", SecretString=json.dumps({"username": "postgres", "password": "pw-0x5e"})
    )
    aws.client("secretsmanager").create_secret(
        Name="queue/db-other",
        SecretString=json.dumps({"username": "no_such_role_7e2", "password": "pw-0x5f"}),
    )
    target = handler.connection_arguments(handler.load_settings({"DATABASE_URL": database_url}))
    # DB_HOST is a TCP address: a proxy gives the socket-only embedded server one.
    proxy = stack.enter_context(TcpProxy(target))
    env = {
        "DB_HOST": "127.0.0.1",
        "DB_PORT": str(proxy.port),
        "DB_NAME": target["database"],
        "DB_SECRET_ID": "queue/db",
        "DB_SSLMODE": "disable",
    }
    arguments = handler.connection_arguments(handler.load_settings(env))
    assert arguments == {
        "user": "postgres",
        "password": "pw-0x5e",
        "host": env["DB_HOST"],
        "port": int(env["DB_PORT"]),
        "database": env["DB_NAME"],
        "ssl_context": None,
    }
    missing = {k: v for k, v in env.items() if k != "DB_SECRET_ID"}
    with pytest.raises(handler.ConfigError, match="DB_SECRET_ID"):
        handler.connection_arguments(handler.load_settings(missing))

    # Over TCP, the service connects with the secret's user (trust auth ignores the
    # password): postgres works, a user that does not exist gets 503.
    for name in ("DATABASE_URL", "UPLOAD_PASSWORD", "ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    handler.use_runtime(None)
    healthz = handler.api(load_event("healthz.json"), LambdaContext())
    assert (healthz["statusCode"], healthz["body"]) == (200, '{"status":"ok"}')
    monkeypatch.setenv("DB_SECRET_ID", "queue/db-other")
    handler.use_runtime(None)
    denied = handler.api(load_event("healthz.json"), LambdaContext())
    assert denied["statusCode"] == 503
    assert "pw-0x5f" not in denied["body"]


IMPORT_PROBE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
event = json.load(open(sys.argv[2]))

import handler
answer = handler.api(event, handler.LocalContext(60, "probe"))
seen = {"status": answer["statusCode"], "body": answer["body"],
        "boto3": "boto3" in sys.modules,
        "parameters": "aws_lambda_powertools.utilities.parameters" in sys.modules}
# Now the token comes from Secrets Manager (a closed loopback port: the read fails).
os.environ.pop("UPLOAD_PASSWORD")
os.environ["UPLOAD_PASSWORD_SECRET"] = "secretsmanager:queue/upload"
handler.use_runtime(None)
answer = handler.api(event, handler.LocalContext(60, "probe"))
seen.update(after_status=answer["statusCode"], after_boto3="boto3" in sys.modules)
print(json.dumps(seen))
"""


def test_boto3_is_imported_only_when_a_secret_is_read(database_url, sql):
    insert_app(sql, "com.example.app")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "DATABASE_URL": database_url,
        "UPLOAD_PASSWORD": "local-upload-password",
        "ADMIN_TOKEN": "local-admin-token",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    probe = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, str(handler.HERE), str(EVENTS / "queue.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert (seen["status"], seen["body"]) == (200, "com.example.app")
    assert seen["boto3"] is False
    assert seen["parameters"] is False
    assert seen["after_status"] == 503
    assert seen["after_boto3"] is True
