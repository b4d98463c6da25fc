"""Finding an app in the web view (docs/web-view.md, "Finding an app"): by text anywhere
in its bundle ID, in any letter case, a window of the bundle-ID order a page, each page
saying where its search stopped, the next one searching on from there, to the end; with
the state, reason and prefix filters as the list has them; bad text refused."""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest
from kit import ADMIN_TOKEN, configure_service

import handler
from helpers import call_api, gateway_event, insert_app

APPS = {
    "com.example.WhatsApp": "analysed",
    "com.zed.whatsappish": "failed",
    "net.whatsapp.WhatsApp": "queued",
    "org.other.app": "queued",
    "org.what.sapp": "queued",  # "whatsapp" only across a dot: no match
}


@pytest.fixture
def listed(monkeypatch, database_url, sql):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    for app_id, status in APPS.items():
        insert_app(sql, app_id, status=status)

    def page(**query: str) -> tuple[int, dict]:
        event = gateway_event(
            "GET",
            "/admin/api/apps",
            query=urlencode(query),
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        answer = call_api(event)
        return answer["statusCode"], json.loads(answer["body"])

    return page


def ids(page: dict) -> list[str]:
    return [app["appId"] for app in page["apps"]]


def test_text_inside_a_bundle_id_finds_it_in_any_letter_case(listed):
    status, page = listed(has="WhatsApp")
    assert status == 200
    assert ids(page) == ["com.example.WhatsApp", "com.zed.whatsappish", "net.whatsapp.WhatsApp"]
    assert (page["next"], page["searchedTo"]) == (None, None)
    _, failed = listed(has="whatsapp", state="failed")
    assert ids(failed) == ["com.zed.whatsappish"]
    _, prefixed = listed(has="whatsapp", q="net.")
    assert ids(prefixed) == ["net.whatsapp.WhatsApp"]
    _, plain = listed(q="org")  # the prefix alone pages as before, with no search's stop
    assert ids(plain) == ["org.other.app", "org.what.sapp"] and plain["searchedTo"] is None


def test_a_search_reads_a_window_a_page_and_says_where_it_stopped(listed, monkeypatch):
    monkeypatch.setattr(handler, "APPS_SEARCH_WINDOW", 2)
    pages, after = [], None
    while True:
        query = {"has": "whatsapp"} | ({} if after is None else {"after": after})
        status, page = listed(**query)
        assert status == 200, page
        pages.append((ids(page), page["searchedTo"]))
        after = page["next"]
        if after is None:
            break
    assert pages == [
        (["com.example.WhatsApp", "com.zed.whatsappish"], "com.zed.whatsappish"),
        (["net.whatsapp.WhatsApp"], "org.other.app"),
        ([], None),  # the last window held one app: the end, said by no stop
    ]


# Checked before it is lowered: the Kelvin sign lowers to k, a dotted capital I to two
# characters; neither is in a bundle ID.
REFUSED = ["what%", "a b", "_", "x" * 156, "what\\", "\u212a", "com.example.\u212a", "\u0130"]


@pytest.mark.parametrize("text", REFUSED)
def test_text_no_bundle_id_could_hold_is_refused(listed, text):
    status, answer = listed(has=text)
    assert status == 400
    assert answer["detail"] == "has must be part of a bundle ID: up to 155 letters, digits, . and -"
    status, answer = listed(q=text)
    assert (status, answer["detail"]) == (
        400,
        "q must be the start of a bundle ID: up to 155 letters, digits, . and -",
    )


@pytest.mark.no_database
def test_the_window_docs_web_view_md_gives_is_the_codes():
    page = (handler.HERE / "docs" / "web-view.md").read_text()
    assert f"reads at most {handler.APPS_SEARCH_WINDOW:,} apps" in page
    assert f"reads the next {handler.APPS_SEARCH_WINDOW:,}" in page


def test_leased_apps_are_merged_into_the_order_page_by_page(listed, sql, monkeypatch):
    """A claim writes no index of the list's order (sql/037 leaves leased rows out), so
    the list reads the leased apps apart and merges them in: every app once, in
    bundle-ID order, across pages and search windows, whatever each one's state."""
    for number, status in enumerate(["processing", "queued", "processing", "analysed"] * 3):
        insert_app(sql, f"com.merge.App{number:02}", status=status)
    merged = sorted([*APPS, *(f"com.merge.App{n:02}" for n in range(12))], key=str.lower)
    monkeypatch.setattr(handler, "APPS_PAGE_SIZE", 2)
    monkeypatch.setattr(handler, "APPS_SEARCH_WINDOW", 3)
    for query in ({}, {"has": "."}):
        listed_ids, after = [], None
        while True:
            status, page = listed(**query, **({} if after is None else {"after": after}))
            assert status == 200, page
            listed_ids += ids(page)
            after = page["next"]
            if after is None:
                break
        assert listed_ids == merged, query
    _, leased = listed(state="processing")
    assert ids(leased) == ["com.merge.App00", "com.merge.App02"]
