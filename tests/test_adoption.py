"""Adopting an existing database: each state another program left (tests/legacy.py), with
legacy rows in every queue state, is migrated and then served: claims with tokens (next
app and named app), results, a 409 on reuse, a failure report, a lease expiry and
re-claim, a refetch, promotion and the reports. After every step the old server's CHECK
apps_processing_claim_token_check is present and validated, no row breaks it, and the
website's tables and columns are as they were."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient
from kit import ANALYSER, configure_service, time_passes

import handler
import legacy
from helpers import app_row, connect, history, ledger, migrate, refetch_apps

CHECK = "apps_processing_claim_token_check"
OURS_AFTER_009 = [name for name in legacy.ALL_OUR_FILES if name >= "010"]


def constraint_state(sql) -> tuple:
    rows = sql.run(
        "SELECT convalidated, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = 'apps'::regclass AND conname = :name",
        name=CHECK,
    )
    return tuple(rows[0]) if rows else (None, None)


def breaking_rows(sql) -> int:
    ((count,),) = sql.run(
        "SELECT count(*) FROM apps WHERE NOT ("
        " (status = 'processing' AND analysis_claim_token IS NOT NULL)"
        " OR (status <> 'processing' AND analysis_claim_token IS NULL))"
    )
    return count


def not_ours(sql) -> list:
    """What the website owns, where it exists: app_store_cache whole, and the storefront
    columns of every history row that was there before (keyed by id)."""
    tables = {r[0] for r in sql.run("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    columns = {
        r[0]
        for r in sql.run(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'app_analyses'"
        )
    }
    snapshot = []
    if "app_store_cache" in tables:
        snapshot.append(sql.run("SELECT * FROM app_store_cache ORDER BY appid_key"))
    if "storefront_details" in columns:
        snapshot.append(
            sql.run(
                "SELECT id, storefront_details, storefront_fetched_at, storefront_version_matches,"
                " app_version FROM app_analyses ORDER BY id"
            )
        )
    return snapshot


class Cycle:
    """The checks that follow every step."""

    def __init__(self, sql, state: str):
        self.sql = sql
        self.state = state
        self.website = not_ours(sql)
        self.website_ids = {row[0] for row in self.website[-1]} if state == "old013" else set()

    def check(self, step: str) -> None:
        validated, definition = constraint_state(self.sql)
        assert validated is True, f"{step}: {CHECK} missing or not validated"
        assert "analysis_claim_token IS NOT NULL" in definition, step
        assert breaking_rows(self.sql) == 0, step
        now = not_ours(self.sql)
        if self.state == "old013":
            # Rows this service added to history carry no storefront listing; the old
            # ones keep theirs.
            cache, history = now
            assert cache == self.website[0], f"{step}: app_store_cache changed"
            kept = [row for row in history if row[0] in self.website_ids]
            assert kept == self.website[1], f"{step}: storefront columns changed"
            assert all(row[1] is None for row in history if row[0] not in self.website_ids)
        else:
            assert now == self.website, f"{step}: the website's tables changed"


def claim(client, appid: str | None = None):
    path = "/queue" if appid is None else f"/queue?appId={appid}"
    answer = client.get(path, headers=ANALYSER)
    assert answer.status_code == 200
    return answer.text, answer.headers.get("x-analysis-claim-token")


def upload(client, appid: str, token: str | bytes | None, payload: dict | None = None):
    headers = {**ANALYSER} if token is None else {**ANALYSER, "X-Analysis-Claim-Token": token}
    return client.post(
        f"/uploadAnalysis?appId={appid}&analysisVersion=4",
        json=payload or {"success": True, "trackers": {}},
        headers=headers,
    )


def report_failure(client, appid: str, token: str):
    return client.post(
        f"/reportAnalysisFailure?appId={appid}&analysisVersion=4",
        content=b"usb error",
        headers={**ANALYSER, "X-Analysis-Claim-Token": token, "Content-Type": "text/plain"},
    )


@pytest.mark.parametrize("state", legacy.STATES)
def test_migrate_then_serve_an_adopted_database(empty_database, monkeypatch, state):
    url = empty_database
    legacy_tokens = legacy.build(url, state)
    sql = connect(url)
    cycle = Cycle(sql, state)

    # --- migrate ------------------------------------------------------------------------
    expected = {
        "006": [n for n in legacy.ALL_OUR_FILES if n >= "007"],
        "009": OURS_AFTER_009,
        "head": [n for n in legacy.ALL_OUR_FILES if n >= "013"],
    }.get(state, OURS_AFTER_009)
    assert migrate(url) == expected
    assert migrate(url) == []
    checksums = {filename: checksum for filename, checksum, _ in ledger(sql)}
    foreign = [name for name in legacy.OLD_SERVER_FILES if name in checksums]
    assert len(foreign) == (legacy.OLD_STATES.index(state) + 1 if state.startswith("old") else 0)
    assert all(checksums[name] is None for name in foreign)  # not ours: not adopted
    cycle.check("migrate")

    # Every legacy row is in the state it was in, and a lease keeps its holder's token
    # when that token was already a uuid (the old server's claims).
    after = {appid: app_row(sql, appid) for appid in legacy.LEGACY_APPS}
    assert {appid: row["status"] for appid, row in after.items()} == {
        "old.live": "processing",
        "old.expired": "processing",
        "old.queued": "queued",
        "old.done": "analysed",
        "old.failed": "failed",
    }
    for appid in ("old.live", "old.expired"):
        assert after[appid]["claim_token"] is not None
        if state.startswith("old"):
            assert after[appid]["claim_token"] == legacy_tokens[appid]

    # The service's own statements keep the CHECK without the triggers' help (they are
    # for the previous release: tests/test_deploy_window.py).
    assert {
        r[0]
        for r in sql.run(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'apps'::regclass AND NOT tgisinternal"
        )
    } == {"apps_claim_token_on_insert", "apps_claim_token_on_update"}
    sql.run("ALTER TABLE apps DISABLE TRIGGER USER")

    configure_service(monkeypatch, url)
    with TestClient(handler.app, raise_server_exceptions=False) as client:
        # --- next-app claim: the expired lease, taken over with a new token -------------
        appid, token = claim(client)
        assert appid == "old.expired"
        assert str(uuid.UUID(token)) == token == app_row(sql, appid)["claim_token"]
        cycle.check("claim of an expired lease")
        if legacy_tokens["old.expired"] is not None:
            # Its previous holder's result is refused: the lease moved on.
            answer = upload(client, appid, legacy_tokens["old.expired"])
            assert answer.status_code == 409
        history_before = len(history(sql, appid))
        assert upload(client, appid, token).status_code == 200
        # RECORD_HISTORY names its columns: it works with or without the website's
        # storefront columns (and the generated one) on app_analyses.
        assert len(history(sql, appid)) == history_before + 1
        # Sent again (a lost reply): answered as the first time, nothing written; another
        # result with the spent token is refused.
        assert upload(client, appid, token).status_code == 200
        assert len(history(sql, appid)) == history_before + 1
        assert upload(client, appid, token, {"success": True, "again": 1}).status_code == 409
        assert app_row(sql, appid)["status"] == "analysed"
        cycle.check("result")

        # --- the live lease another program handed out -----------------------------------
        assert claim(client)[0] == "old.queued"  # old.live is not handed out again
        holder = legacy_tokens["old.live"]
        if holder is not None and not state.startswith("old"):
            # The previous release's text token is not a claim of this one: 409.
            assert upload(client, "old.live", holder).status_code == 409
            holder = None
        assert upload(client, "old.live", holder).status_code == 200
        assert app_row(sql, "old.live")["status"] == "analysed"
        cycle.check("result for a lease another program handed out")

        # --- a token that is not a UUID is a stale claim (409), one that is not printable
        # ASCII is bad input (400 naming the header); never a 500 -------------------------
        for bad in ("not-a-uuid", "'; DROP TABLE apps; --", ""):
            answer = upload(client, "old.queued", bad)
            assert answer.status_code == 409, bad
        for bad in ("é".encode() * 20, b"\xff\xfe"):
            answer = upload(client, "old.queued", bad)
            assert answer.status_code == 400, bad
            assert "X-Analysis-Claim-Token" in answer.json()["detail"]
        assert app_row(sql, "old.queued")["status"] == "processing"

        # --- failure report with the token ------------------------------------------------
        token = app_row(sql, "old.queued")["claim_token"]
        assert report_failure(client, "old.queued", token).status_code == 200
        row = app_row(sql, "old.queued")
        assert (row["status"], row["failure_retryable"], row["claim_token"]) == (
            "failed",
            True,
            None,
        )
        cycle.check("failure report")

        # --- named claim, lease expiry, re-claim ------------------------------------------
        # A fresh retryable failure is not a candidate: it becomes one when it is stale.
        assert claim(client, "old.failed") == ("", None)
        sql.run("UPDATE apps SET analysed = now() - interval '200 days' WHERE appid = 'old.failed'")
        appid, first = claim(client, "old.failed")
        assert appid == "old.failed"
        cycle.check("named claim")
        sql.run(
            "UPDATE apps SET processing_started = now() - interval '3 hours'"
            " WHERE appid = 'old.failed'"
        )
        time_passes()
        again, second = claim(client, "old.failed")
        assert again == "old.failed" and second != first
        cycle.check("re-claim after the lease expired")
        assert upload(client, "old.failed", first).status_code == 409
        assert upload(client, "old.failed", second).status_code == 200
        cycle.check("result of the re-claim")

        # --- refetch, then a claim without a token (the deployed analysers) ---------------
        db = handler.api_connection()
        assert refetch_apps(db, ["old.done"]) == [
            {"appid": "old.done", "status": "analysed", "outcome": "queued"}
        ]
        assert app_row(sql, "old.done")["status"] == "queued"
        cycle.check("refetch")
        assert claim(client, "old.done")[0] == "old.done"
        assert upload(client, "old.done", None).status_code == 200
        cycle.check("result without a token")

        # --- promotion of a stale analysis, claimed by the next-app claim -----------------
        sql.run("UPDATE apps SET analysed = now() - interval '400 days' WHERE appid = 'old.done'")
        promotion = handler.promote_due_apps(db, handler.settings().policy, force=True)
        assert promotion.stale >= 1
        assert app_row(sql, "old.done")["due"] is True
        cycle.check("promotion")
        assert claim(client)[0] == "old.done"
        cycle.check("claim of a promoted row")

        # --- the reports ------------------------------------------------------------------
        status = handler.queue_status(db, handler.settings().policy)
        assert status.counts["processing"] >= 1
        handler.priority_report(db, handler.settings().policy, 10)
        cycle.check("reports")
    sql.close()
