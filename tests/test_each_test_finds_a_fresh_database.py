"""The tests' shared database (kit.SharedDatabase): whatever one test leaves in it, the
next finds it exactly as a fresh copy of the migrated template would be: rows, sequences,
schema, database settings and the planner's statistics."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from kit import SHARED_DB, TEMPLATE_DB, Databases

import handler
from helpers import connect, insert_app, ledger

LEDGER_FILES = sorted(path.name for path in handler.SQL_DIR.glob("*.sql"))


def database_state(url: str) -> dict:
    """Everything a test could see of a database, by name (not by oid)."""
    sql = connect(url)
    try:
        tables = [
            row[0]
            for row in sql.run(
                "SELECT relname FROM pg_class WHERE relkind = 'r'"
                " AND relnamespace = current_schema()::regnamespace ORDER BY 1"
            )
        ]
        return {
            "rows": {
                table: sql.run(f"SELECT t::text FROM {table} t ORDER BY 1") for table in tables
            },
            "sequences": sql.run(
                "SELECT sequencename, last_value FROM pg_sequences"
                " WHERE schemaname = current_schema() ORDER BY 1"
            ),
            "columns": sql.run(
                "SELECT table_name, column_name, data_type, is_nullable, column_default"
                " FROM information_schema.columns WHERE table_schema = current_schema()"
                " ORDER BY 1, 2"
            ),
            "constraints": sql.run(
                "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid), convalidated"
                " FROM pg_constraint WHERE connamespace = current_schema()::regnamespace"
                " ORDER BY 1, 2"
            ),
            "indexes": sql.run(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
                " ORDER BY 1"
            ),
            "triggers": sql.run(
                "SELECT tgname, pg_get_triggerdef(oid), tgenabled FROM pg_trigger"
                " WHERE NOT tgisinternal ORDER BY 1"
            ),
            "functions": sql.run(
                "SELECT proname, pg_get_functiondef(oid) FROM pg_proc"
                " WHERE pronamespace = current_schema()::regnamespace ORDER BY 1, 2"
            ),
            "grants": sql.run(
                "SELECT relname, relacl::text FROM pg_class"
                " WHERE relnamespace = current_schema()::regnamespace ORDER BY 1"
            ),
            "settings": sql.run(
                "SELECT setconfig FROM pg_db_role_setting WHERE setdatabase ="
                " (SELECT oid FROM pg_database WHERE datname = current_database())"
            ),
            "planner": sql.run(
                "SELECT relname, relpages, reltuples, relallvisible FROM pg_class"
                " WHERE relnamespace = current_schema()::regnamespace ORDER BY 1"
            ),
            "statistics": sql.run(
                "SELECT count(*) FROM pg_statistic WHERE starelid IN"
                " (SELECT oid FROM pg_class WHERE relnamespace = current_schema()::regnamespace)"
            ),
        }
    finally:
        sql.close()


def first_history_id(sql) -> int:
    """The id the next history row gets."""
    insert_app(sql, "com.example.first")
    ((history_id,),) = sql.run(
        "INSERT INTO app_analyses (appid, analysis)"
        " VALUES ('com.example.first', CAST('{}' AS jsonb)) RETURNING id"
    )
    return history_id


def leave_rows_everywhere(url: str) -> None:
    """What a busy test leaves: rows in every table, the sequence moved on, the policy
    recorded, a ledger row added and one removed, planner statistics, an open session."""
    sql = connect(url)
    try:
        for n in range(300):
            insert_app(sql, f"app.{n:03d}", reviews=str(n))
        sql.run(
            "INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, success)"
            " SELECT appid, CAST('{}' AS jsonb), 4, now(), true FROM apps"
        )
        sql.run("INSERT INTO analyser_heartbeats (analyser_id) VALUES ('pi')")
        sql.run("UPDATE queue_policy SET analysis_version = 9, applied = now()")
        sql.run("INSERT INTO schema_migrations (filename) VALUES ('900_left_behind.sql')")
        sql.run("DELETE FROM schema_migrations WHERE filename = :name", name=LEDGER_FILES[0])
        sql.run("ANALYZE")
        assert database_state(url)["statistics"] != [[0]]
    finally:
        sql.close()


def test_a_restored_shared_database_is_a_fresh_copy(database_url, shared_database, databases):
    assert database_url == shared_database.url
    leave_rows_everywhere(database_url)
    left_open = connect(database_url)
    left_open.run("BEGIN")
    left_open.run("SELECT 1 FROM apps FOR UPDATE")  # holds locks TRUNCATE must wait for

    assert shared_database.restore() is False  # emptied, not made again
    assert shared_database.lend() == database_url
    fresh = databases.create()
    assert database_state(database_url) == database_state(fresh)
    # The identity starts again where the template's does.
    sql = connect(database_url)
    try:
        assert first_history_id(sql) == 1
    finally:
        sql.close()


def test_lend_refuses_a_database_left_as_it_was(database_url, shared_database):
    sql = connect(database_url)
    try:
        insert_app(sql, "com.example.left")
        with pytest.raises(RuntimeError, match=r"sessions still connected.*not as migrated: apps"):
            shared_database.lend()
    finally:
        sql.close()
    shared_database.restore()
    assert shared_database.lend() == database_url


# Each changes what a test could see beyond rows, unmarked (a test that means to is
# marked private_database): the shared database is made again from the template.
SCHEMA_CHANGES = [
    "ALTER TABLE apps ADD COLUMN stray integer",
    "CREATE TABLE stray (id integer)",
    "DROP INDEX apps_due",
    "CREATE INDEX stray ON apps (added)",
    "ALTER TABLE apps DISABLE TRIGGER USER",
    "CREATE FUNCTION stray() RETURNS integer LANGUAGE sql AS 'SELECT 1'",
    "ALTER TABLE queue_policy ALTER COLUMN stale_days SET DEFAULT 7",
    "ALTER SEQUENCE app_analyses_id_seq INCREMENT BY 2",
    "COMMENT ON TABLE apps IS 'stray'",
    "GRANT SELECT ON apps TO PUBLIC",
    "ALTER DATABASE {database} SET work_mem = '7MB'",
]


@pytest.fixture(scope="module")
def migrated_state(server_url, template_url):
    """database_state of a new copy of the migrated template."""
    with Databases(server_url, lambda: TEMPLATE_DB) as databases:
        return database_state(databases.create())


@pytest.mark.parametrize("statement", SCHEMA_CHANGES)
def test_a_schema_change_makes_the_shared_database_again(
    database_url, shared_database, migrated_state, statement
):
    sql = connect(database_url)
    try:
        sql.run(statement.format(database=urlsplit(database_url).path.lstrip("/")))
    finally:
        sql.close()
    assert shared_database.restore() is True  # made again from the template
    assert shared_database.lend() == database_url
    assert database_state(database_url) == migrated_state


# Two tests in a row on the shared database: the first leaves rows everywhere, the second
# (run after it, in file order) finds none of them. Run alone, the second finds the
# shared database as a session's first test does.
FIRST = {}


def test_one_test_leaves_rows_everywhere(database_url, shared_database):
    FIRST["url"] = database_url
    leave_rows_everywhere(database_url)
    sql = connect(database_url)
    sql.run("BEGIN")
    sql.run("SELECT 1 FROM apps FOR UPDATE")  # and a session left open


def test_the_next_test_finds_the_migrated_database(database_url, shared_database, sql):
    # The shared database (not a copy of its own), the one the first test left rows in.
    assert database_url == shared_database.url
    assert urlsplit(database_url).path == f"/{SHARED_DB}"
    if FIRST:
        assert FIRST["url"] == database_url
    for table in ("apps", "app_analyses", "analyser_heartbeats"):
        assert sql.run(f"SELECT count(*) FROM {table}") == [[0]], table
    assert sql.run(
        "SELECT singleton, analysis_version, stale_days, processing_timeout_minutes, applied"
        " FROM queue_policy"
    ) == [[True, None, None, None, None]]
    rows = ledger(sql)
    assert [row[0] for row in rows] == LEDGER_FILES
    assert all(len(row[1]) == 64 for row in rows)
    assert sql.run(
        "SELECT count(*) FROM pg_statistic WHERE starelid = CAST('apps' AS regclass)"
    ) == [[0]]
    assert first_history_id(sql) == 1
