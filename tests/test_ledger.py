"""The SQL ledger: a new database, a production database at 006, and the runner's rules."""

from __future__ import annotations

import json
import shutil
import threading
import time
from datetime import UTC, datetime

import pg8000.native
import pytest

import handler
from helpers import connect, database_at, ledger, record_in_ledger, run_together
from legacy import build_production_database

ALL_FILES = [path.name for path in sorted(handler.SQL_DIR.glob("*.sql"))]


def copy_ledger(tmp_path, names):
    directory = tmp_path / "sql"
    directory.mkdir()
    for name in names:
        shutil.copy(handler.SQL_DIR / name, directory / name)
    return directory


def test_production_file_names_are_kept():
    assert ALL_FILES[:10] == [
        "000_apps.sql",
        "001_app_analyses.sql",
        "002_mark_app_not_found_non_retryable.sql",
        "003_reject_invalid_app_ids.sql",
        "004_mark_ios_version_too_low_non_retryable.sql",
        "005_mark_paid_apps_non_retryable.sql",
        "006_app_analyses_unique.sql",
        "007_apps_state_columns.sql",
        "008_jsonb_timestamptz.sql",
        "009_case_insensitive_appids.sql",
    ]
    for name in ALL_FILES:
        head = (handler.SQL_DIR / name).read_text().splitlines()[:3]
        assert head[0].startswith("-- "), f"{name} must open with why it is safe"
        assert "Safe while the previous release runs" in (handler.SQL_DIR / name).read_text()


def test_ledger_on_an_empty_database(empty_database):
    db = database_at(empty_database)
    assert handler.apply_migrations(db, dry_run=True) == ALL_FILES
    assert handler.apply_migrations(db) == ALL_FILES
    assert handler.apply_migrations(db) == []
    sql = connect(empty_database)
    rows = ledger(sql)
    assert [r[0] for r in rows] == ALL_FILES
    assert all(len(r[1]) == 64 for r in rows)
    db.discard()
    sql.close()


def test_upgrade_of_a_production_database_at_006(empty_database):
    build_production_database(empty_database, with_rows=True)
    db = database_at(empty_database)
    assert handler.apply_migrations(db) == [n for n in ALL_FILES if n >= "007"]
    db.discard()
    sql = connect(empty_database)
    rows = {
        r[0]: dict(
            zip(
                ["status", "started", "reason", "retryable", "analysed", "analysis"],
                r[1:],
                strict=True,
            )
        )
        for r in sql.run(
            "SELECT appid, status, processing_started, failure_reason, failure_retryable,"
            " analysed, analysis FROM apps"
        )
    }
    ((now,),) = sql.run("SELECT now()")

    assert rows["app.queued"]["status"] == "queued"
    assert rows["app.processing"]["status"] == "processing"
    assert rows["app.processing"]["started"] == datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    for malformed in (
        "app.processing.badtime",
        "app.processing.impossible",
        "app.processing.notime",
    ):
        assert rows[malformed]["status"] == "processing"
        assert abs((now - rows[malformed]["started"]).total_seconds()) < 120
    assert (
        rows["app.failed.final"]["status"],
        rows["app.failed.final"]["reason"],
        rows["app.failed.final"]["retryable"],
    ) == ("failed", "paid_app", False)
    assert (rows["app.failed.noflag"]["reason"], rows["app.failed.noflag"]["retryable"]) == (
        "analysis_failed",
        True,
    )
    assert rows["app.failed.retry"]["retryable"] is True
    # 002 marked it before 007 read it.
    assert (rows["app.failed.notfound"]["reason"], rows["app.failed.notfound"]["retryable"]) == (
        "app_not_found",
        False,
    )
    assert rows["app.failed.nul"]["analysis"]["logs"] == "bad\ufffdbyte"
    assert rows["app.analysed"]["status"] == "analysed"
    assert rows["app.analysed"]["analysed"] == datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    assert rows["app.analysed.nosuccess"]["status"] == "analysed"
    # 003 marked the invalid ID failed, not retryable.
    assert (rows["bad id!"]["status"], rows["bad id!"]["reason"], rows["bad id!"]["retryable"]) == (
        "failed",
        "invalid_bundle_id",
        False,
    )

    # Case variants merged into their keepers.
    assert "com.Example.App" in rows and "org.two" in rows and "net.three" in rows
    for loser in ("com.example.app", "COM.EXAMPLE.APP", "org.Two", "net.Three"):
        assert loser not in rows
    history = sql.run("SELECT appid, analysed FROM app_analyses ORDER BY appid, analysed")
    keeper_history = [str(r[1].date()) for r in history if r[0] == "com.Example.App"]
    # 001 copied each app's analysis, 006 removed exact duplicates, 009 merged the rest.
    assert sorted(keeper_history) == ["2025-07-01", "2026-01-01", "2026-06-01", "2026-09-01"]
    assert sorted(str(r[1].date()) for r in history if r[0] == "org.two") == [
        "2026-01-01",
        "2026-05-01",
    ]
    assert len(history) == len({(r[0], r[1]) for r in history})

    indexes = {r[0] for r in sql.run("SELECT indexname FROM pg_indexes WHERE tablename = 'apps'")}
    assert {"apps_appid_lower_key", "apps_claim_order", "apps_version_order"} <= indexes
    with pytest.raises(pg8000.native.DatabaseError):
        sql.run("INSERT INTO apps (appid) VALUES ('COM.example.APP')")
    assert all(r[1] for r in ledger(sql))  # the old rows were adopted with checksums
    sql.close()


def test_history_count_after_merge(empty_database):
    build_production_database(empty_database, with_rows=True)
    sql = connect(empty_database)
    ((before,),) = sql.run("SELECT count(*) FROM app_analyses")
    db = database_at(empty_database)
    handler.apply_migrations(db)
    db.discard()
    ((after,),) = sql.run("SELECT count(*) FROM app_analyses")
    assert before - after == 2  # exactly the two colliding rows the note says to drop
    sql.close()


def test_a_database_already_at_009_is_adopted(empty_database, tmp_path):
    build_production_database(empty_database)
    sql = connect(empty_database)
    for name in (
        "007_apps_state_columns.sql",
        "008_jsonb_timestamptz.sql",
        "009_case_insensitive_appids.sql",
    ):
        sql.execute_simple((handler.SQL_DIR / name).read_text())
        record_in_ledger(sql, name)
    db = database_at(empty_database)
    assert handler.apply_migrations(db) == [n for n in ALL_FILES if n >= "010"]
    db.discard()
    assert len(ledger(sql)) == len(ALL_FILES)
    sql.close()


def test_edited_file_is_refused(empty_database, tmp_path):
    directory = copy_ledger(tmp_path, ALL_FILES)
    db = database_at(empty_database)
    handler.apply_migrations(db, directory=directory)
    edited = directory / "003_reject_invalid_app_ids.sql"
    edited.write_text(edited.read_text() + "\n-- a harmless edit is still an edit\n")
    with pytest.raises(
        handler.MigrationRefused, match=r"003_reject_invalid_app_ids\.sql was edited"
    ):
        handler.apply_migrations(db, directory=directory)
    db.discard()


def test_out_of_order_file_is_refused(empty_database, tmp_path):
    directory = copy_ledger(tmp_path, ALL_FILES)
    db = database_at(empty_database)
    handler.apply_migrations(db, directory=directory)
    (directory / "005a_late_arrival.sql").write_text("-- late\nSELECT 1;\n")
    with pytest.raises(handler.MigrationRefused, match=r"005a_late_arrival\.sql"):
        handler.apply_migrations(db, directory=directory)
    sql = connect(empty_database)
    assert "005a_late_arrival.sql" not in [r[0] for r in ledger(sql)]
    db.discard()
    sql.close()


def test_failing_file_rolls_back_with_the_ledger_unchanged(empty_database, tmp_path):
    directory = copy_ledger(tmp_path, ALL_FILES)
    (directory / "099_broken.sql").write_text(
        "-- broken\nCREATE TABLE half_done (x int);\nINSERT INTO half_done VALUES (1);\n"
        "SELECT 1 / 0;\n"
    )
    db = database_at(empty_database)
    with pytest.raises(handler.MigrationFailed, match=r"^099_broken\.sql: 22012: division by zero"):
        handler.apply_migrations(db, directory=directory)
    sql = connect(empty_database)
    assert [r[0] for r in ledger(sql)] == ALL_FILES
    assert sql.run("SELECT to_regclass('half_done')") == [[None]]
    (directory / "099_broken.sql").write_text("-- fixed\nCREATE TABLE half_done (x int);\n")
    assert handler.apply_migrations(db, directory=directory) == ["099_broken.sql"]
    db.discard()
    sql.close()


def test_two_runners_at_once_apply_each_file_once(empty_database):
    results, errors = [], []
    barrier = threading.Barrier(2)

    def run():
        db = database_at(empty_database)
        barrier.wait()
        try:
            results.append(handler.apply_migrations(db))
        except Exception as error:
            errors.append(error)
        finally:
            db.discard()

    run_together([run, run], timeout=120)
    assert errors == []
    assert sorted(results, key=len) == [[], ALL_FILES]
    sql = connect(empty_database)
    assert [r[0] for r in ledger(sql)] == ALL_FILES
    sql.close()


def test_lock_timeout_stops_a_runner_stuck_behind_a_long_query(empty_database, tmp_path):
    directory = copy_ledger(tmp_path, ALL_FILES)
    db = database_at(empty_database)
    handler.apply_migrations(db, directory=directory)
    (directory / "050_needs_apps.sql").write_text("-- x\nALTER TABLE apps ADD COLUMN x int;\n")
    blocker = connect(empty_database)
    blocker.run("BEGIN")
    blocker.run("SELECT count(*) FROM apps")  # a long report holds ACCESS SHARE
    started = time.monotonic()
    with pytest.raises(handler.MigrationFailed) as failure:
        handler.apply_migrations(db, directory=directory, lock_timeout="500ms")
    assert failure.value.sqlstate == "55P03"
    assert failure.value.filename == "050_needs_apps.sql"
    assert time.monotonic() - started < 10
    blocker.run("ROLLBACK")
    assert handler.apply_migrations(db, directory=directory) == ["050_needs_apps.sql"]
    db.discard()
    blocker.close()


def test_pending_rules_are_pure():
    files = [handler.MigrationFile(n, "", c) for n, c in (("001_a.sql", "a"), ("002_b.sql", "b"))]
    assert handler.pending_migrations(files, {}) == files
    assert handler.pending_migrations(files, {"001_a.sql": "a"}) == files[1:]
    assert handler.pending_migrations(files, {"001_a.sql": None}) == files[1:]
    with pytest.raises(handler.MigrationRefused):
        handler.pending_migrations(files, {"001_a.sql": "changed"})
    with pytest.raises(handler.MigrationRefused):
        handler.pending_migrations(files, {"002_b.sql": "b"})


# --- Files that are not ours, and files that are nobody's -------------------------------

OLD_SERVER_LATER_FILES = sorted(handler.FOREIGN_LEDGER_FILES)


def test_old_server_files_are_history_that_is_not_ours():
    files = [
        handler.MigrationFile(n, "", n)
        for n in ("009_c.sql", "010_claim_columns.sql", "014_mine.sql")
    ]
    ledger = {"009_c.sql": "009_c.sql", **dict.fromkeys(OLD_SERVER_LATER_FILES)}
    # Never run, never required, and our pending 010 does not "sort before" their 013.
    assert handler.pending_migrations(files, ledger) == files[1:]
    # Our own files keep their checks.
    with pytest.raises(handler.MigrationRefused, match=r"009_c\.sql was edited"):
        handler.pending_migrations(files, {**ledger, "009_c.sql": "changed"})
    with pytest.raises(handler.MigrationRefused, match=r"010_claim_columns\.sql sort\(s\) before"):
        handler.pending_migrations(files, {**ledger, "014_mine.sql": "014_mine.sql"})


def test_an_unknown_ledger_file_is_refused_with_what_to_do(empty_database, tmp_path):
    directory = copy_ledger(tmp_path, ALL_FILES)
    db = database_at(empty_database)
    handler.apply_migrations(db, directory=directory)
    sql = connect(empty_database)
    record_in_ledger(sql, "013_mystery.sql")
    (directory / "099_next.sql").write_text("-- next\nCREATE TABLE next_one (x int);\n")
    with pytest.raises(handler.MigrationRefused) as refusal:
        handler.apply_migrations(db, directory=directory)
    message = str(refusal.value)
    assert "013_mystery.sql" in message
    assert "Deploy the release whose sql/ has it" in message
    assert "delete its schema_migrations row" in message
    assert sql.run("SELECT to_regclass('next_one')") == [[None]]
    db.discard()
    sql.close()


# --- No-transaction files ---------------------------------------------------------------

UNIQUE_TITLES = """-- ledger: no-transaction
-- A unique index built without blocking writes.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS apps_title_key ON apps ((details->>'title'));
"""


def index_validity(sql, name: str) -> list:
    return sql.run(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE c.relname = :name",
        name=name,
    )


def add_titled_apps(sql, *titles: str) -> None:
    for number, title in enumerate(titles):
        sql.run(
            "INSERT INTO apps (appid, details) VALUES (:a, CAST(:d AS jsonb))",
            a=f"app.titled{number}",
            d=json.dumps({"title": title}),
        )


def test_marker_declares_a_file_outside_a_transaction():
    assert not handler.MigrationFile("x.sql", UNIQUE_TITLES, "c").transactional
    assert handler.MigrationFile("x.sql", "-- x\n-- ledger: no-transaction\n", "c").transactional
    assert handler.MigrationFile("x.sql", "CREATE INDEX x ON apps (appid);\n", "c").transactional


def test_no_transaction_file_is_recorded_only_after_it_succeeds(empty_database, tmp_path):
    directory = copy_ledger(tmp_path, ALL_FILES)
    db = database_at(empty_database)
    handler.apply_migrations(db, directory=directory)
    sql = connect(empty_database)
    add_titled_apps(sql, "Same", "Same", "Other")
    (directory / "099_unique_titles.sql").write_text(UNIQUE_TITLES)

    # The concurrent build fails on the duplicate: no ledger row, and the INVALID index
    # it left is dropped (else the re-run's IF NOT EXISTS would skip the build).
    with pytest.raises(handler.MigrationFailed, match=r"^099_unique_titles\.sql: 23505"):
        handler.apply_migrations(db, directory=directory)
    assert "099_unique_titles.sql" not in [r[0] for r in ledger(sql)]
    assert index_validity(sql, "apps_title_key") == []

    sql.run("UPDATE apps SET details = '{\"title\": \"Renamed\"}' WHERE appid = 'app.titled1'")
    assert handler.apply_migrations(db, directory=directory) == ["099_unique_titles.sql"]
    assert index_validity(sql, "apps_title_key") == [[True]]
    assert "099_unique_titles.sql" in [r[0] for r in ledger(sql)]

    # Run again (a runner that died after the build, before its ledger row): harmless.
    sql.run("DELETE FROM schema_migrations WHERE filename = '099_unique_titles.sql'")
    assert handler.apply_migrations(db, directory=directory) == ["099_unique_titles.sql"]
    assert index_validity(sql, "apps_title_key") == [[True]]
    db.discard()
    sql.close()


def test_an_invalid_index_an_earlier_build_left_is_rebuilt(empty_database, tmp_path):
    """A build killed half-way (the Lambda timed out, the connection dropped) leaves an
    INVALID index and no ledger row: the next run drops it and builds it again."""
    directory = copy_ledger(tmp_path, ALL_FILES)
    db = database_at(empty_database)
    handler.apply_migrations(db, directory=directory)
    sql = connect(empty_database)
    add_titled_apps(sql, "Same", "Same")
    with pytest.raises(pg8000.native.DatabaseError):
        sql.execute_simple(UNIQUE_TITLES)
    assert index_validity(sql, "apps_title_key") == [[False]]
    # Someone else's invalid index, not named by the file, is left alone.
    with pytest.raises(pg8000.native.DatabaseError):
        sql.execute_simple(
            "CREATE UNIQUE INDEX CONCURRENTLY apps_title_key2 ON apps ((details->>'title'))"
        )
    sql.run("DELETE FROM apps WHERE appid = 'app.titled1'")
    (directory / "099_unique_titles.sql").write_text(UNIQUE_TITLES)
    assert handler.apply_migrations(db, directory=directory) == ["099_unique_titles.sql"]
    assert index_validity(sql, "apps_title_key") == [[True]]
    assert index_validity(sql, "apps_title_key2") == [[False]]
    db.discard()
    sql.close()
