"""The operators' web view (ADMIN_WEB, docs/web-view.md) as an operator's browser meets it:
headless Chromium, driven by Playwright, against `python3 handler.py serve` on loopback.

Each test starts the service in a process of its own, as an operator runs it (a process
counts the overview at most once a minute, so a server shared by the tests would show one
test's figures to the next). The browser is Debian's Chromium at /usr/bin/chromium; the
tests never download one (`playwright install` is not used), and they fail, saying how to
install it, when it is missing. Nothing is waited for by the clock: Playwright waits for
what a page shows, and the service is ready when uvicorn says it listens.

With WEB_VIEW_SCREENSHOTS set to a directory (relative to the repository, e.g.
`WEB_VIEW_SCREENSHOTS=docs/web-view`), the tour also writes its screenshots there; they
always go to the test's tmp_path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from kit import ADMIN, ADMIN_TOKEN, ANALYSER, UPLOAD_PASSWORD

import handler
from helpers import app_row, connect, insert_app, minutes_ago, run_cli
from live import free_port
from queue_status import arrange_every_state

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError:  # the `chromium` fixture fails each test, saying how to install it
    Page = expect = sync_playwright = None

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
COOKIE = "analysis_queue_admin"
SCREENSHOTS = "WEB_VIEW_SCREENSHOTS"
NO_PLAYWRIGHT = "Playwright is not installed: python3 -m pip install -r tests/requirements.txt"
NO_CHROMIUM = (
    f"Chromium is missing ({CHROMIUM}): install Debian's package, as .ci/run does:"
    " apt-get install chromium (never `playwright install`: these tests use the system's"
    " browser)"
)


# --------------------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def chromium():
    """Debian's Chromium under Playwright; a test fails (never skips) without it."""
    if sync_playwright is None:
        pytest.fail(NO_PLAYWRIGHT, pytrace=False)
    if not CHROMIUM.exists():
        pytest.fail(NO_CHROMIUM, pytrace=False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            # Only loopback: any other host is resolved to nothing.
            args=["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"],
        )
        yield browser
        browser.close()


@dataclasses.dataclass
class Tab:
    """A page of a browser of its own (cookies included), and what it did unasked: the
    dialogs it opened (accepted only while `accepting`) and the errors its scripts threw."""

    page: Page
    accepting: bool = False
    dialogs: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)

    def answer(self, dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        if self.accepting:
            dialog.accept()
        else:
            dialog.dismiss()

    def session_cookies(self) -> list[dict]:
        return [c for c in self.page.context.cookies() if c["name"] == COOKIE]


@pytest.fixture
def tab(chromium) -> Iterator[Tab]:
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    opened = Tab(context.new_page())
    opened.page.on("dialog", opened.answer)
    opened.page.on("pageerror", lambda error: opened.errors.append(str(error)))
    yield opened
    context.close()


def sign_in(tab: Tab, base: str, token: str = ADMIN_TOKEN) -> None:
    page = tab.page
    page.goto(f"{base}/admin/login")
    page.get_by_label("Your token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_load_state()


def posted(url: str) -> Callable:
    """expect_response's test for the answer to a POST to url."""
    return lambda response: response.url == url and response.request.method == "POST"


def screenshot(page: Page, tmp_path: Path, name: str) -> None:
    """The page as shown, into tmp_path; also into $WEB_VIEW_SCREENSHOTS when it is set."""
    image = page.screenshot(full_page=True)
    (tmp_path / f"{name}.png").write_bytes(image)
    if os.environ.get(SCREENSHOTS):
        folder = handler.HERE / os.environ[SCREENSHOTS]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.png").write_bytes(image)


def cells(page: Page, heading: str) -> list[list[str]]:
    """The rows (header first) of the table after the `heading` h2 of the page."""
    table = page.locator(f"h2:text-is('{heading}') + table")
    return table.evaluate(
        "t => [...t.rows].map(r => [...r.cells].map(c => c.textContent))",
    )


def percent(ratio: float | None) -> str:
    """A failure ratio as the overview shows it."""
    return "no results" if ratio is None else f"{round(ratio * 1000) / 10:g} %"


AGO = r"(\d+ (s|min|h|days) ago|in \d+ (s|min|h|days))"


def exact(at: datetime) -> str:
    """A time as the page gives it on hover: UTC, to the second."""
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def column(page: Page, number: int = 0) -> list[str]:
    """One column of the page's first table, header left out."""
    rows = page.locator("main table").first.evaluate(
        "t => [...t.rows].slice(1).map(r => [...r.cells].map(c => c.textContent))"
    )
    return [row[number] for row in rows]


# --------------------------------------------------------------------------- the service


@pytest.fixture
def serve(database_url) -> Iterator[Callable[..., str]]:
    """start(mode, **env): `python3 handler.py serve` with ADMIN_WEB=mode on a free
    loopback port, configured as database_url configured this process (and `env`); its
    base URL. Each is stopped, by its pid, when the test ends."""
    started: list[subprocess.Popen] = []

    def start(mode: str | None = "full", **env: str) -> str:
        port = free_port()
        environment = {**os.environ, **env}
        environment.pop("ADMIN_WEB", None)
        if mode is not None:
            environment["ADMIN_WEB"] = mode
        process = subprocess.Popen(
            [sys.executable, "handler.py", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=handler.HERE,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(process)
        output: list[str] = []
        listening = threading.Event()

        def read() -> None:  # drained to the end, so the server never blocks on its pipe
            for line in process.stdout:
                output.append(line)
                if "Uvicorn running on" in line:
                    listening.set()
            listening.set()

        threading.Thread(target=read, daemon=True).start()
        listening.wait(timeout=60)
        assert process.poll() is None and listening.is_set(), "".join(output)
        return f"http://127.0.0.1:{port}"

    yield start
    for process in started:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Service:
    """The service's own API, as the website and the analysers call it (arranging data
    the way it arrives in production)."""

    def __init__(self, base: str):
        self.http = httpx.Client(base_url=base, timeout=30)

    def add(self, app_id: str, **details) -> None:
        answer = self.http.post("/apps", headers=ADMIN, json={"appId": app_id, "details": details})
        assert answer.status_code == 201, answer.text

    def add_analyser(self, name: str) -> str:
        answer = self.http.post("/analysers", headers=ADMIN, json={"name": name})
        assert answer.status_code == 201, answer.text
        return answer.json()["token"]

    def claim(self, app_id: str, token: str = UPLOAD_PASSWORD) -> str:
        auth = {"Authorization": f"Bearer {token}"}
        answer = self.http.get("/queue", params={"appId": app_id}, headers=auth)
        assert (answer.status_code, answer.text) == (200, app_id)
        return answer.headers["X-Analysis-Claim-Token"]

    def fail(self, app_id: str, log: str, token: str = UPLOAD_PASSWORD) -> None:
        claim = self.claim(app_id, token)
        answer = self.http.post(
            "/reportAnalysisFailure",
            params={"appId": app_id, "analysisVersion": 4},
            headers={
                "Authorization": f"Bearer {token}",
                "X-Analysis-Claim-Token": claim,
                "Content-Type": "text/plain",
            },
            content=log.encode(),
        )
        assert answer.status_code == 200, answer.text

    def analyse(self, app_id: str, analysis: dict, token: str = UPLOAD_PASSWORD) -> None:
        claim = self.claim(app_id, token)
        answer = self.http.post(
            "/uploadAnalysis",
            params={"appId": app_id, "analysisVersion": 4},
            headers={"Authorization": f"Bearer {token}", "X-Analysis-Claim-Token": claim},
            json=analysis,
        )
        assert answer.status_code == 200, answer.text

    def as_analyser(self, token: str) -> int:
        """The status GET /ping answers this token with."""
        return self.http.get("/ping", headers={"Authorization": f"Bearer {token}"}).status_code


def operator_actions(sql) -> list[tuple[str, str | None]]:
    return [
        tuple(row) for row in sql.run("SELECT action, app_id FROM operator_actions ORDER BY id")
    ]


def since_sign_in(sql) -> list[tuple[str, str | None]]:
    """The operator actions after the last sign-in (the arranging before it left out)."""
    actions = operator_actions(sql)
    last = max(number for number, (action, _) in enumerate(actions) if action == "sign-in")
    return actions[last + 1 :]


# --------------------------------------------------------------------------- another site


@contextlib.contextmanager
def another_site(html: str) -> Iterator[str]:
    """A page served by another loopback port: another origin, though the same site (a
    cookie's SameSite does not tell ports apart, so the operator's cookie goes along)."""

    class Page_(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Page_)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# --------------------------------------------------------------------------- sign-in


def test_the_browser_is_the_systems_chromium():
    """Without it this test fails saying how to install it (and every other one errors at
    its setup, saying the same): never a skip."""
    assert sync_playwright is not None, NO_PLAYWRIGHT
    assert CHROMIUM.exists(), NO_CHROMIUM


def test_sign_in_takes_the_admin_token_and_refuses_another(serve, tab, sql):
    base = serve()
    page = tab.page
    page.goto(f"{base}/admin")
    expect(page).to_have_url(f"{base}/admin/login")  # not signed in: to the sign-in page

    sign_in(tab, base, token="not-the-admin-token")
    expect(page).to_have_url(f"{base}/admin/login")
    expect(page.locator(".error")).to_have_text(
        "That is no current operator token, nor the admin token."
    )
    assert tab.session_cookies() == []

    sign_in(tab, base)
    expect(page).to_have_url(f"{base}/admin")
    expect(page.locator("h1")).to_have_text("Overview")
    (first,) = tab.session_cookies()
    # The token is in no URL, and nowhere in the page the browser holds.
    assert ADMIN_TOKEN not in page.url and ADMIN_TOKEN not in page.content()

    # Each sign-in makes a new session, whatever cookie the browser brought (one planted
    # before is never adopted).
    sign_in(tab, base)
    expect(page.locator("h1")).to_have_text("Overview")
    (second,) = tab.session_cookies()
    assert second["value"] != first["value"]
    assert [action for action, _ in operator_actions(sql)] == [
        "sign-in refused",
        "sign-in",
        "sign-in",
    ]

    # Signing out ends the session on the server, and the sign-in page says so; its
    # cookie, brought back, opens nothing.
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(f"{base}/admin/login?signed-out")
    expect(page.locator("#signed-out")).to_have_text("You are signed out.")
    assert tab.session_cookies() == []
    page.context.add_cookies([{**second, "expires": -1}])
    page.goto(f"{base}/admin")
    expect(page).to_have_url(f"{base}/admin/login")
    assert tab.errors == []


def test_a_sign_out_the_server_could_not_make_says_so_and_keeps_the_session(
    serve, tab, sql, database_url
):
    """The page is signed out when the server says so: a sign-out answered 503 (its
    session's row locked past the lock timeout) leaves the page where it was, saying why,
    and the session still opens the web view."""
    base = serve(LOCK_TIMEOUT_MS="100")
    page = tab.page
    sign_in(tab, base)
    expect(page.locator("h1")).to_have_text("Overview")
    holder = connect(database_url)
    try:
        holder.run("BEGIN")
        holder.run("LOCK TABLE admin_sessions IN EXCLUSIVE MODE")  # reads go on; no UPDATE
        page.get_by_role("button", name="Sign out").click()
        expect(page.locator(".error")).to_contain_text("try again")
    finally:
        holder.run("ROLLBACK")
        holder.close()
    expect(page).to_have_url(f"{base}/admin")
    assert "sign-out" not in [action for action, _ in operator_actions(sql)]
    page.reload()
    expect(page.locator("h1")).to_have_text("Overview")  # the session is alive
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(f"{base}/admin/login?signed-out")
    assert tab.errors == []


def test_every_page_has_an_icon_and_no_browser_asks_for_favicon_ico(serve, tab):
    base = serve()
    page = tab.page
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    page.goto(f"{base}/admin/login")
    sign_in(tab, base)
    expect(page.locator("h1")).to_have_text("Overview")
    for path in ("/admin/login", "/admin"):
        page.goto(f"{base}{path}")
        icon = page.locator("link[rel=icon]")
        expect(icon).to_have_attribute("href", "/admin/static/favicon.svg")
    answer = page.request.get(f"{base}/admin/static/favicon.svg")
    assert answer.status == 200 and answer.headers["content-type"] == "image/svg+xml"
    assert not [url for url in asked if url.endswith("/favicon.ico")]
    assert tab.errors == []


def seed_history(sql, app_ids: list[str] | None = None) -> None:
    """A week of results by two analysers and the shared password, a lease the back-off
    ended, and three hourly snapshots, as the service would have stored them: on apps of
    their own, or on `app_ids` (none added)."""
    hour = sql.run("SELECT date_trunc('hour', now())")[0][0]
    for number, (hours_ago, success, analyser, source) in enumerate(
        (
            (0, True, "pi-kitchen", None),
            (1, True, "pi-kitchen", None),
            (30, True, "pi-kitchen", None),
            (100, True, "pi-kitchen", None),
            (2, False, "pi-attic", None),
            (50, False, "pi-attic", None),
            (3, True, None, None),  # the shared password's
            (4, False, None, handler.SERVER_FAILURE_SOURCE),  # a lease that expired
            (200, True, "pi-kitchen", None),  # before the week: not drawn
        )
    ):
        if app_ids is None:
            app_id = f"com.example.history{number}"
            insert_app(sql, app_id, status="analysed" if success else "failed")
        else:
            app_id = app_ids[number % len(app_ids)]
        sql.run(
            "INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, success,"
            " analyser, analysis_source) VALUES (:appid, '{}', 4,"
            " CAST(:hour AS timestamptz) - make_interval(hours => :ago) + interval '10 minutes',"
            " :success, :analyser, :source)",
            appid=app_id,
            hour=hour,
            ago=hours_ago,
            success=success,
            analyser=analyser,
            source=source,
        )
    for hours_ago, queued, stale in ((0, 7, 2), (12, 20, 2), (60, 40, 5)):
        sql.run(
            "INSERT INTO queue_snapshots (hour, states, backlog, failed) VALUES"
            " (CAST(:hour AS timestamptz) - make_interval(hours => :ago), CAST(:states AS jsonb),"
            " CAST(:backlog AS jsonb), '{}') ON CONFLICT DO NOTHING",  # serve's, kept
            hour=hour,
            ago=hours_ago,
            states=json.dumps({"queued": queued, "processing": 1, "analysed": 5, "failed": 2}),
            backlog=json.dumps({"queued": queued, "stale": stale}),
        )


def test_the_charts_are_drawn_from_a_seeded_history(serve, tab, sql):
    seed_history(sql)
    base = serve()
    page = tab.page
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    sign_in(tab, base)
    charts = page.locator("#history .uplot")
    expect(charts).to_have_count(4)
    assert page.locator("#history .uplot canvas").count() == 4
    titles = page.locator("#history .u-title").all_inner_texts()
    assert titles == [
        "Results and failures per hour",
        "The backlog and the apps by state",
        "Each analyser's results per hour",
        "Each analyser's failures per hour",
    ]
    legend = page.locator("#chart-analyser-results .u-legend .u-label").all_inner_texts()
    assert legend[1:] == ["pi-attic", "pi-kitchen", "shared password"]
    expect(page.locator("#results-sum")).to_have_text(
        "In the last 7 days, results: 5, failures: 2, leases expired: 1"
        " (from the history of results)."
    )
    expect(page.locator("#backlog-sum")).to_have_text(
        re.compile(
            r"Counted by the hourly report in 3 of 168 hours; last \d+ s ago, the backlog: 9,"
            r" queued: 7\."
        )
    )
    sums = page.locator("#analyser-sums table").evaluate(
        "t => [...t.rows].map(r => [...r.cells].map(c => c.textContent))"
    )
    assert sums == [
        ["analyser", "results in the last 7 days", "failures in the last 7 days"],
        ["pi-attic", "0", "2"],
        ["pi-kitchen", "4", "0"],
        ["shared password", "1", "0"],
    ]

    page.get_by_role("link", name="Show the last 24 hours").click()
    expect(page.locator("#results-sum")).to_have_text(
        "In the last 24 hours, results: 3, failures: 1, leases expired: 1"
        " (from the history of results)."
    )
    assert page.url == f"{base}/admin?window=24h"
    expect(page.locator("#backlog-sum")).to_contain_text("in 2 of 24 hours")
    # Nothing from another origin: the library is the service's own.
    assert asked and all(url.startswith(base + "/") for url in asked), asked
    assert f"{base}/admin/static/vendor/uPlot.iife.min.js" in asked
    assert tab.errors == []


def test_an_empty_table_says_none_and_legacy_is_said_in_words(serve, tab, sql):
    """A table with no rows says "none" under its header (an app nobody acted on); a
    result that named no source shows as such, not as the bare word `legacy`."""
    insert_app(sql, "com.example.quiet")
    sql.run(
        "INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, analysis_source,"
        " success) VALUES ('com.example.quiet', '{}', 4, now(), 'legacy', true)"
    )
    base = serve()
    sign_in(tab, base)
    tab.page.goto(f"{base}/admin/apps/com.example.quiet")
    expect(tab.page.locator("h1")).to_have_text("com.example.quiet")
    assert cells(tab.page, "Operator actions") == [
        ["when", "who", "from", "what", "outcome"],
        ["none"],
    ]
    history = cells(tab.page, "History, newest first")
    assert history[0][2] == "source" and history[1][2] == "not named by the analyser"
    assert tab.errors == []


def test_ten_refused_sign_ins_close_the_door_to_that_address(serve, tab):
    base = serve()
    page = tab.page
    for _ in range(handler.SIGN_IN_REFUSALS_ALLOWED):
        with page.expect_response(posted(f"{base}/admin/login")) as answer:
            sign_in(tab, base, token="a-guess")
        assert answer.value.status == 401
    # The eleventh is refused before the token is looked at: the right one too.
    with page.expect_response(posted(f"{base}/admin/login")) as answer:
        sign_in(tab, base)
    assert answer.value.status == 429
    assert answer.value.headers["retry-after"] == "900"
    expect(page.locator("main .error")).to_have_text(handler.SIGN_IN_LIMITED)
    assert tab.session_cookies() == []
    # The address is the connection's: a forwarded-for header, which any client may
    # write, neither picks another one's limit nor escapes its own.
    for forwarded in ("198.51.100.1", "203.0.113.50, 10.0.0.1"):
        spoofed = httpx.post(
            f"{base}/admin/login",
            data={"token": ADMIN_TOKEN},
            headers={"Sec-Fetch-Site": "same-origin", "X-Forwarded-For": forwarded},
        )
        assert spoofed.status_code == 429, forwarded


def test_the_session_cookie_is_httponly_strict_and_out_of_scripts_reach(serve, tab):
    base = serve()
    sign_in(tab, base)
    expect(tab.page.locator("h1")).to_have_text("Overview")
    (cookie,) = tab.session_cookies()
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/admin")
    hours = (cookie["expires"] - datetime.now(UTC).timestamp()) / 3600
    assert handler.ADMIN_SESSION_HOURS - 0.1 < hours <= handler.ADMIN_SESSION_HOURS
    assert COOKIE not in tab.page.evaluate("document.cookie")


def test_a_new_admin_token_ends_every_session(serve, tab):
    """The first sign-in puts the admin token in the database with a random key its
    cookies are signed with: another service on the same database knows the session,
    even one given another ADMIN_TOKEN (the database decides now); a rotation replaces
    the key, so no session of before is known, and only the new token signs in (the old
    one, in its overlap, is a bearer token still, but starts no session). (A cookie is
    the host's, whatever the port: each service here gets the same one.)"""
    signed_in = serve()
    sign_in(tab, signed_in)
    expect(tab.page.locator("h1")).to_have_text("Overview")

    other_environment = serve(ADMIN_TOKEN="the-next-admin-token")
    tab.page.goto(f"{other_environment}/admin")
    expect(tab.page.locator("h1")).to_have_text("Overview")

    rotated = run_cli(
        "credentials", "rotate", "admin-token", "--overlap", "1h", env=dict(os.environ)
    )
    assert rotated.returncode == 0, rotated.stderr
    tab.page.goto(f"{signed_in}/admin")
    expect(tab.page).to_have_url(f"{signed_in}/admin/login")
    sign_in(tab, signed_in)  # the old token, in its overlap
    expect(tab.page).to_have_url(f"{signed_in}/admin/login")
    sign_in(tab, signed_in, rotated.stdout.splitlines()[-1])
    expect(tab.page.locator("h1")).to_have_text("Overview")


def test_an_operator_signs_in_by_name_acts_by_name_and_is_refused_once_revoked(serve, tab, sql):
    """A named operator's own token signs them in; the bar names them, their action is
    recorded under their name, and a revocation ends their session at once."""
    # The web sessions' key is kept beside the admin token: in the database first, as a
    # deployed stack has it (deploy.md's step 4).
    imported = run_cli(
        "credentials", "import", "admin-token", "--from-environment", env=dict(os.environ)
    )
    assert imported.returncode == 0, imported.stderr
    added = run_cli("operators", "add", "alice", env=dict(os.environ))
    assert added.returncode == 0, added.stderr
    token = added.stdout.splitlines()[-1]
    base = serve()
    page = tab.page
    sign_in(tab, base, token)
    expect(page.locator("h1")).to_have_text("Overview")
    expect(page.locator("#who")).to_have_text("alice")

    tab.accepting = True
    page.get_by_role("button", name="Pause the queue").click()
    expect(page.locator("#outcome")).to_have_text("The queue is paused.")
    actors = sql.run("SELECT actor, action FROM operator_actions ORDER BY id")
    assert actors[-2:] == [["alice", "sign-in"], ["alice", "pause queue"]]
    # The overview says who did what, newest first.
    expect(page.locator("h2:text-is('Recent operator actions') + table")).to_contain_text(
        "pause queue"
    )
    recent = cells(page, "Recent operator actions")
    assert recent[0] == ["when", "who", "from", "what", "app", "analyser", "outcome"]
    assert [row[1:4] for row in recent[1:3]] == [
        ["alice", "127.0.0.1", "pause queue"],
        ["alice", "127.0.0.1", "sign-in"],
    ]
    # Every action, paged: 50 a page, newest first, Older actions going back.
    sql.run(
        "INSERT INTO operator_actions (actor, source, action, outcome)"
        " SELECT 'bob', '127.0.0.1', 'sign-in', NULL FROM generate_series(1, 60)"
    )
    page.get_by_role("link", name="Every action, paged").click()
    expect(page.locator("h1")).to_have_text("Operator actions")
    expect(page.locator("main table tr")).to_have_count(51)
    page.get_by_role("link", name="Older actions").click()
    expect(page).to_have_url(re.compile(r"/admin/actions\?before=\d+$"))
    older = page.locator("main table tr td:nth-child(4)").all_inner_texts()
    # The 14 left: bob's 10 oldest, then alice's two and the two set-up commands'.
    assert len(older) == 14 and older[10:12] == ["pause queue", "sign-in"], older
    expect(page.get_by_role("link", name="Older actions")).to_have_count(0)

    revoked = run_cli("operators", "revoke", "alice", env=dict(os.environ))
    assert revoked.returncode == 0, revoked.stderr
    page.goto(f"{base}/admin")
    expect(page).to_have_url(f"{base}/admin/login")
    sign_in(tab, base, token)
    expect(page.locator(".error")).to_have_text(
        "That is no current operator token, nor the admin token."
    )
    assert tab.errors == []


# --------------------------------------------------------------------------- the pages


def test_the_overview_shows_what_queue_status_counts(serve, tab, sql):
    arrange_every_state(sql)
    base = serve()
    sign_in(tab, base)
    page = tab.page
    expect(page.locator("#counted")).to_contain_text("Counted")
    shown = {
        heading: cells(page, heading)
        for heading in ("Apps by state", "Failures by reason", "Backlog", "Held back")
    }
    shown["Policy in force"] = cells(page, "Policy in force")

    listed = run_cli("queue-status", "--json", env=dict(os.environ))
    assert listed.returncode == 0, listed.stderr
    status = json.loads(listed.stdout)
    assert shown["Apps by state"][0] == ["state", "apps"]
    assert dict(shown["Apps by state"][1:]) == {k: str(v) for k, v in status["counts"].items()}
    assert shown["Failures by reason"] == [
        ["reason", "apps"],
        *([row["reason"], str(row["apps"])] for row in status["failed_by_reason"]),
    ]
    assert shown["Backlog"] == [
        ["backlog", "ETA (hours)", "analysers in the last hour"],
        [
            str(status["backlog_total"]),
            str(status["eta_hours"]),
            str(status["analysers_last_hour"]),
        ],
    ]
    # Headers in words, each with its JSON key on hover; no field of "Retries and holds"
    # shown twice.
    held = status["held_back"]
    in_retries_and_holds = {
        "retries_next_hour",
        "retries_waiting",
        "retries_exhausted",
        "held_apps",
    }
    for heading, part, elsewhere in (
        ("Held back", held, in_retries_and_holds),
        ("Policy in force", status["policy"], set()),
    ):
        keys = page.locator(f"h2:text-is('{heading}') + table th span").evaluate_all(
            "spans => spans.map(s => s.title)"
        )
        assert dict(zip(keys, shown[heading][1], strict=True)) == {
            key: str(value) for key, value in part.items() if key not in elsewhere
        }
        assert all(" " in word or word.isalpha() for word in shown[heading][0])
    assert shown["Held back"][0][:2] == [
        "failed: leases ended without a result",
        "last leases abandoned",
    ]
    assert cells(page, "Retries and holds") == [
        [
            "retries due",
            "retries due in the next hour",
            "retries waiting",
            "retries exhausted",
            "apps held",
        ],
        [
            str(status["backlog"]["retry_due"]),
            str(held["retries_next_hour"]),
            str(held["retries_waiting"]),
            str(held["retries_exhausted"]),
            str(held["held_apps"]),
        ],
    ]
    assert cells(page, "Analysers") == [
        ["look broken", "paused", "failures in the last hour (the fleet)"],
        [
            str(status["broken_analysers"]),
            str(status["paused_analysers"]),
            percent(status["failure_ratio_1h"]),
        ],
    ]
    assert status["paused"]["paused"] is False
    expect(page.locator("#queue-paused")).to_have_count(0)
    expect(page.locator("#broken-analysers")).to_have_count(0)
    # The figures are this queue's (tests/queue_status.py arranges one in every state).
    assert status["counts"] == {"queued": 5, "processing": 2, "analysed": 3, "failed": 7}
    assert status["held_back"]["held_apps"] == 1  # app.queued.held

    # A state and a failure reason each lead to their apps.
    page.get_by_role("link", name="app_not_found").click()
    expect(page).to_have_url(f"{base}/admin/apps?state=failed&reason=app_not_found")
    expect(page.locator("main table").first.locator("td >> nth=0")).to_have_text("app.failed.final")
    assert tab.errors == []


def test_the_apps_list_filters_by_its_address_and_back_keeps_the_filters(serve, tab, sql):
    for app_id in ("com.example.gone", "com.example.gone2", "org.example.gone"):
        insert_app(sql, app_id, status="failed", retryable=False, reason="app_not_found", version=4)
    insert_app(sql, "com.example.big", status="failed", retryable=False, reason="ipa_too_large")
    insert_app(sql, "com.example.queued")
    base = serve()
    sign_in(tab, base)
    page = tab.page
    page.goto(f"{base}/admin/apps")
    expect(page.locator("main table").first.locator("tr")).to_have_count(6)

    page.get_by_label("State").select_option("failed")
    reasons = page.get_by_label("Failure reason").locator("option").all_text_contents()
    assert reasons == ["any reason", *sorted(handler.FAILURE_REASONS)]  # a list, no free text
    page.get_by_label("Failure reason").select_option("app_not_found")
    page.get_by_label("Bundle ID starts with").fill("COM.example")
    page.get_by_role("button", name="Filter").click()
    filtered = f"{base}/admin/apps?state=failed&reason=app_not_found&q=COM.example"
    expect(page).to_have_url(filtered)
    expect(page.get_by_role("link", name="com.example.gone2")).to_be_visible()
    assert column(page) == ["com.example.gone", "com.example.gone2"]

    page.get_by_role("link", name="com.example.gone2").click()
    expect(page.locator("h1")).to_have_text("com.example.gone2")
    page.go_back()
    expect(page).to_have_url(filtered)
    expect(page.get_by_role("link", name="com.example.gone2")).to_be_visible()
    assert column(page) == ["com.example.gone", "com.example.gone2"]
    expect(page.get_by_label("State")).to_have_value("failed")
    expect(page.get_by_label("Failure reason")).to_have_value("app_not_found")
    expect(page.get_by_label("Bundle ID starts with")).to_have_value("COM.example")

    # Text anywhere in the bundle ID, any letter case; no bulk refetch on such a search.
    page.get_by_label("Bundle ID starts with").fill("")
    page.get_by_label("Bundle ID contains").fill("Gone2")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(f"{base}/admin/apps?state=failed&reason=app_not_found&has=Gone2")
    expect(page.get_by_role("link", name="com.example.gone2")).to_be_visible()
    assert column(page) == ["com.example.gone2"]
    expect(page.get_by_role("button", name=re.compile("Refetch all matching"))).to_have_count(0)
    expect(page.locator("#searched")).to_have_count(0)  # it searched every app

    # Nothing starts with it: the page offers the search anywhere in the bundle ID.
    page.goto(f"{base}/admin/apps?q=gone2")
    expect(page.locator("#try-contains")).to_contain_text("No bundle ID starts with that")
    page.get_by_role("link", name="search for it anywhere in the bundle ID").click()
    expect(page.get_by_role("link", name="com.example.gone2")).to_be_visible()
    expect(page.get_by_label("Bundle ID contains")).to_have_value("gone2")
    assert tab.errors == []


def test_the_apps_list_pages_in_bundle_id_order(serve, tab, sql):
    names = [f"app.page.{number:03}" for number in range(handler.APPS_PAGE_SIZE + 2)]
    for name in reversed(names):
        insert_app(sql, name)
    base = serve()
    sign_in(tab, base)
    page = tab.page
    page.goto(f"{base}/admin/apps?q=app.page")
    expect(page.locator("#next")).to_be_visible()
    assert column(page) == names[: handler.APPS_PAGE_SIZE]
    page.locator("#next").click()
    expect(page.get_by_role("link", name=names[-1])).to_be_visible()
    assert column(page) == names[handler.APPS_PAGE_SIZE :]
    expect(page.locator("#next")).to_have_count(0)
    expect(page.locator("main")).not_to_contain_text("null")


def test_an_apps_page_says_why_it_is_or_is_not_handed_out(serve, tab, sql):
    base = serve()
    service = Service(base)
    pi = service.add_analyser("pi-kitchen")
    for app_id in ("com.example.waiting", "com.example.leased", "com.example.gone"):
        service.add(app_id, title=app_id)
    service.claim("com.example.leased", pi)
    service.fail("com.example.gone", "ERROR: app not found in the store")
    insert_app(sql, "com.example.fresh", status="analysed", version=4, analysed=minutes_ago(60))
    sign_in(tab, base)
    page = tab.page
    for app_id, verdict, why in (
        ("com.example.waiting", "Handed out now.", "Queued: it is handed out in claim order."),
        ("com.example.leased", "Not handed out now.", "Leased to pi-kitchen; handed out again"),
        ("com.example.gone", "Not handed out now.", "A failure that retrying cannot mend"),
        ("com.example.fresh", "Not handed out now.", "A fresh analysis: handed out again once"),
    ):
        page.goto(f"{base}/admin/apps/{app_id}")
        expect(page.locator("#why strong")).to_have_text(verdict.replace(".", ". "))
        expect(page.locator("#why")).to_contain_text(why)
    # A lease and a fresh analysis say when they end.
    page.goto(f"{base}/admin/apps/com.example.leased")
    expect(page.locator("#why")).to_contain_text(re.compile(rf"\. Handed out from {AGO}\."))
    assert tab.errors == []


def test_refetch_asks_once_then_queues_the_app_and_records_it(serve, tab, sql):
    base = serve()
    Service(base).add("com.example.gone", title="Gone")
    Service(base).fail("com.example.gone", "ERROR: app not found in the store")
    sign_in(tab, base)
    page = tab.page
    page.goto(f"{base}/admin/apps/com.example.gone")
    expect(page.locator("#why")).to_contain_text("A failure that retrying cannot mend")
    tab.accepting = True
    page.get_by_role("button", name="Refetch", exact=True).click()
    # The page is drawn again with the app's new state, and says what was done.
    expect(page.locator("#why")).to_contain_text("Handed out now. Queued")
    expect(page.locator("#outcome")).to_have_text(
        "1 selected: 1 queued now, 0 waiting for a lease to end, 0 with the lease broken,"
        " 0 left as they were."
    )
    assert tab.dialogs == ["confirm: Refetch com.example.gone?"]
    assert page.locator("main table").first.locator("td").first.text_content() == "queued"
    actions = cells(page, "Operator actions")
    # Newest first: the refetch by this session, then the app's adding by the admin token.
    assert [row[3:] for row in actions[1:]] == [["refetch", "queued"], ["add app", "queued"]]
    assert actions[1][1].startswith("admin token, session ") and actions[1][2] == "127.0.0.1"
    assert actions[2][1] == "admin token"
    assert app_row(sql, "com.example.gone")["status"] == "queued"
    assert tab.errors == []


def test_an_analyser_is_added_rotated_and_revoked_its_token_shown_once(serve, tab, sql):
    base = serve()
    service = Service(base)
    sign_in(tab, base)
    page = tab.page
    tab.accepting = True
    page.goto(f"{base}/admin/analysers")

    page.get_by_label("Name").fill("pi kitchen")  # not a name: the form says so, sends nothing
    page.get_by_role("button", name="Add analyser").click()
    assert page.get_by_label("Name").evaluate("input => input.validity.patternMismatch")
    assert tab.dialogs == []

    page.get_by_label("Name").fill("pi-kitchen")
    page.get_by_role("button", name="Add analyser").click()
    expect(page.locator("#new-token")).to_have_text(re.compile(r"^aqa_\S+$"))
    added = page.locator("#new-token").text_content()
    assert service.as_analyser(added) == 200
    expect(page.get_by_role("cell", name="pi-kitchen", exact=True)).to_be_visible()

    page.reload()
    expect(page.get_by_role("cell", name="pi-kitchen", exact=True)).to_be_visible()
    expect(page.locator("#new-token")).to_have_count(0)
    assert added not in page.content()

    page.get_by_role("button", name="Rotate").click()
    expect(page.locator("#new-token")).not_to_have_text(added)
    expect(page.locator("#new-token")).to_have_text(re.compile(r"^aqa_\S+$"))
    rotated = page.locator("#new-token").text_content()
    assert (service.as_analyser(rotated), service.as_analyser(added)) == (200, 200)  # overlap

    page.get_by_role("button", name="Revoke").click()
    expect(page.get_by_role("button", name="Revoke")).to_have_count(0)
    expect(page.get_by_role("button", name="Rotate")).to_have_count(0)
    revoked_at = page.locator("main table tr").nth(1).locator("td").nth(6)
    # A time shows how long ago, the exact UTC time on hover.
    expect(revoked_at).to_have_text(re.compile(r"^\d+ s ago$"))
    expect(revoked_at.locator("time")).to_have_attribute(
        "title", re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")
    )
    assert (service.as_analyser(rotated), service.as_analyser(added)) == (401, 401)

    assert tab.dialogs == [
        "confirm: Add the analyser pi-kitchen?",
        "confirm: Rotate the token of pi-kitchen? The old one keeps working for 24h.",
        "confirm: Revoke pi-kitchen? Its tokens stop working at once.",
    ]
    assert [row for row in operator_actions(sql) if row[0] != "sign-in"] == [
        ("add analyser", None),
        ("rotate analyser", None),
        ("revoke analyser", None),
    ]
    assert tab.errors == []


# --------------------------------------------------------------------------- holds and pauses


def queue_pause(sql) -> list:
    return sql.run("SELECT paused_at, paused_by, reason FROM queue_pause")


def claimed(service: Service, app_id: str, token: str = UPLOAD_PASSWORD) -> str:
    """What GET /queue?appId= answers this token: the app, or "" (an empty queue)."""
    answer = service.http.get(
        "/queue", params={"appId": app_id}, headers={"Authorization": f"Bearer {token}"}
    )
    assert answer.status_code == 200, answer.text
    return answer.text


def test_the_queue_is_paused_and_resumed_from_the_overview(serve, tab, sql):
    base = serve()
    service = Service(base)
    service.add("com.example.waiting", title="Waiting")
    sign_in(tab, base)
    page = tab.page
    expect(page.locator("#counted")).to_be_visible()
    expect(page.locator("#queue-paused")).to_have_count(0)
    tab.accepting = True
    reason = "the store's API is down: <b>again</b>"
    page.get_by_label("Reason (optional)").fill(reason)
    page.get_by_role("button", name="Pause the queue").click()

    banner = page.locator("#queue-paused")
    expect(page.locator("#outcome")).to_have_text("The queue is paused.")
    ((paused_at, paused_by, stored_reason),) = queue_pause(sql)
    assert re.fullmatch(r"admin token, session \S+ \(127\.0\.0\.1\)", paused_by), paused_by
    assert stored_reason == reason
    expect(banner).to_have_text(
        re.compile(
            re.escape("The queue is paused: no app is handed out until it is resumed. Since ")
            + AGO
            + re.escape(f", by {paused_by}. Reason: {reason} Resume the queue")
        )
    )
    expect(banner.locator("time")).to_have_attribute("title", exact(paused_at))
    assert page.locator("main b").count() == 0  # the reason is text
    expect(page.get_by_role("button", name="Pause the queue")).to_have_count(0)
    assert claimed(service, "com.example.waiting") == ""  # every claim: an empty queue

    # The overview drawn again (as its refresh does) from figures counted before the
    # pause still shows the pause its answer told.
    page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
    expect(page.locator("#outcome")).to_be_empty()
    expect(banner).to_contain_text(f"by {paused_by}. Reason: {reason}")

    page.get_by_role("button", name="Resume the queue").click()
    expect(page.locator("#outcome")).to_have_text("The queue is resumed.")
    expect(banner).to_have_count(0)
    expect(page.get_by_role("button", name="Pause the queue")).to_be_visible()
    assert queue_pause(sql) == [[None, None, None]]
    assert claimed(service, "com.example.waiting") == "com.example.waiting"

    assert tab.dialogs == [
        "confirm: Pause the whole queue? No analyser is handed an app until it is resumed."
        f" Reason: {reason}",
        "confirm: Resume the queue? Analysers are handed apps again at once.",
    ]
    assert since_sign_in(sql) == [("pause queue", None), ("resume queue", None)]
    assert tab.errors == []


def test_a_queue_paused_elsewhere_is_shown_with_who_when_and_why(serve, tab, sql):
    """Paused and an app held through the admin API before the overview counted: the
    figures say so, on every page, in read-only too (which shows no button)."""
    base = serve("read-only")
    service = Service(base)
    service.add("com.example.waiting", title="Waiting")
    service.add("com.example.held", title="Held")
    paused = service.http.post("/queue/pause", headers=ADMIN, json={"reason": "moving the Macs"})
    held = service.http.post("/apps/com.example.held/hold", headers=ADMIN, json={})
    assert (paused.status_code, held.status_code) == (200, 200)
    ((paused_at, paused_by, _),) = queue_pause(sql)
    assert paused_by == "admin token (127.0.0.1)"
    sign_in(tab, base)
    page = tab.page
    expect(page.locator("#queue-paused")).to_have_text(
        re.compile(
            re.escape("The queue is paused: no app is handed out until it is resumed. Since ")
            + AGO
            + re.escape(", by admin token (127.0.0.1). Reason: moving the Macs")
        )
    )
    expect(page.locator("#queue-paused time")).to_have_attribute("title", exact(paused_at))
    assert cells(page, "Retries and holds")[1][4] == "1"  # apps held
    expect(page.locator("main button, main form")).to_have_count(0)

    page.goto(f"{base}/admin/apps/com.example.waiting")
    expect(page.locator("#why")).to_contain_text(
        "Handed out now. Queued: it is handed out in claim order; but the whole queue is paused"
    )
    expect(page.locator("#queue-paused")).to_have_text(
        re.compile(re.escape("The whole queue is paused (since ") + AGO + r"\): see the overview\.")
    )
    expect(page.locator("#queue-paused time")).to_have_attribute("title", exact(paused_at))
    page.goto(f"{base}/admin/apps/com.example.held")
    expect(page.locator("#hold")).to_contain_text(
        re.compile(
            re.escape("Held by admin token (127.0.0.1), ")
            + AGO
            + re.escape(": never handed out until released.")
        )
    )
    expect(page.locator("#hold")).to_contain_text("No reason given.")
    expect(page.locator("main button, main form")).to_have_count(0)
    assert tab.dialogs == [] and tab.errors == []


def test_an_analyser_is_paused_and_resumed_from_its_row(serve, tab, sql):
    base = serve()
    service = Service(base)
    kitchen = service.add_analyser("pi-kitchen")
    attic = service.add_analyser("pi-attic")
    service.add("com.example.waiting", title="Waiting")
    sign_in(tab, base)
    page = tab.page
    tab.accepting = True
    page.goto(f"{base}/admin/analysers")
    row = page.locator("main tr[data-analyser='pi-kitchen']")
    paused_cell = row.locator("td").nth(10)
    expect(paused_cell).to_have_text("no")
    expect(row.get_by_role("button", name="Resume")).to_have_count(0)

    row.get_by_role("button", name="Pause").click()
    expect(page.locator("#outcome")).to_have_text("pi-kitchen is paused.")
    ((paused_at, paused_by),) = sql.run(
        "SELECT paused_at, paused_by FROM analysers WHERE name = 'pi-kitchen'"
    )
    assert re.fullmatch(r"admin token, session \S+ \(127\.0\.0\.1\)", paused_by), paused_by
    expect(paused_cell).to_have_text(re.compile(re.escape(f"paused by {paused_by}, ") + AGO))
    expect(paused_cell.locator("time")).to_have_attribute("title", exact(paused_at))
    expect(row).to_have_class("paused")
    expect(row.get_by_role("button", name="Pause")).to_have_count(0)
    expect(page.locator("main tr[data-analyser='pi-attic'] td").nth(10)).to_have_text("no")
    # Its claims are answered as an empty queue; another analyser's are not.
    assert claimed(service, "com.example.waiting", kitchen) == ""
    assert sql.run("SELECT paused_at IS NULL FROM analysers WHERE name = 'pi-attic'") == [[True]]

    row.get_by_role("button", name="Resume").click()
    expect(page.locator("#outcome")).to_have_text("pi-kitchen is resumed.")
    expect(paused_cell).to_have_text("no")
    expect(row).not_to_have_class("paused")
    assert sql.run("SELECT paused_at, paused_by FROM analysers WHERE name = 'pi-kitchen'") == [
        [None, None]
    ]
    assert claimed(service, "com.example.waiting", kitchen) == "com.example.waiting"
    assert claimed(service, "com.example.waiting", attic) == ""  # leased to pi-kitchen now

    assert tab.dialogs == [
        "confirm: Pause pi-kitchen? It is handed no app until it is resumed; a lease it holds"
        " stays its own.",
        "confirm: Resume pi-kitchen? It is handed apps again, and its failures in a row are"
        " counted from none (refetch what it failed first, if that is to be done).",
    ]
    assert sql.run(
        "SELECT action, analyser FROM operator_actions WHERE action LIKE '%analyser' ORDER BY id"
    ) == [
        ["add analyser", "pi-kitchen"],
        ["add analyser", "pi-attic"],
        ["pause analyser", "pi-kitchen"],
        ["resume analyser", "pi-kitchen"],
    ]
    assert tab.errors == []


def test_an_app_is_held_with_a_reason_and_released(serve, tab, sql):
    base = serve()
    service = Service(base)
    pi = service.add_analyser("pi-kitchen")
    service.add("com.example.held", title="Held")
    service.add("com.example.leased", title="Leased")
    service.claim("com.example.leased", pi)
    sign_in(tab, base)
    page = tab.page
    tab.accepting = True
    page.goto(f"{base}/admin/apps/com.example.held")
    expect(page.locator("#why")).to_contain_text("Handed out now. Queued")
    expect(page.locator("#hold")).to_have_count(0)
    expect(page.get_by_role("button", name="Release")).to_have_count(0)

    reason = "the developer asked us to wait <script>window.__pwned=1</script>"
    page.get_by_label("Reason (optional)").fill(reason)
    page.get_by_role("button", name="Hold", exact=True).click()
    expect(page.locator("#outcome")).to_have_text("com.example.held is held.")
    ((held_at, held_by, hold_reason),) = sql.run(
        "SELECT held_at, held_by, hold_reason FROM apps WHERE appid = 'com.example.held'"
    )
    assert re.fullmatch(r"admin token, session \S+ \(127\.0\.0\.1\)", held_by), held_by
    assert hold_reason == reason
    expect(page.locator("#hold")).to_have_text(
        re.compile(
            re.escape(f"Held by {held_by}, ")
            + AGO
            + re.escape(f": never handed out until released. Reason: {reason}")
        )
    )
    expect(page.locator("#hold time")).to_have_attribute("title", exact(held_at))
    expect(page.locator("#why")).to_contain_text(f"Not handed out now. Held by {held_by}")
    assert app_row(sql, "com.example.held")["status"] == "queued"  # its state stays
    assert claimed(service, "com.example.held") == ""
    assert cells(page, "Operator actions")[1][3:] == ["hold app", "held"]
    expect(page.get_by_role("button", name="Hold", exact=True)).to_have_count(0)

    page.get_by_role("button", name="Release").click()
    expect(page.locator("#outcome")).to_have_text("com.example.held is released.")
    expect(page.locator("#hold")).to_have_count(0)
    expect(page.locator("#why")).to_contain_text("Handed out now. Queued")
    assert sql.run(
        "SELECT held_at, held_by, hold_reason FROM apps WHERE appid = 'com.example.held'"
    ) == [[None, None, None]]
    assert cells(page, "Operator actions")[1][3:] == ["release app", "released"]

    # A live lease: held with force, the lease is broken and the app is back to its
    # stored result (none: queued), held.
    page.goto(f"{base}/admin/apps/com.example.leased")
    expect(page.locator("#why")).to_contain_text("Leased to pi-kitchen")
    page.get_by_label("break a live lease (force)").check()
    page.get_by_role("button", name="Hold", exact=True).click()
    expect(page.locator("#outcome")).to_have_text(
        "com.example.leased is held; its lease was broken (force): back to its stored result."
    )
    leased = app_row(sql, "com.example.leased")
    assert (leased["status"], leased["held_at"] is not None) == ("queued", True)
    expect(page.locator("#hold")).to_contain_text("No reason given.")
    assert cells(page, "Operator actions")[1][3:] == ["hold app", "lease_broken"]

    assert tab.dialogs == [
        f"confirm: Hold com.example.held? It is never handed out until released. Reason: {reason}",
        "confirm: Release com.example.held? The rule decides again whether it is handed out.",
        "confirm: Hold com.example.leased? It is never handed out until released. A live lease"
        " on it is broken.",
    ]
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert tab.errors == []


def test_what_a_broken_analyser_failed_is_refetched_after_a_dry_run(serve, tab, sql):
    """pi-broken fails five apps in a row while another host analyses one: it looks
    broken. Its button refetches the failures of that streak only: first a dry run that
    says what it would do, then, asked once, the refetch."""
    base = serve()
    service = Service(base)
    broken = service.add_analyser("pi-broken")
    attic = service.add_analyser("pi-attic")
    streak = [f"com.example.streak{number}" for number in range(1, 6)]
    for app_id in ["com.example.before", "com.example.fine", *streak, "com.example.attic"]:
        service.add(app_id, title=app_id)
    service.add("com.example.other", title="Other")
    timeout = "device timeout: no response from iPhone in 300 s"
    service.fail("com.example.before", timeout, broken)  # before its streak began
    service.analyse("com.example.fine", {"success": True, "trackers": {}}, broken)
    for app_id in streak:
        service.fail(app_id, timeout, broken)
    service.fail("com.example.attic", timeout, attic)  # another analyser's failure
    service.analyse("com.example.other", {"success": True, "trackers": {}})  # another host
    ((since,),) = sql.run("SELECT failing_since FROM analysers WHERE name = 'pi-broken'")
    since = since.astimezone(UTC).isoformat()

    sign_in(tab, base)
    page = tab.page
    expect(page.locator("#broken-analysers")).to_have_text(
        "A named analyser looks broken: see the analysers."
    )
    listed = run_cli("queue-status", "--json", env=dict(os.environ))
    assert listed.returncode == 0, listed.stderr
    status = json.loads(listed.stdout)
    assert (status["broken_analysers"], status["failure_ratio_1h"]) == (1, 0.778)  # 7 of 9
    assert cells(page, "Analysers")[1] == ["1", "0", "77.8 %"]

    page.goto(f"{base}/admin/analysers")
    row = page.locator("main tr[data-analyser='pi-broken']")
    expect(row).to_have_class("broken")
    expect(row.locator("td").nth(7)).to_have_text("5")  # failures in a row
    failing_since = row.locator("td").nth(8).locator("time")
    expect(failing_since).to_have_attribute("datetime", since)  # its exact time, kept
    expect(failing_since).to_have_text(re.compile(r"^\d+ (s|min) ago$"))
    expect(row.locator("td").nth(9)).to_have_text("broken")
    expect(page.locator("main tr[data-analyser='pi-attic'] td").nth(9)).to_have_text("no")
    button = row.get_by_role("button", name="Refetch what it failed since it began failing")
    dry_run = (
        f"Dry run: 5 apps failed by pi-broken since {since}: 5 would be queued now, 0 would"
        " wait for a lease to end, 0 would have the lease broken, 0 would be left as they are."
    )
    failed = sql.run("SELECT appid FROM apps WHERE status = 'failed' ORDER BY appid")
    assert failed == [["com.example.attic"], ["com.example.before"], *([a] for a in streak)]

    # Declined: the dry run changed nothing, recorded nothing.
    with page.expect_event("dialog"):
        button.click()
    expect(page.locator("#outcome")).to_have_text(dry_run)
    assert sql.run("SELECT appid FROM apps WHERE status = 'failed' ORDER BY appid") == failed
    assert since_sign_in(sql) == []

    tab.accepting = True
    button.click()
    expect(page.locator("#outcome")).to_have_text(
        "5 selected: 5 queued now, 0 waiting for a lease to end, 0 with the lease broken,"
        " 0 left as they were."
    )
    assert sql.run("SELECT appid, status FROM apps ORDER BY appid") == [
        ["com.example.attic", "failed"],
        ["com.example.before", "failed"],
        ["com.example.fine", "analysed"],
        ["com.example.other", "analysed"],
        *([app_id, "queued"] for app_id in streak),
    ]
    assert sorted(since_sign_in(sql)) == [("refetch", app_id) for app_id in streak]
    question = f"confirm: Refetch the 5 apps pi-broken failed since {since}?"
    assert tab.dialogs == [question, question]

    # Clicked again, the dry run finds nothing left to refetch, and nothing is asked.
    row.get_by_role("button", name="Refetch what it failed since it began failing").click()
    expect(page.locator("#outcome")).to_have_text(
        f"Dry run: 0 apps failed by pi-broken since {since}: 0 would be queued now, 0 would"
        " wait for a lease to end, 0 would have the lease broken, 0 would be left as they are."
    )
    assert tab.dialogs == [question, question]
    assert tab.errors == []


# --------------------------------------------------------------------------- what it defends


HOSTILE = '<img src=x onerror="window.__pwned=1;alert(1)"><script>window.__pwned=2</script>'


def test_what_others_wrote_is_shown_as_text_and_never_run(serve, tab, sql):
    base = serve()
    service = Service(base)
    service.add("com.example.hostile", title=HOSTILE, description="</pre>" + HOSTILE)
    service.fail("com.example.hostile", f"Traceback: {HOSTILE}\n<svg onload=alert(2)>")
    sign_in(tab, base)
    page = tab.page
    page.goto(f"{base}/admin/apps/com.example.hostile")
    details = json.loads(page.locator("h2:text-is('Details') + pre").text_content())
    assert details == {"title": HOSTILE, "description": "</pre>" + HOSTILE}
    failure = json.loads(page.locator("h2:text-is('Current result') + pre").text_content())
    assert failure["logs"] == f"Traceback: {HOSTILE}\n<svg onload=alert(2)>"
    assert page.locator("main img, main script, main svg").count() == 0
    # Analysed since, the failure is the last failure log: text there too.
    sql.run(
        "UPDATE apps SET status = 'analysed', analysis = '{\"success\": true}',"
        " failure_reason = NULL, failure_retryable = NULL WHERE appid = 'com.example.hostile'"
    )
    page.reload()
    shown = page.locator("h2:text-is('Last failure log') + pre")
    expect(shown).to_be_visible()
    failure = json.loads(shown.text_content())
    assert failure["logs"] == f"Traceback: {HOSTILE}\n<svg onload=alert(2)>"
    assert page.locator("main img, main script, main svg").count() == 0

    # A hostile bundle ID in the address comes back in an error, as text too.
    page.goto(f"{base}/admin/apps/<img src=x onerror=alert(3)>")
    expect(page.locator("main .error")).to_contain_text("unknown app")
    expect(page.locator("main .error")).to_contain_text("<img src=x")
    assert page.locator("main img, main script").count() == 0

    for path in ("/admin", "/admin/apps?q=com.example", "/admin/analysers"):
        page.goto(base + path)
        expect(page.locator("h1")).to_be_visible()
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert tab.dialogs == [] and tab.errors == []


ATTACKS = {
    # A plain form can send a body that reads as JSON (enctype text/plain), not its type.
    "a form": """<form id="f" method="post" enctype="text/plain" action="{base}/admin/api/refetch">
<input name='{{"appIds": ["com.example.gone"], "force": true, "x": "' value='"}}'></form>
<script>document.getElementById('f').submit()</script>""",
    # A script's request the browser sends without asking (no-cors), cookie and all.
    "a no-cors fetch": """<script>fetch('{base}/admin/api/analysers', {{method: 'POST',
mode: 'no-cors', credentials: 'include', headers: {{'Content-Type': 'text/plain'}},
body: JSON.stringify({{name: 'pi-intruder'}})}})</script>""",
    "a sign-out": """<script>fetch('{base}/admin/logout', {{method: 'POST', mode: 'no-cors',
credentials: 'include', body: '{{}}'}})</script>""",
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_another_origin_cannot_act_with_the_operators_cookie(serve, tab, sql, attack):
    """A page on another loopback port: the browser sends the SameSite=Strict cookie
    along (the same site), and the service refuses the request for its Sec-Fetch-Site
    (and, from a form, its type); nothing changes and the operator stays signed in."""
    base = serve()
    Service(base).add("com.example.gone", title="Gone")
    Service(base).fail("com.example.gone", "ERROR: app not found in the store")
    sign_in(tab, base)
    before = operator_actions(sql)
    page = tab.page
    path = re.search(r"\{base\}(/admin/\S+?)['\"]", ATTACKS[attack]).group(1)
    with another_site(ATTACKS[attack].format(base=base)) as site:
        # The attack's POST (the operator's own page reads the same address by GET).
        with page.expect_response(posted(f"{base}{path}")) as answer:
            page.goto(site)
    # 403, not 401: the service found the live session the cookie carries, and refused
    # the request for where it came from.
    assert answer.value.status == 403

    assert operator_actions(sql) == before
    assert app_row(sql, "com.example.gone")["status"] == "failed"
    assert sql.run("SELECT count(*) FROM analysers") == [[0]]
    page.goto(f"{base}/admin")  # and the operator is still signed in
    expect(page.locator("h1")).to_have_text("Overview")


def test_no_other_page_can_frame_the_web_view(serve, tab):
    base = serve()
    sign_in(tab, base)
    page = tab.page
    with another_site(f'<iframe id="frame" src="{base}/admin"></iframe>') as site:
        with page.expect_response(f"{base}/admin") as answer:
            page.goto(site)
    assert answer.value.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in answer.value.headers["content-security-policy"]
    # The browser shows its own error page in the frame: no part of the web view's.
    (frame,) = page.main_frame.child_frames
    frame.wait_for_load_state()
    assert not frame.url.startswith(base)
    assert frame.locator("#main, nav").count() == 0


# --------------------------------------------------------------------------- the modes


def test_read_only_shows_no_actions_and_refuses_every_write(serve, tab, sql):
    base = serve("read-only")
    service = Service(base)
    service.add("com.example.gone", title="Gone")
    service.fail("com.example.gone", "ERROR: app not found in the store")
    service.add_analyser("pi-kitchen")
    sign_in(tab, base)
    page = tab.page
    page.goto(f"{base}/admin/apps/com.example.gone")
    expect(page.locator("#why")).to_be_visible()
    expect(page.locator("main button")).to_have_count(0)
    page.goto(f"{base}/admin/apps?state=failed")
    expect(page.get_by_role("link", name="com.example.gone")).to_be_visible()
    assert page.locator("main button").all_text_contents() == ["Filter"]
    page.goto(f"{base}/admin/analysers")
    expect(page.get_by_role("cell", name="pi-kitchen", exact=True)).to_be_visible()
    expect(page.locator("main button, main form")).to_have_count(0)
    expect(page.locator("main")).not_to_contain_text("null")
    page.goto(f"{base}/admin")
    expect(page.locator("#counted")).to_be_visible()
    expect(page.locator("main button, main form")).to_have_count(0)
    before = operator_actions(sql)

    # The page's own requests (same origin, JSON), and the bearer token's: 403 each.
    writes = [
        ("/admin/api/refetch", {"appIds": ["com.example.gone"], "force": True}),
        ("/admin/api/analysers", {"name": "pi-attic"}),
        ("/admin/api/analysers/pi-kitchen/rotate", {}),
        ("/admin/api/analysers/pi-kitchen/revoke", {}),
        ("/admin/api/analysers/pi-kitchen/pause", {}),
        ("/admin/api/apps/com.example.gone/hold", {"reason": "not here"}),
        ("/admin/api/queue/pause", {"reason": "not here"}),
    ]
    for path, body in writes:
        status = page.evaluate(
            """([path, body]) => fetch(path, {method: 'POST', body: JSON.stringify(body),
                 headers: {'Content-Type': 'application/json'}}).then((r) => r.status)""",
            [path, body],
        )
        assert status == 403, path
        assert service.http.post(path, headers=ADMIN, json=body).status_code == 403, path
    assert operator_actions(sql) == before
    assert app_row(sql, "com.example.gone")["status"] == "failed"
    assert app_row(sql, "com.example.gone")["held_at"] is None
    assert sql.run("SELECT name, revoked IS NULL, paused_at FROM analysers") == [
        ["pi-kitchen", True, None]
    ]
    assert queue_pause(sql) == [[None, None, None]]
    assert tab.errors == []


def test_off_answers_404_under_admin(serve, tab):
    base = serve(None)  # ADMIN_WEB unset: off
    page = tab.page
    for path in ("/admin", "/admin/login", "/admin/apps", "/admin/static/admin.js"):
        assert page.goto(base + path).status == 404, path
    with httpx.Client(base_url=base) as http:
        assert http.get("/admin/api/status", headers=ADMIN).status_code == 404
        assert http.post("/admin/login", data={"token": ADMIN_TOKEN}).status_code == 404
        assert http.get("/ping", headers=ANALYSER).status_code == 200  # the service runs


# --------------------------------------------------------------------------- the tour


def test_a_tour_of_every_page_as_an_operator_sees_it(serve, tab, sql, tmp_path):
    """A queue in several states, from the service's own routes, and a week's history
    before it: the screenshots of docs/web-view.md (WEB_VIEW_SCREENSHOTS=docs/web-view)."""
    base = serve()
    service = Service(base)
    kitchen = service.add_analyser("pi-kitchen")
    attic = service.add_analyser("pi-attic")
    service.add_analyser("pi-old")
    assert service.http.delete("/analysers/pi-old", headers=ADMIN).status_code == 200
    for app_id, title, reviews in (
        ("com.example.weather", "Weather Now", "48210"),
        ("com.example.notes", "Notes & Lists", "9120"),
        ("org.example.chess", "Chess Club", "3050"),
        ("com.example.podcasts", "Pod Player", "22800"),
        ("net.example.maps", "Trail Maps", "1540"),
        ("io.example.budget", "Budget Book", "870"),
        ("de.example.fahrplan", "Fahrplan", "12400"),
        ("com.example.photos", "Photo Frame", "660"),
    ):
        service.add(app_id, title=title, reviews=reviews, price="free")
    trackers = {"trackers": {"analytics.example.com": 3, "ads.example.net": 1}}
    service.analyse("com.example.weather", {"success": True, **trackers}, kitchen)
    service.analyse("io.example.budget", {"success": True, "trackers": {}}, attic)
    service.fail(
        "org.example.chess",
        "2026-12-03 06:12:09 install: ERROR: App not found in the App Store (country us)\n"
        "giving up after 1 attempt",
        kitchen,
    )
    service.fail("net.example.maps", "device timeout: no response from iPhone in 300 s", attic)
    service.claim("com.example.podcasts", kitchen)
    assert (service.as_analyser(kitchen), service.as_analyser(attic)) == (200, 200)  # pings
    seed_history(sql, ["com.example.weather", "io.example.budget", "net.example.maps"])

    page = tab.page
    page.goto(f"{base}/admin/login")
    expect(page.get_by_label("Your token")).to_be_visible()
    screenshot(page, tmp_path, "sign-in")

    sign_in(tab, base)
    expect(page.locator("#counted")).to_be_visible()
    # What is busy now: each analyser that holds an app, since when, until when.
    busy = cells(page, "Busy now, paused or failing")
    assert busy[0] == ["analyser", "holds", "since", "lease ends", "paused", "broken"]
    assert busy[1][:2] == ["pi-kitchen", "com.example.podcasts"] and len(busy) == 2
    assert re.fullmatch(r"\d+ s ago", busy[1][2]) and re.fullmatch(r"in \d+ (h|min)", busy[1][3])
    assert cells(page, "Apps by state")[1:] == [
        ["queued", "3"],
        ["processing", "1"],
        ["analysed", "2"],
        ["failed", "2"],
    ]
    screenshot(page, tmp_path, "overview")

    page.goto(f"{base}/admin/apps")
    expect(page.get_by_role("link", name="com.example.weather")).to_be_visible()
    assert list(zip(column(page, 0), column(page, 1), strict=True)) == [
        ("com.example.notes", "queued"),
        ("com.example.photos", "queued"),
        ("com.example.podcasts", "processing"),
        ("com.example.weather", "analysed"),
        ("de.example.fahrplan", "queued"),
        ("io.example.budget", "analysed"),
        ("net.example.maps", "failed"),
        ("org.example.chess", "failed"),
    ]
    screenshot(page, tmp_path, "apps")

    page.goto(f"{base}/admin/apps/org.example.chess")
    expect(page.locator("#why")).to_contain_text("app_not_found")
    expect(page.locator("#analysis")).to_contain_text("App not found in the App Store")
    # The failure is the current result: shown once, not again as the last failure log.
    expect(page.locator("h2", has_text="Last failure log")).to_have_count(0)
    screenshot(page, tmp_path, "app")

    page.goto(f"{base}/admin/analysers")
    kitchen_row = page.locator("main table tr", has_text="pi-kitchen")
    expect(kitchen_row.locator("td").nth(3)).to_have_text("com.example.podcasts")
    expect(kitchen_row.locator("td").nth(2)).to_have_text("yes")  # online: it pinged
    screenshot(page, tmp_path, "analysers")
    for name in ("sign-in", "overview", "apps", "app", "analysers"):
        assert (tmp_path / f"{name}.png").read_bytes().startswith(b"\x89PNG")

    # At a phone's width (390 px) every page reads without scrolling sideways: the bar
    # wraps, a wide table scrolls inside itself, a long value breaks.
    page.set_viewport_size({"width": 390, "height": 844})
    for name, path in (
        ("overview", "/admin"),
        ("apps", "/admin/apps"),
        ("app", "/admin/apps/org.example.chess"),
        ("analysers", "/admin/analysers"),
    ):
        page.goto(f"{base}{path}")
        expect(page.locator("main h1")).to_be_visible()
        expect(page.locator("main table").first).to_be_visible()
        wide = page.evaluate("document.documentElement.scrollWidth")
        assert wide <= 390, (path, wide)
        bar, sign_out = page.locator("nav").bounding_box(), page.locator("#sign-out").bounding_box()
        assert sign_out["x"] + sign_out["width"] <= bar["x"] + bar["width"], path  # inside the bar
        if name in ("overview", "app"):  # docs/web-view.md shows these two
            screenshot(page, tmp_path, f"{name}-phone")
    page.goto(f"{base}/admin/login")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    screenshot(page, tmp_path, "sign-in-phone")
    assert tab.errors == []
