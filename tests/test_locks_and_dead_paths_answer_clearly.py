"""A lock, a slow or dead database, a reply that cannot be read: the queue keeps a clear
answer.

* A row locked by another session (an operator's open transaction) never stops claims of
  other apps: the claim and the promoter skip locked rows.
* A table lock (a migration's ACCESS EXCLUSIVE) answers 503 with Retry-After after the
  API's lock_timeout, not after the statement timeout, and /healthz says so too.
* A dead network path (a loopback proxy that stops forwarding: no reply, no reset)
  answers 503 within two socket timeouts, which the ApiFunction timeout covers.
* An exception while a reply is being read leaves no unread reply behind: the next
  statement of the process gets its own answer.

Timings are asserted only against bounds many times the expected time (a lock wait that
should take 0 s must not take the 15 s it would take if the code waited).
"""

from __future__ import annotations

import time

import pg8000.converters
import pytest
from kit import ANALYSER, configure_service

import handler
from helpers import app_row, connect, days_ago, insert_app, minutes_ago, oracle_order
from live import TcpProxy
from sam_template import load_template


def claim(client) -> str:
    answer = client.get("/queue", headers=ANALYSER)
    assert answer.status_code == 200, answer.text
    return answer.text


# --- row locks ------------------------------------------------------------------------


def test_rows_locked_elsewhere_do_not_stop_claims_of_other_apps(
    client, sql, database_url, monkeypatch
):
    # A lock wait would last LOCK_TIMEOUT_MS (15 s) and then fail; skipping takes ms.
    configure_service(
        monkeypatch,
        database_url,
        LOCK_TIMEOUT_MS="15000",
        STATEMENT_TIMEOUT_MS="20000",
        STALE_ANALYSIS_DAYS="90",  # a policy change: the promoter also clears and records
    )
    insert_app(sql, "locked.queued", reviews=100)
    insert_app(
        sql, "locked.lease", status="processing", reviews=90, processing_started=minutes_ago(500)
    )
    insert_app(
        sql, "locked.stale", status="analysed", reviews=80, version=4, analysed=days_ago(100)
    )
    insert_app(sql, "free.app", reviews=10)
    operator = connect(database_url)
    operator.run("BEGIN")
    operator.run("SELECT 1 FROM apps WHERE appid LIKE 'locked.%' FOR UPDATE")
    operator.run("SELECT 1 FROM queue_policy FOR UPDATE")
    try:
        started = time.monotonic()
        assert claim(client) == "free.app"
        assert time.monotonic() - started < 10
        assert claim(client) == ""
    finally:
        operator.run("ROLLBACK")
        operator.close()
    handler.runtime().close()  # a new process: promotion runs again
    assert [claim(client) for _ in range(3)] == ["locked.queued", "locked.lease", "locked.stale"]


def test_a_claimed_row_locked_by_an_upload_is_skipped(client, sql, database_url):
    insert_app(sql, "first.app", reviews=2)
    insert_app(sql, "second.app", reviews=1)
    other = connect(database_url)
    other.run("BEGIN")
    other.run("SELECT 1 FROM apps WHERE appid = 'first.app' FOR UPDATE")
    try:
        assert claim(client) == "second.app"
    finally:
        other.run("ROLLBACK")
        other.close()


# --- table locks ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["SHARE", "SHARE ROW EXCLUSIVE", "EXCLUSIVE", "ACCESS EXCLUSIVE"])
def test_healthz_fails_under_every_lock_that_stops_a_claim(
    client, sql, database_url, monkeypatch, mode
):
    """An index build's SHARE lock lets reads through but not a claim's UPDATE: /healthz
    takes the claim's lock, so it says what /queue would meet."""
    configure_service(monkeypatch, database_url, LOCK_TIMEOUT_MS="300")
    insert_app(sql, "com.example.app")
    holder = connect(database_url)
    holder.run("BEGIN")
    holder.run(f"LOCK TABLE apps IN {mode} MODE")
    try:
        assert client.get("/healthz").status_code == 503
        assert client.get("/queue", headers=ANALYSER).status_code == 503
    finally:
        holder.run("ROLLBACK")
        holder.close()
    assert client.get("/healthz").status_code == 200
    assert claim(client) == "com.example.app"


def test_a_table_lock_answers_503_after_the_lock_timeout(client, sql, database_url, monkeypatch):
    configure_service(
        monkeypatch, database_url, LOCK_TIMEOUT_MS="300", STATEMENT_TIMEOUT_MS="30000"
    )
    insert_app(sql, "com.example.app")
    assert client.get("/healthz").status_code == 200
    migration = connect(database_url)
    migration.run("BEGIN")
    migration.run("LOCK TABLE apps IN ACCESS EXCLUSIVE MODE")
    try:
        for method, path in (
            ("GET", "/queue"),
            ("GET", "/healthz"),
            ("GET", "/apps/com.example.app"),
            ("POST", "/uploadAnalysis?appId=com.example.app&analysisVersion=4"),
        ):
            started = time.monotonic()
            answer = client.request(
                method,
                path,
                headers={**ANALYSER, "Content-Type": "application/json"},
                content=b"{}" if method == "POST" else None,
            )
            # The statement timeout is 30 s: well under it means the lock timeout answered.
            assert time.monotonic() - started < 15, path
            assert answer.status_code == 503, (path, answer.text)
            assert answer.headers["Retry-After"].isdigit()
            assert "try again" in answer.json()["detail"]
    finally:
        migration.run("ROLLBACK")
        migration.close()
    assert claim(client) == "com.example.app"


@pytest.mark.private_database  # ALTER DATABASE ... SET
def test_healthz_fails_while_the_database_is_read_only(client, sql, database_url):
    admin = connect(database_url)
    settings = handler.load_settings({"DATABASE_URL": database_url})
    database = handler.connection_arguments(settings)["database"]
    try:
        admin.run(f"ALTER DATABASE {database} SET default_transaction_read_only = on")
        handler.runtime().close()
        answer = client.get("/healthz")
        assert answer.status_code == 503
        assert "read-only" in answer.json()["detail"]
        assert client.get("/queue", headers=ANALYSER).status_code == 503
    finally:
        admin.run(f"ALTER DATABASE {database} RESET default_transaction_read_only")
        admin.close()
    handler.runtime().close()
    assert client.get("/healthz").status_code == 200


# --- a dead network path ----------------------------------------------------------------


def worst_case_seconds(statement_timeout_ms: int) -> float:
    """A request on a dead path: its statement's read times out, then the one retry's
    connect does (two socket timeouts; see API_SOCKET_MARGIN_SECONDS)."""
    return 2 * (statement_timeout_ms / 1000 + handler.API_SOCKET_MARGIN_SECONDS)


def test_the_defaults_answer_a_dead_path_within_the_api_functions_timeout():
    timeout = load_template()["Resources"]["ApiFunction"]["Properties"]["Timeout"]
    default = handler.load_settings({}).statement_timeout_ms
    assert worst_case_seconds(default) + 5 <= timeout


def test_a_dead_network_path_answers_503_in_bounded_time(client, sql, database_url, monkeypatch):
    insert_app(sql, "com.example.app")
    target = handler.connection_arguments(handler.load_settings({"DATABASE_URL": database_url}))
    database = target["database"]
    with TcpProxy(target) as proxy:
        configure_service(
            monkeypatch,
            f"postgresql://{target['user']}@127.0.0.1:{proxy.port}/{database}",
            STATEMENT_TIMEOUT_MS="1000",
            LOCK_TIMEOUT_MS="500",
        )
        assert client.get("/healthz").status_code == 200
        proxy.blackhole.set()
        bound = worst_case_seconds(1000) + 10  # generous: a busy machine
        for path in ("/queue", "/healthz"):
            started = time.monotonic()
            answer = client.get(path, headers=ANALYSER)
            assert time.monotonic() - started < bound, path
            assert answer.status_code == 503, (path, answer.text)
            assert answer.headers["Retry-After"].isdigit()
        proxy.blackhole.clear()
        assert claim(client) == "com.example.app"


# --- a reply that cannot be read --------------------------------------------------------


def exploding_text(value: str) -> str:
    if "explode" in value:
        raise RecursionError("a decoder gave up half-way through a reply")
    return value


def test_an_exception_while_reading_a_reply_discards_the_connection(client, sql, monkeypatch):
    """The decoder raises in the middle of a row; what the server sent after it (the rest
    of the reply) must not be taken by the next statement as its own answer."""
    monkeypatch.setitem(pg8000.converters.PG_TYPES, pg8000.converters.TEXT, exploding_text)
    handler.runtime().close()  # the service's next connection decodes text with it
    insert_app(sql, "boom.app", reviews=10)
    sql.run(
        """UPDATE apps SET details = details || '{"note": "explode"}' WHERE appid = 'boom.app'"""
    )
    insert_app(sql, "next.app", reviews=5)
    assert client.get("/apps/boom.app").status_code == 500
    expected = oracle_order(sql, handler.QueuePolicy())
    assert [claim(client) for _ in range(2)] == expected[:2] == ["boom.app", "next.app"]
    assert app_row(sql, "boom.app")["status"] == "processing"


@pytest.mark.parametrize("depth", [200, 3000])
def test_deep_legacy_json_is_answered_as_stored(client, sql, depth):
    """Rows written before the depth limit (or by the previous release) come back as
    PostgreSQL stored them, and the process goes on claiming correctly."""
    insert_app(sql, "deep.app", status="analysed", version=4, analysed=days_ago(1), reviews=3)
    sql.run(
        "UPDATE apps SET analysis = CAST(:doc AS jsonb) WHERE appid = 'deep.app'",
        doc='{"a": ' * depth + "1" + "}" * depth,
    )
    insert_app(sql, "queued.app", reviews=1)
    answer = client.get("/apps/deep.app")
    assert answer.status_code == 200
    assert answer.text.count('{"a": ') == depth
    assert claim(client) == "queued.app"
