"""Fidelity to the old server where the website and the history rely on it
(docs/adopting.md): an app is added under the App Store listing's bundle ID casing; a
listing that names another app is refused; a history row whose analysis names no source
says 'legacy', on every path that writes history and in the rows already written, on a
database this service made and on one adopted from the old server's ledger."""

from __future__ import annotations

import json
import os
import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN, ANALYSER, ROOT, configure_service

import handler
import legacy
from helpers import (
    LambdaContext,
    app_row,
    call_cli,
    connect,
    days_ago,
    insert_app,
    load_event,
    migrate,
    table_digest,
)

MISMATCH = "App Store bundle ID mismatch"
# The database persists across a test's examples: each example starts by emptying apps
# (history goes with it: ON DELETE CASCADE).
PER_EXAMPLE = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
    max_examples=40,
)

# --- strategies ----------------------------------------------------------------------

bundle_ids = st.from_regex(
    r"[A-Za-z0-9][A-Za-z0-9-]{0,8}(\.[A-Za-z0-9][A-Za-z0-9-]{0,8}){0,3}", fullmatch=True
)

# Text jsonb can hold (no NUL, no lone surrogate): what an accepted upload carries.
storable_text = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")


@st.composite
def recased(draw, text: str) -> str:
    """text in a drawn letter case."""
    flips = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.swapcase() if flip else c for c, flip in zip(text, flips, strict=True))


@st.composite
def casings(draw, count: int) -> list[str]:
    """`count` spellings of one bundle ID, each in a letter case of its own."""
    base = draw(bundle_ids)
    return [draw(recased(base)) for _ in range(count)]


@st.composite
def foreign_listings(draw, app_id: str):
    """A listing's appId that does not name app_id: another bundle ID, one that only
    Unicode case folding makes equal (the Kelvin sign folds to "k"), text that is no
    bundle ID, or no text at all."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        other = draw(bundle_ids.filter(lambda o: o.lower() != app_id.lower()))
        return draw(recased(other))
    if kind == 1:
        return re.sub("[kK]", "\u212a", app_id) if re.search("[kK]", app_id) else "\u212a" + app_id
    if kind == 2:
        return draw(
            st.one_of(
                st.sampled_from(["", " ", f"{app_id}.", f" {app_id}", f"{app_id}\n", "-a"]),
                st.text(storable_text),
            ).filter(lambda text: text.lower() != app_id.lower())
        )
    return draw(st.one_of(st.none(), st.booleans(), st.integers(), st.lists(st.integers())))


MISSING = object()  # the analysis has no analysis_source at all
sources = st.one_of(
    st.just(MISSING),
    st.sampled_from(["", " ", "trackerscan-ios", "legacy"]),
    st.text(storable_text, max_size=12),
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.integers(-(10**6), 10**6).map(lambda n: n / 8),  # floats stored as sent
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.sampled_from(["name"]), st.text(storable_text, max_size=3)),
)


def analysis_with(source, success: bool = True) -> dict:
    payload = {"success": success, "version": "1.0", "trackers": {}}
    if not success:
        payload["logs"] = "usb error"
    if source is not MISSING:
        payload["analysis_source"] = source
    return payload


def expected_source(source) -> str:
    """The old server's rule: the analysis's source when it is non-empty text."""
    return source if isinstance(source, str) and source else "legacy"


def sources_of(sql, appid: str) -> list:
    return [
        row[0]
        for row in sql.run(
            "SELECT analysis_source FROM app_analyses WHERE appid = :appid ORDER BY id",
            appid=appid,
        )
    ]


def add(client, app_id, details=MISSING):
    body = {"appId": app_id} if details is MISSING else {"appId": app_id, "details": details}
    return client.post("/apps", json=body, headers=ADMIN)


# --- the bundle ID an app is added under ---------------------------------------------


@given(spellings=casings(3), title=st.text(max_size=5))
def test_the_listing_names_the_stored_casing_of_any_casing_asked_for(spellings, title):
    asked, listed, _ = spellings
    assert handler.listed_bundle_id(asked, {"appId": listed, "title": title}) == listed
    assert handler.listed_bundle_id(asked, {"title": title}) == asked
    assert handler.listed_bundle_id(asked, None) == asked


@given(data=st.data(), app_id=bundle_ids)
def test_a_listing_that_names_another_app_names_none(data, app_id):
    listed = data.draw(foreign_listings(app_id))
    assert handler.listed_bundle_id(app_id, {"appId": listed}) is None


@PER_EXAMPLE
@given(spellings=casings(3))
def test_an_app_is_added_under_the_listings_casing_and_handed_out_so(client, sql, spellings):
    sql.run("DELETE FROM apps")
    asked, listed, again = spellings
    details = {"appId": listed, "title": "Example", "reviews": "12"}
    created = add(client, asked, details)
    assert created.status_code == 201, created.text
    assert created.json()["appId"] == listed
    assert sql.run("SELECT appid FROM apps") == [[listed]]
    # Added again in a third casing (its listing in the second): the same app, unchanged.
    repeated = add(client, again, {**details, "appId": again, "reviews": "99"})
    assert repeated.status_code == 200, repeated.text
    assert repeated.json()["appId"] == listed
    assert repeated.json()["details"]["reviews"] == "12"
    assert client.get(f"/apps/{again}").json()["appId"] == listed
    # The analysers download by what /queue answers: the App Store's casing.
    claimed = client.get("/queue", headers=ANALYSER)
    assert claimed.text == listed


@PER_EXAMPLE
@given(data=st.data(), spellings=casings(2), exists=st.booleans())
def test_a_listing_naming_another_app_is_refused_and_changes_nothing(
    client, sql, data, spellings, exists
):
    sql.run("DELETE FROM apps")
    asked, stored = spellings
    if exists:
        insert_app(sql, stored, reviews="3")
    listed = data.draw(foreign_listings(asked))
    before = table_digest(sql)
    answer = add(client, asked, {"appId": listed, "title": "Other", "reviews": "9000"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["detail"] == f"{MISMATCH}: details.appId does not name {asked}"
    assert table_digest(sql) == before


@PER_EXAMPLE
@given(spellings=casings(1), details=st.sampled_from([MISSING, None, {}, {"reviews": "4"}]))
def test_a_listing_that_names_no_app_keeps_the_requested_casing(client, sql, spellings, details):
    """The one difference kept (docs/adopting.md): the old server refuses an add without
    a listing naming the app; POST /apps takes it, under the requested casing."""
    sql.run("DELETE FROM apps")
    (asked,) = spellings
    created = add(client, asked, details)
    assert created.status_code == 201, created.text
    assert sql.run("SELECT appid FROM apps") == [[asked]]


def test_an_existing_app_keeps_its_bundle_id_and_history_when_its_listing_differs(client, sql):
    """A row stored under another casing (by a release before this one) is not renamed by
    a later add whose listing has the App Store's casing: its history references it."""
    insert_app(sql, "com.Example.App", status="analysed", version=4, analysed=days_ago(1))
    sql.run(
        "INSERT INTO app_analyses (appid, analysis, analysed, analysis_source)"
        " SELECT appid, analysis, analysed, 'trackerscan-ios' FROM apps"
    )
    before = table_digest(sql)
    again = add(client, "com.example.app", {"appId": "com.example.App", "title": "New"})
    assert again.status_code == 200
    assert again.json()["appId"] == "com.Example.App"
    assert table_digest(sql) == before


# --- the history's source, on every path that writes it ------------------------------


@PER_EXAMPLE
@given(source=sources, success=st.booleans())
def test_results_record_the_source_or_legacy(client, sql, source, success):
    sql.run("DELETE FROM apps")
    insert_app(sql, "com.example.app")
    token = client.get("/queue", headers=ANALYSER).headers["x-analysis-claim-token"]
    payload = analysis_with(source, success)
    answer = client.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        json=payload,
        headers={**ANALYSER, "X-Analysis-Claim-Token": token},
    )
    assert answer.status_code == 200, answer.text
    assert sources_of(sql, "com.example.app") == [expected_source(source)]


def test_a_failure_report_records_legacy(client, sql):
    insert_app(sql, "com.example.app")
    client.get("/queue", headers=ANALYSER)
    answer = client.post(
        "/reportAnalysisFailure?appId=com.example.app&analysisVersion=4",
        content=b"usb error",
        headers={**ANALYSER, "Content-Type": "text/plain"},
    )
    assert answer.status_code == 200
    assert sources_of(sql, "com.example.app") == ["legacy"]


@PER_EXAMPLE
@given(source=sources, success=st.booleans())
def test_the_report_functions_refetch_records_the_source_or_legacy(sql, source, success):
    sql.run("DELETE FROM apps")
    status = "analysed" if success else "failed"
    analysis = analysis_with(source, success)
    insert_app(
        sql,
        "com.example.app",
        status=status,
        version=4,
        analysed=days_ago(1),
        analysis=analysis,
        retryable=None if success else True,
    )
    done = handler.report(
        {"command": "queue-refetch", "appIds": ["com.example.app"], "apply": True},
        LambdaContext(),
    )
    assert [app["appId"] for app in done["apps"]] == ["com.example.app"]
    assert sources_of(sql, "com.example.app") == [expected_source(source)]


@pytest.mark.parametrize("source", [MISSING, "", None, 7, "trackerscan-ios"])
def test_the_cli_refetch_records_the_source_or_legacy(database_url, sql, source):
    insert_app(
        sql,
        "com.example.app",
        status="analysed",
        version=4,
        analysed=days_ago(1),
        analysis=analysis_with(source),
    )
    done = call_cli(
        "queue-refetch",
        "--appid=com.example.app",
        "--apply",
        env={**os.environ, "DATABASE_URL": database_url},
    )
    assert done.returncode == 0, done.stderr
    assert sources_of(sql, "com.example.app") == [expected_source(source)]


# --- a database adopted from another program ------------------------------------------


def old_history_sources(sql) -> dict[int, str | None]:
    return dict(sql.run("SELECT id, analysis_source FROM app_analyses"))


@pytest.mark.parametrize("state", legacy.STATES)
def test_an_adopted_database_says_legacy_and_adds_under_the_listings_casing(
    empty_database, monkeypatch, state
):
    url = empty_database
    legacy.build(url, state)
    sql = connect(url)
    # Rows other programs wrote: with no source (their own), an empty one and a named one.
    for appid, source in (("old.done", ""), ("old.failed", "trackerscan-ios")):
        sql.run(
            "INSERT INTO app_analyses (appid, analysis, analysed, analysis_source)"
            " VALUES (:appid, '{}', now() - interval '30 days', :source)",
            appid=appid,
            source=source,
        )
    before = old_history_sources(sql)
    website_cache = state in ("old011", "old012", "old013")  # the old server's 011 on
    cache = sql.run("SELECT * FROM app_store_cache ORDER BY appid_key") if website_cache else None

    migrate(url)
    # (009 merges case duplicates among the production rows, and some history with them.)
    after = old_history_sources(sql)
    assert set(after) <= set(before) and any(before[id_] is None for id_ in after)
    assert after == {id_: expected_source(before[id_]) for id_ in after}
    # A program that writes no source (the old server before its rule, this service's
    # release before the state-machine change) gets 'legacy' too.
    sql.run("UPDATE apps SET analysed = now() - interval '1 day' WHERE appid = 'old.done'")
    sql.run(legacy.OLD_RECORD_HISTORY, appid="old.done")
    sql.run("UPDATE apps SET analysed = now() - interval '2 days' WHERE appid = 'old.done'")
    sql.run(legacy.PRE_STATE_MACHINE_RECORD_HISTORY, appid="old.done")
    assert sources_of(sql, "old.done")[-2:] == ["legacy", "legacy"]

    configure_service(monkeypatch, url)
    with TestClient(handler.app, raise_server_exceptions=False) as client:
        assert client.get("/queue?appId=old.queued", headers=ANALYSER).text == "old.queued"
        uploaded = client.post(
            "/uploadAnalysis?appId=old.queued&analysisVersion=4",
            json={"success": True, "analysis_source": ""},
            headers=ANALYSER,
        )
        assert uploaded.status_code == 200
        assert sources_of(sql, "old.queued")[-1] == "legacy"

        created = add(client, "ORG.Adopted.app", {"appId": "org.adopted.App", "reviews": "1"})
        assert created.status_code == 201
        assert app_row(sql, "org.adopted.App")["status"] == "queued"
        before = table_digest(sql)
        refused = add(client, "old.queued", {"appId": "com.other.app", "reviews": "1"})
        assert refused.status_code == 400
        assert refused.json()["detail"].startswith(MISMATCH)
        assert table_digest(sql) == before
    if cache is not None:
        assert sql.run("SELECT * FROM app_store_cache ORDER BY appid_key") == cache
    sql.close()


# --- the page that says so -------------------------------------------------------------


def test_the_fidelity_page_names_what_the_code_does():
    page = (ROOT / "docs" / "adopting.md").read_text()
    assert f"{MISMATCH}: details.appId does not name" in page
    ledger_file = handler.SQL_DIR / "023_history_source_legacy.sql"
    assert ledger_file.name in page
    for name in ("app_analyses_no_source_is_legacy", "HISTORY_SOURCE", "listed_bundle_id"):
        assert name in page
        assert name in ledger_file.read_text() or hasattr(handler, name)
    assert "`legacy`" in page
    # "events/add-app.json ... adds an app by its bundle ID alone" (a listing naming none).
    event_body = json.loads(load_event("add-app.json")["body"])
    assert "appId" not in event_body["details"]
