"""handler.migrate, the CloudFormation custom resource, as Lambda calls it: end to end on a
real PostgreSQL, answering a local HTTP server that stands in for CloudFormation's
pre-signed ResponseURL (helpers.ResponseURL)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from kit import configure_function

import handler
from helpers import (
    UNREACHABLE_DATABASE,
    ResponseURL,
    cfn_event,
    invoke_migrate,
    ledger,
    load_event,
)

pytestmark = pytest.mark.usefixtures("lambda_container")

LEDGER_FILES = sorted(path.name for path in handler.SQL_DIR.glob("*.sql"))
# A test that runs the ledger with files added to sql/ (sql_dir) may change the schema,
# which is what such files are for: it gets a database of its own.
private_database = pytest.mark.private_database


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
    returned = invoke_migrate(event)

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
        invoke_migrate(cfn_event("cfn-create.json", again))
        second = again.reply()
    finally:
        again.close()
    assert second["Status"] == "SUCCESS"
    assert second["PhysicalResourceId"] == "analysis-queue-migrations"
    assert second["Data"] == {"Applied": "none"}
    assert ledger(empty_database) == applied


@private_database
def test_custom_resource_update_applies_pending_files(database_url, sql, sql_dir, response_url):
    before = ledger(database_url)
    sql_dir("900_lambda_note.sql", "CREATE TABLE lambda_note (id integer);\n")
    event = cfn_event("cfn-update.json", response_url, PhysicalResourceId="queue-db-ledger-7")
    invoke_migrate(event)

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
    invoke_migrate(cfn_event("cfn-update.json", response_url))
    reply = response_url.reply()
    assert (reply["Status"], reply["Data"]) == ("SUCCESS", {"Applied": "none"})
    assert reply["PhysicalResourceId"] == "analysis-queue-migrations"
    assert ledger(database_url) == before


def test_custom_resource_delete_touches_no_database(monkeypatch, response_url):
    # An unreachable database: any attempt to touch it would answer FAILED.
    configure_function(monkeypatch, "MigrationFunction", UNREACHABLE_DATABASE)
    event = cfn_event("cfn-delete.json", response_url)
    started = time.monotonic()
    returned = invoke_migrate(event)
    assert time.monotonic() - started < 3

    reply = response_url.reply()
    assert returned == reply
    assert reply["Status"] == "SUCCESS"
    assert_echoes(reply, event, "analysis-queue-migrations")
    assert reply["Data"] == {}
    assert "Delete" in reply["Reason"]


@private_database
def test_custom_resource_delete_leaves_the_ledger(database_url, sql, sql_dir, response_url):
    sql_dir("900_lambda_note.sql", "CREATE TABLE lambda_note (id integer);\n")
    before = ledger(database_url)
    invoke_migrate(cfn_event("cfn-delete.json", response_url))
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
    invoke_migrate(event)

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
    invoke_migrate(event)
    reply = response_url.reply()
    assert reply["Status"] == "FAILED"
    assert reply["Reason"] == (
        "migration failed: cannot connect to the database at 127.0.0.1:9: connection refused"
    )


@private_database
def test_custom_resource_broken_file_fails_and_leaves_the_ledger(
    database_url, sql, sql_dir, response_url
):
    sql_dir(
        "900_broken.sql",
        "CREATE TABLE lambda_half_done (id integer);\nSELECT id FROM no_such_table;\n",
    )
    before = ledger(database_url)
    event = cfn_event("cfn-update.json", response_url)
    returned = invoke_migrate(event)

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


@private_database
def test_custom_resource_reply_stays_under_4096_bytes(database_url, sql_dir, response_url):
    sql_dir(
        "900_loud.sql",
        "DO $$ BEGIN RAISE EXCEPTION 'loud failure: %', repeat('x', 3000000); END $$;\n",
    )
    before = ledger(database_url)
    started = time.monotonic()
    invoke_migrate(cfn_event("cfn-update.json", response_url))
    assert time.monotonic() - started < 10

    reply = response_url.reply()  # asserts < 4096 bytes
    assert reply["Status"] == "FAILED"
    assert reply["Reason"].startswith("migration failed: 900_loud.sql: P0001: loud failure: xxx")
    assert reply["PhysicalResourceId"] == "analysis-queue-migrations"
    assert ledger(database_url) == before


@private_database
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
    invoke_migrate(cfn_event("cfn-update.json", response_url))
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
    returned = invoke_migrate(event)
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
    invoke_migrate(event)
    reply = response_url.reply()
    assert reply["Status"] == "FAILED"
    assert reply["Reason"].startswith("migration failed: AttributeError")

    other = ResponseURL()
    try:
        invoke_migrate(cfn_event("cfn-create.json", other, RequestType="Replace"))
        unknown = other.reply()
    finally:
        other.close()
    assert unknown["Status"] == "FAILED"
    assert unknown["Reason"] == "unknown RequestType 'Replace'"


@private_database
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
    returned = invoke_migrate(cfn_event("cfn-update.json", response_url), remaining_ms=remaining_ms)
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


@private_database
def test_custom_resource_without_time_left_answers_at_once(database_url, sql_dir, response_url):
    sql_dir("900_lambda_note.sql", "CREATE TABLE lambda_note (id integer);\n")
    before = ledger(database_url)
    running = set(threading.enumerate())
    invoke_migrate(cfn_event("cfn-update.json", response_url), remaining_ms=5_000)
    reply = response_url.reply()
    assert reply["Status"] == "FAILED"
    assert reply["Reason"] == "migration failed: TimeoutError: no time left to run the migrations"
    # Every thread the invocation started has ended (a runner left behind would have
    # applied the file by then), and the ledger is as it was.
    for thread in set(threading.enumerate()) - running:
        thread.join(60)
        assert not thread.is_alive(), thread
    assert ledger(database_url) == before


def test_custom_resource_reply_is_retried(database_url):
    flaky = ResponseURL(fail_first=1)
    try:
        invoke_migrate(cfn_event("cfn-update.json", flaky))
        reply = flaky.reply()
    finally:
        flaky.close()
    assert flaky.attempts == 2
    assert reply["Status"] == "SUCCESS"
