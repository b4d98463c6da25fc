"""The deploy window: the previous release keeps running for a while against the
migrated schema (migrations run before the new code boots). These are that release's own
statements, run after each ledger file from 007 to the head.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import pg8000.native
import pytest
from kit import ADMIN as ADMIN_HEADERS
from kit import configure_service, time_passes

import handler
import legacy
from helpers import app_row, connect, migrate

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

# Every ledger file from the state-machine change to the head, so a new file is tested
# against the previous release as soon as it exists.
STAGES = sorted({path.name[:3] for path in handler.SQL_DIR.glob("*.sql") if path.name >= "007"})


def migrate_to(url: str, tmp_path, stage: str) -> None:
    directory = tmp_path / "sql"
    directory.mkdir()
    for path in sorted(handler.SQL_DIR.glob("*.sql")):
        if path.name[:3] <= stage:
            shutil.copy(path, directory / path.name)
    migrate(url, directory)


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
    sql.run(legacy.PRE_STATE_MACHINE_RECORD_HISTORY, appid=appid)
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
    from kit import ANALYSER

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
    from kit import ANALYSER

    sql.run(OLD_ADD_APP, appid="com.example.app", details="{}")
    assert client.get("/queue", headers=ANALYSER).text == "com.example.app"
    sql.run(OLD_UPDATE_ANALYSIS, appid="com.example.app", analysis='{"success": true}', version=4)
    assert app_row(sql, "com.example.app")["status"] == "processing"
    time_passes()
    assert client.get("/queue", headers=ANALYSER).text == ""  # lease still live
    sql.run("UPDATE apps SET processing_started = now() - interval '3 hours'")
    time_passes()
    assert client.get("/queue", headers=ANALYSER).text == "com.example.app"
    client.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        json={"success": True, "again": 1},
        headers=ANALYSER,
    )
    assert app_row(sql, "com.example.app")["status"] == "analysed"


# --- The old server's later releases (010-013) against the migrated database ----------


def adopted(url: str, state: str, monkeypatch):
    """The database in `state`, migrated to the head, served by this release."""
    from fastapi.testclient import TestClient

    legacy.build(url, state)
    migrate(url)
    configure_service(monkeypatch, url)
    return TestClient(handler.app, raise_server_exceptions=False)


def check_holds(sql) -> None:
    assert sql.run(
        "SELECT convalidated FROM pg_constraint WHERE conname = 'apps_processing_claim_token_check'"
    ) == [[True]]


@pytest.mark.parametrize("state", legacy.OLD_STATES)
def test_old_server_release_statements_after_migrate(empty_database, monkeypatch, state):
    """Its insert, its claim with a token, its completion that compares the token, its
    history insert and its website cache keep working on the migrated database."""
    with adopted(empty_database, state, monkeypatch):
        sql = connect(empty_database)
        sql.run(legacy.OLD_ADD_APP, appid="web.added", details='{"reviews": "1"}')
        assert app_row(sql, "web.added")["status"] == "queued"
        token = uuid.uuid4()
        ((claimed,),) = sql.run(legacy.OLD_CLAIM_NEXT, token=token)
        assert app_row(sql, claimed)["claim_token"] == str(token)
        # A completion with another token changes nothing.
        assert legacy.old_server_complete(sql, claimed, uuid.uuid4(), {"success": True}, "") == []
        assert app_row(sql, claimed)["status"] == "processing"
        history = legacy.OLD_RECORD_HISTORY_013 if state == "old013" else legacy.OLD_RECORD_HISTORY
        done = legacy.old_server_complete(sql, claimed, token, {"success": True}, history)
        assert done == [[claimed]]
        row = app_row(sql, claimed)
        assert (row["status"], row["claim_token"]) == ("analysed", None)
        assert sql.run("SELECT count(*) FROM app_analyses WHERE appid = :a", a=claimed)[0][0] >= 1
        if state != "old010":
            sql.run(legacy.OLD_CACHE_APP, appid="web.added", details='{"title": "x"}')
        check_holds(sql)
        sql.close()


def test_old_server_and_this_release_share_one_token(empty_database, monkeypatch):
    """One token column: a lease either release handed out is fenced by both."""
    from kit import ANALYSER

    with adopted(empty_database, "old013", monkeypatch) as client:
        sql = connect(empty_database)
        # This release's lease: the old release neither re-claims it nor completes it.
        answer = client.get("/queue?appId=old.queued", headers=ANALYSER)
        ours = answer.headers["x-analysis-claim-token"]
        assert sql.run(legacy.OLD_CLAIM_NAMED, appid="old.queued", token=uuid.uuid4()) == []
        assert legacy.old_server_complete(sql, "old.queued", uuid.uuid4(), {}, "") == []
        assert app_row(sql, "old.queued")["claim_token"] == ours
        # The old release's lease (old.live, handed out before the deploy): this release
        # does not hand it out, and takes its holder's result with that token.
        assert client.get("/queue?appId=old.live", headers=ANALYSER).text == ""
        theirs = app_row(sql, "old.live")["claim_token"]
        upload = client.post(
            "/uploadAnalysis?appId=old.live&analysisVersion=4",
            json={"success": True},
            headers={**ANALYSER, "X-Analysis-Claim-Token": theirs},
        )
        assert upload.status_code == 200
        # ... and a token of its is good for one result, in either release.
        assert legacy.old_server_complete(sql, "old.live", uuid.UUID(theirs), {}, "") == []
        check_holds(sql)
        sql.close()


def test_old_server_completion_of_a_promoted_row_leaves_a_flag_that_heals(
    empty_database, monkeypatch
):
    """The mismatch: the old release does not know `due`. A row the promoter flagged and
    the old release then analysed stays flagged, though it is no candidate; the claim
    re-checks the rule, so it is not handed out, and the next policy change clears it."""
    with adopted(empty_database, "old013", monkeypatch) as client:
        from kit import ANALYSER

        sql = connect(empty_database)
        sql.run("UPDATE apps SET analysed = now() - interval '400 days' WHERE appid = 'old.done'")
        handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
        assert app_row(sql, "old.done")["due"] is True
        token = uuid.uuid4()
        assert sql.run(legacy.OLD_CLAIM_NAMED, appid="old.done", token=token) == [["old.done"]]
        legacy.old_server_complete(
            sql, "old.done", token, {"success": True}, legacy.OLD_RECORD_HISTORY_013
        )
        row = app_row(sql, "old.done")
        assert (row["status"], row["due"]) == ("analysed", True)
        assert client.get("/queue?appId=old.done", headers=ANALYSER).text == ""
        # Healing: a new policy clears flags it does not support.
        configure_service(monkeypatch, empty_database, STALE_ANALYSIS_DAYS="181")
        handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
        assert app_row(sql, "old.done")["due"] is False
        check_holds(sql)
        sql.close()


# --- This service's previous release (ledger at 012, text claim tokens) ---------------


def test_previous_release_of_this_service_keeps_working_after_013(empty_database, monkeypatch):
    """Its statements name claim_token (text) and not analysis_claim_token: the trigger of
    018 gives its leases a uuid and clears it when they end, so the CHECK holds and its
    claims, results and refetches succeed. Its text token is no claim of this release
    (409), and its re-claim of an expired lease fences the uuid's previous holder."""
    from kit import ANALYSER

    with adopted(empty_database, "head", monkeypatch) as client:
        sql = connect(empty_database)
        assert sql.run(legacy.PREVIOUS_CLAIM_NAMED, appid="old.queued", token="previous-token") == [
            ["old.queued"]
        ]
        row = app_row(sql, "old.queued")
        assert row["status"] == "processing" and uuid.UUID(row["claim_token"])
        upload = client.post(
            "/uploadAnalysis?appId=old.queued&analysisVersion=4",
            json={"success": True},
            headers={**ANALYSER, "X-Analysis-Claim-Token": "previous-token"},
        )
        assert upload.status_code == 409
        assert sql.run(
            legacy.PREVIOUS_STORE_RESULT,
            appid="old.queued",
            analysis='{"success": true}',
            status="analysed",
            reason=None,
            retryable=None,
        ) == [["old.queued"]]
        assert app_row(sql, "old.queued")["claim_token"] is None

        # This release's lease expires; the previous release re-claims it.
        sql.run("UPDATE apps SET analysed = now() - interval '400 days' WHERE appid = 'old.done'")
        ours = client.get("/queue?appId=old.done", headers=ANALYSER).headers[
            "x-analysis-claim-token"
        ]
        sql.run(
            "UPDATE apps SET processing_started = now() - interval '3 hours'"
            " WHERE appid = 'old.done'"
        )
        sql.run(legacy.PREVIOUS_CLAIM_NAMED, appid="old.done", token="previous-again")
        assert app_row(sql, "old.done")["claim_token"] not in (None, ours)
        upload = client.post(
            "/uploadAnalysis?appId=old.done&analysisVersion=4",
            json={"success": True},
            headers={**ANALYSER, "X-Analysis-Claim-Token": ours},
        )
        assert upload.status_code == 409
        sql.run(legacy.PREVIOUS_REFETCH, appid="old.done")
        row = app_row(sql, "old.done")
        assert (row["status"], row["claim_token"]) == ("queued", None)
        check_holds(sql)
        sql.close()


# --- Named analysers (sql/022) while the older releases still run ---------------------


@pytest.mark.parametrize("state", ["head", "old013"])
def test_older_releases_and_named_analysers_share_the_migrated_database(
    empty_database, monkeypatch, state
):
    """During the deploy window the previous release (text claim tokens) or the old
    server's release (its own uuid tokens) still claim and complete apps, knowing nothing
    of analysers: their writes work beside named claims, a named claim they hand out
    again is no longer the named analyser's (its tokenless result: 409), and a named
    analyser's claim is fenced from them as any claim of this release is."""
    from kit import ADMIN

    with adopted(empty_database, state, monkeypatch) as client:
        sql = connect(empty_database)
        added = client.post("/analysers", json={"name": "pi-new"}, headers=ADMIN)
        named = {"Authorization": f"Bearer {added.json()['token']}"}
        # This release's named claim; the older release cannot take it while it is live.
        claim = client.get("/queue?appId=old.queued", headers=named)
        assert claim.text == "old.queued"
        if state == "old013":
            assert sql.run(legacy.OLD_CLAIM_NAMED, appid="old.queued", token=uuid.uuid4()) == []
        # The named lease expires; the older release hands the app out again.
        sql.run(
            "UPDATE apps SET processing_started = now() - interval '3 hours'"
            " WHERE appid = 'old.queued'"
        )
        if state == "head":
            sql.run(legacy.PREVIOUS_CLAIM_NAMED, appid="old.queued", token="previous-again")
        else:
            theirs = uuid.uuid4()
            assert sql.run(legacy.OLD_CLAIM_NAMED, appid="old.queued", token=theirs) == [
                ["old.queued"]
            ]
        late = client.post(
            "/uploadAnalysis?appId=old.queued&analysisVersion=4",
            json={"success": True},
            headers=named,
        )
        assert late.status_code == 409  # the lease is the older release's now
        assert app_row(sql, "old.queued")["status"] == "processing"
        # ... and that release completes it with its own statements.
        if state == "head":
            assert sql.run(
                legacy.PREVIOUS_STORE_RESULT,
                appid="old.queued",
                analysis='{"success": true}',
                status="analysed",
                reason=None,
                retryable=None,
            ) == [["old.queued"]]
        else:
            done = legacy.old_server_complete(
                sql, "old.queued", theirs, {"success": True}, legacy.OLD_RECORD_HISTORY_013
            )
            assert done == [["old.queued"]]
        assert app_row(sql, "old.queued")["status"] == "analysed"
        # The older release's history rows name no analyser; this release's do.
        sql.run("UPDATE apps SET analysed = now() - interval '400 days' WHERE appid = 'old.done'")
        assert client.get("/queue?appId=old.done", headers=named).text == "old.done"
        upload = client.post(
            "/uploadAnalysis?appId=old.done&analysisVersion=4",
            json={"success": True, "new": 1},
            headers=named,
        )
        assert upload.status_code == 200
        newest = "SELECT analyser FROM app_analyses WHERE appid = :a ORDER BY id DESC LIMIT 1"
        assert sql.run(newest, a="old.done") == [["pi-new"]]
        if state == "old013":
            assert sql.run(newest, a="old.queued") == [[None]]
        check_holds(sql)
        sql.close()


def release_019_store(sql, appid: str, payload: dict) -> list:
    state = handler.derive_analysis_state(payload)
    sql.run("BEGIN")
    rows = sql.run(
        legacy.RELEASE_019_STORE_RESULT,
        appid=appid,
        analysis=json.dumps(payload),
        version=4,
        status=state.status,
        failure_reason=state.failure_reason,
        failure_retryable=state.failure_retryable,
        document_limit=handler.LAMBDA_PAYLOAD_LIMIT_BYTES,
    )
    sql.run(legacy.RELEASE_019_RECORD_HISTORY, appids=[appid])
    sql.run("COMMIT")
    return rows


def test_the_release_before_named_analysers_keeps_working_after_022(client, sql):
    """This service's release before sql/022 (its statements verbatim) serves requests
    beside this one during the deploy: its claims, results, history and refetches work on
    the migrated schema, and a lease it hands out is nobody's by name, so a named
    analyser's tokenless result for it is refused. What does not hold in the window: that
    release does not fence by identity, so its tokenless result ends a named lease; which
    is why named analysers are added only once the deploy is done (docs/analysers.md)."""
    from kit import ADMIN, ANALYSER

    policy = handler.QueuePolicy().sql_params()
    for appid in ("w.one", "w.two"):
        sql.run(OLD_ADD_APP, appid=appid, details="{}")
    token = uuid.uuid4()
    assert sql.run(legacy.RELEASE_019_CLAIM_NAMED, appid="w.one", token=token, **policy) == [
        ["w.one"]
    ]
    added = client.post("/analysers", json={"name": "pi-w"}, headers=ADMIN)
    named = {"Authorization": f"Bearer {added.json()['token']}"}
    upload = "/uploadAnalysis?appId=w.one&analysisVersion=4"
    assert client.post(upload, json={"success": True}, headers=named).status_code == 409
    assert release_019_store(sql, "w.one", {"success": True})[0][0] == "w.one"
    assert app_row(sql, "w.one")["status"] == "analysed"
    assert sql.run("SELECT analyser FROM app_analyses WHERE appid = 'w.one'") == [[None]]
    # The window's gap: a named lease of this release, ended by that release's result.
    assert client.get("/queue?appId=w.two", headers=named).text == "w.two"
    assert release_019_store(sql, "w.two", {"success": True, "by": "old"})
    assert (
        client.post(
            "/uploadAnalysis?appId=w.two&analysisVersion=4", json={}, headers=named
        ).status_code
        == 409
    )  # it is no longer the named analyser's lease
    sql.run(legacy.RELEASE_019_REFETCH_APPLY, appids=["w.one", "w.two"])
    assert {app_row(sql, a)["status"] for a in ("w.one", "w.two")} == {"queued"}
    client.get("/ping", headers=named)
    client.get("/ping", headers=ANALYSER)
    # Its heartbeat count reads the shared password's table only.
    assert sql.run(legacy.RELEASE_019_LAST_PING)[0][1] == 1
    check_holds(sql)


# --- Retries, holds and pauses (sql/031-033) while the release before them still runs ----

# The release before sql/031, its claim and its result's store verbatim (its rendered
# statements: tests/sql_snapshot as it was then).
RELEASE_030 = Path(__file__).resolve().parent / "legacy_sql" / "release_030"


def release_030(sql, name: str, **values) -> list:
    """That release's statement `name`, with the parameters it names taken from values."""
    text = (RELEASE_030 / f"{name}.sql").read_text()
    named = set(re.findall(r"(?<!:):([a-z_]+)", text))
    return sql.run(text, **{key: value for key, value in values.items() if key in named})


def test_the_release_before_holds_and_retries_keeps_working_after_031(client, sql):
    """The release before sql/031 serves claims and results beside this one during the
    deploy: its claim and its store work on the migrated schema. What does not hold in
    the window (sql/031 says so): it knows no hold and no pause, so it may hand out a held
    app or claim for a paused analyser; the hold stays, and holds again for this release's
    claims from the moment the deploy ends. A failure it stores is retried by the back-off
    as a first failure."""
    from kit import ANALYSER

    policy = handler.QueuePolicy().sql_params()
    sql.run(OLD_ADD_APP, appid="w.held", details=json.dumps({"reviews": "900"}))
    sql.run(OLD_ADD_APP, appid="w.failing", details=json.dumps({"reviews": "5"}))
    assert client.post("/apps/w.held/hold", headers=ADMIN_HEADERS).json()["outcome"] == "held"
    token = uuid.uuid4()
    assert release_030(sql, "CLAIM_NEXT_APP", token=token, analyser=None, **policy) == [
        ["w.held"]
    ]  # the window's gap: that release knows no hold
    assert app_row(sql, "w.held")["status"] == "processing"
    stored = release_030(
        sql,
        "STORE_RESULT",
        analysis=json.dumps({"success": True}),
        version=4,
        status="analysed",
        failure_reason=None,
        failure_retryable=None,
        result_claim=token,
        verified=True,
        analyser=None,
        unless_stored=False,
        appid="w.held",
        document_limit=1000,
    )
    assert stored[0][0] == "w.held"
    # A failure that release stores (it writes no failure_streak) is a first failure.
    token = uuid.uuid4()
    assert release_030(sql, "CLAIM_NEXT_APP", token=token, analyser=None, **policy) == [
        ["w.failing"]
    ]
    release_030(
        sql,
        "STORE_RESULT",
        analysis=json.dumps({"success": False, "logs": "usb gone"}),
        version=4,
        status="failed",
        failure_reason="analysis_failed",
        failure_retryable=True,
        result_claim=token,
        verified=True,
        analyser=None,
        unless_stored=False,
        appid="w.failing",
        document_limit=1000,
    )
    sql.run("UPDATE apps SET analysed = now() - interval '2 hours' WHERE appid = 'w.failing'")
    why = client.get("/apps/w.failing", headers=ADMIN_HEADERS).json()["why"]
    assert why["retry"]["due"] is True, why
    time_passes()
    assert client.get("/queue", headers=ANALYSER).text == "w.failing"
    # The hold is still there: stale, w.held is handed out by no rule of this release.
    sql.run("UPDATE apps SET analysed = now() - interval '400 days' WHERE appid = 'w.held'")
    assert app_row(sql, "w.held")["status"] == "analysed"
    assert client.get("/queue?appId=w.held", headers=ANALYSER).text == ""
    assert client.get("/queue", headers=ANALYSER).text == ""
    check_holds(sql)


def test_a_failure_from_before_031_is_retried_once_an_hour_after_it(
    empty_database, tmp_path, monkeypatch
):
    """sql/031 counts a failure stored before it as the first of its run: with the default
    RETRY_BACKOFF it is retried (the lowest tier) an hour after it failed; one of 30
    minutes ago waits for its hour."""
    from fastapi.testclient import TestClient
    from kit import ANALYSER

    migrate_to(empty_database, tmp_path, "030")
    sql = connect(empty_database)
    for appid, minutes in (("pre.old", 120), ("pre.recent", 30)):
        sql.run(
            "INSERT INTO apps (appid, details, analysis, analysisversion, analysed, status,"
            " failure_reason, failure_retryable) VALUES (:appid, '{}',"
            ' \'{"success": false, "logs": "usb gone"}\', 4,'
            " now() - make_interval(mins => :minutes), 'failed', 'analysis_failed', true)",
            appid=appid,
            minutes=minutes,
        )
    assert migrate(empty_database) == [
        path.name for path in sorted(handler.SQL_DIR.glob("*.sql")) if path.name[:3] > "030"
    ]
    assert sql.run("SELECT appid, failure_streak FROM apps ORDER BY appid") == [
        ["pre.old", 1],
        ["pre.recent", 1],
    ]
    configure_service(monkeypatch, empty_database)
    with TestClient(handler.app) as client:
        old = client.get("/apps/pre.old", headers=ADMIN_HEADERS).json()["why"]
        recent = client.get("/apps/pre.recent", headers=ADMIN_HEADERS).json()["why"]
        assert (old["candidate"], old["retry"]["due"]) == (True, True)
        assert (recent["held"], recent["retry"]["due"]) == ("retry_backoff", False)
        assert client.get("/queue", headers=ANALYSER).text == "pre.old"
        assert client.get("/queue", headers=ANALYSER).text == ""
    sql.close()
