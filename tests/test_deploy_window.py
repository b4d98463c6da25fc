"""The deploy window: the previous release keeps running for a while against the
migrated schema (migrations run before the new code boots). These are that release's own
statements, run after each ledger file from 007 to the head.
"""

from __future__ import annotations

import json
import shutil

import pg8000.native
import pytest

import handler
from conftest import connect
from helpers import app_row

# The previous release's statements (before the state-machine change), verbatim in shape.
OLD_ADD_APP = (
    "INSERT INTO apps (appid, details) VALUES (:appid, :details) ON CONFLICT (appid) DO NOTHING"
)
OLD_NEXT_APP = """
SELECT appid FROM apps
WHERE analysis IS NULL
   OR (analysis->>'success' = 'false' AND analysis->>'logs' = 'Processing in progress'
       AND (analysis->>'timestamp')::timestamptz < now() - interval '2 hours')
ORDER BY added
LIMIT 1 FOR UPDATE SKIP LOCKED
"""
OLD_LOCK_APP = """
UPDATE apps SET analysis = json_build_object(
    'success', false, 'logs', 'Processing in progress', 'timestamp', now())
WHERE appid = :appid
"""
OLD_UPDATE_ANALYSIS = """
UPDATE apps SET analysis = :analysis, analysisversion = :version, analysed = now()
WHERE appid = :appid
RETURNING appid, details, analysed
"""
OLD_RECORD_HISTORY = """
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed)
SELECT appid, analysis, analysisversion, analysed FROM apps WHERE appid = :appid
ON CONFLICT DO NOTHING
"""

# Every ledger file from the state-machine change to the head, so a new file is tested
# against the previous release as soon as it exists.
STAGES = sorted({path.name[:3] for path in handler.SQL_DIR.glob("*.sql") if path.name >= "007"})


def migrate_to(url: str, tmp_path, stage: str) -> None:
    directory = tmp_path / "sql"
    directory.mkdir()
    for path in sorted(handler.SQL_DIR.glob("*.sql")):
        if path.name[:3] <= stage:
            shutil.copy(path, directory / path.name)
    db = handler.Database(
        lambda: handler.connection_arguments(handler.load_settings({"DATABASE_URL": url}))
    )
    handler.apply_migrations(db, directory=directory)
    db.discard()


def old_release_cycle(sql, appid: str) -> list:
    """add -> claim (JSON marker) -> upload + history, as the previous release did it."""
    sql.run(OLD_ADD_APP, appid=appid, details=json.dumps({"reviews": "3"}))
    sql.run("BEGIN")
    (claimed,) = sql.run(OLD_NEXT_APP)[0]
    sql.run(OLD_LOCK_APP, appid=claimed)
    sql.run("COMMIT")
    assert claimed == appid
    sql.run("BEGIN")
    rows = sql.run(
        OLD_UPDATE_ANALYSIS, appid=appid, analysis=json.dumps({"success": True}), version=4
    )
    sql.run(OLD_RECORD_HISTORY, appid=appid)
    sql.run("COMMIT")
    return rows


@pytest.mark.parametrize("stage", STAGES)
def test_previous_release_statements_work_after_each_migration(empty_database, tmp_path, stage):
    migrate_to(empty_database, tmp_path, stage)
    sql = connect(empty_database)
    rows = old_release_cycle(sql, "com.example.old")
    assert rows[0][0] == "com.example.old"
    assert sql.run("SELECT count(*) FROM app_analyses") == [[1]]
    # Its ON CONFLICT (appid) still absorbs a repeated add of the same ID.
    sql.run(OLD_ADD_APP, appid="com.example.old", details="{}")
    # The rows it writes carry the new columns' defaults: queued, never promoted.
    (status,) = sql.run("SELECT status FROM apps WHERE appid = 'com.example.old'")[0]
    assert status == "queued"
    sql.close()


@pytest.mark.parametrize("stage", [stage for stage in STAGES if stage >= "009"])
def test_previous_release_cannot_add_a_case_variant_after_009(empty_database, tmp_path, stage):
    """What does not work in the window: ON CONFLICT (appid) does not cover the unique
    index on lower(appid), so adding com.Example.Old next to com.example.old fails (the
    new release's bare ON CONFLICT DO NOTHING absorbs it)."""
    migrate_to(empty_database, tmp_path, stage)
    sql = connect(empty_database)
    sql.run(OLD_ADD_APP, appid="com.example.old", details="{}")
    with pytest.raises(pg8000.native.DatabaseError) as failure:
        sql.run(OLD_ADD_APP, appid="com.Example.Old", details="{}")
    assert handler.sqlstate(failure.value) == "23505"
    sql.close()


def test_old_marker_on_a_queued_row_self_heals_on_the_next_claim(client, sql):
    """The previous release claimed a row (JSON marker) that the new columns still call
    queued: the new release's next claim takes it over; its upload makes it consistent."""
    from conftest import ANALYSER

    sql.run(OLD_ADD_APP, appid="com.example.app", details=json.dumps({"reviews": "1"}))
    sql.run(OLD_LOCK_APP, appid="com.example.app")
    assert app_row(sql, "com.example.app")["status"] == "queued"
    answer = client.get("/queue", headers=ANALYSER)
    assert answer.text == "com.example.app"
    assert app_row(sql, "com.example.app")["status"] == "processing"
    upload = client.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        json={"success": True},
        headers=ANALYSER,
    )
    assert upload.status_code == 200
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysis"]) == ("analysed", {"success": True})


def test_old_upload_on_a_new_claim_self_heals_when_the_lease_expires(client, sql):
    """The new release claimed a row, the previous release's analyser uploaded it (status
    untouched): the row stays processing until its lease expires, is handed out once
    more, and the new upload makes it consistent. Cost: one extra analysis."""
    from conftest import ANALYSER

    sql.run(OLD_ADD_APP, appid="com.example.app", details="{}")
    assert client.get("/queue", headers=ANALYSER).text == "com.example.app"
    sql.run(OLD_UPDATE_ANALYSIS, appid="com.example.app", analysis='{"success": true}', version=4)
    assert app_row(sql, "com.example.app")["status"] == "processing"
    handler._promotions.clear()
    assert client.get("/queue", headers=ANALYSER).text == ""  # lease still live
    sql.run("UPDATE apps SET processing_started = now() - interval '3 hours'")
    handler._promotions.clear()
    assert client.get("/queue", headers=ANALYSER).text == "com.example.app"
    client.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        json={"success": True, "again": 1},
        headers=ANALYSER,
    )
    assert app_row(sql, "com.example.app")["status"] == "analysed"
