"""Fidelity to the old server where the website relies on it: an app is added under the
App Store listing's bundle ID casing; a listing that names another app is refused."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import handler
from conftest import ADMIN, ANALYSER
from helpers import (
    days_ago,
    insert_app,
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


MISSING = object()  # no such field in the request


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
    """The one difference kept (docs/fidelity.md): the old server refuses an add without
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
