"""Named analysers (docs/analysers.md): their credentials through the CLI and the admin
API, revocation and rotation, the identity that fences a tokenless result, heartbeats
from the credential, and what a public GET /apps leaves out. On the real database."""

from __future__ import annotations

import logging
import os
import subprocess
from datetime import datetime, timedelta

import pytest
from kit import ADMIN, ANALYSER, configure_service

import handler
from helpers import (
    LambdaContext,
    app_row,
    call_cli,
    insert_app,
    json_lines,
    load_event,
    refetch_apps,
)

ANALYSER_ROUTES = [
    ("GET", "/ping", None),
    ("GET", "/queue", None),
    ("POST", "/uploadAnalysis?appId=com.example.app&analysisVersion=4", "json"),
    ("POST", "/reportAnalysisFailure?appId=com.example.app&analysisVersion=4", "text"),
]
UPLOAD = "/uploadAnalysis?appId=com.example.app&analysisVersion=4"
FAILURE = "/reportAnalysisFailure?appId=com.example.app&analysisVersion=4"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def add(client, name: str) -> dict[str, str]:
    answer = client.post("/analysers", json={"name": name}, headers=ADMIN)
    assert answer.status_code == 201, answer.text
    return bearer(answer.json()["token"])


def call(client, method: str, path: str, body: str | None, headers: dict) -> int:
    if body == "json":
        return client.post(path, json={"success": True}, headers=headers).status_code
    if body == "text":
        headers = {**headers, "Content-Type": "text/plain"}
        return client.post(path, content=b"usb error", headers=headers).status_code
    return client.request(method, path, headers=headers).status_code


def identity(sql, appid: str) -> dict:
    """Who the row says claimed it (and with which token) and who stored its result."""
    ((claimed_by, claimed_with, analysed_by, current),) = sql.run(
        "SELECT claimed_by, CAST(claimed_with AS text), analysed_by,"
        " CAST(analysis_claim_token AS text) FROM apps WHERE appid = :appid",
        appid=appid,
    )
    holder = claimed_by if claimed_with is not None and claimed_with == current else None
    return {"claimed_by": claimed_by, "holder": holder, "analysed_by": analysed_by}


def cli(database_url: str, *args: str) -> subprocess.CompletedProcess:
    return call_cli(*args, env={**os.environ, "DATABASE_URL": database_url})


# --- managing credentials --------------------------------------------------------------


def test_the_cli_adds_lists_rotates_and_revokes(database_url, client, sql):
    added = cli(database_url, "analysers", "add", "pi-kitchen")
    assert added.returncode == 0, added.stderr
    token = added.stdout.splitlines()[-1]
    assert token.startswith(handler.ANALYSER_TOKEN_PREFIX) and len(token) == 4 + 43
    assert added.stdout.count(token) == 1 and token not in added.stderr
    insert_app(sql, "com.example.app")
    assert client.get("/queue", headers=bearer(token)).text == "com.example.app"
    assert cli(database_url, "analysers", "add", "pi-kitchen").returncode == 1  # exists

    listed = cli(database_url, "analysers", "list")
    assert listed.returncode == 0, listed.stderr
    assert "pi-kitchen" in listed.stdout and "holding com.example.app" in listed.stdout
    assert token not in listed.stdout + listed.stderr

    rotated = cli(database_url, "analysers", "rotate", "pi-kitchen", "--overlap", "2h")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.splitlines()[-1]
    assert new.startswith(handler.ANALYSER_TOKEN_PREFIX) and new != token
    assert "previous token works until" in rotated.stdout
    # Both work during the overlap.
    assert client.get("/ping", headers=bearer(token)).status_code == 200
    assert client.get("/ping", headers=bearer(new)).status_code == 200

    revoked = cli(database_url, "analysers", "revoke", "pi-kitchen")
    assert revoked.returncode == 0, revoked.stderr
    # At once, in this running process, for both tokens.
    assert client.get("/ping", headers=bearer(token)).status_code == 401
    assert client.get("/ping", headers=bearer(new)).status_code == 401
    assert cli(database_url, "analysers", "rotate", "pi-kitchen").returncode == 1  # revoked
    assert "revoked" in cli(database_url, "analysers", "list").stdout
    assert cli(database_url, "analysers", "revoke", "pi-nobody").returncode == 1
    assert cli(database_url, "analysers", "add", "bad name").returncode == 2
    assert cli(database_url, "analysers", "rotate", "pi-x", "--overlap", "soon").returncode == 2
    stored = sql.run("SELECT token_hash, previous_token_hash FROM analysers")
    assert stored == [[handler.token_hash(new), None]]  # hashes only; revoked: no previous


def test_the_admin_api_adds_lists_rotates_and_revokes(client, sql, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    created = client.post("/analysers", json={"name": "pi-attic"}, headers=ADMIN)
    assert created.status_code == 201
    body = created.json()
    assert set(body) == {"name", "created", "token"} and body["name"] == "pi-attic"
    token = body["token"]
    tokens = [token]
    again = client.post("/analysers", json={"name": "pi-attic"}, headers=ADMIN)
    assert again.status_code == 409
    for bad in ({"name": "has space"}, {"name": 3}, {"name": "ok", "extra": 1}, []):
        assert client.post("/analysers", json=bad, headers=ADMIN).status_code == 400
    assert client.post("/analysers", json={"name": "x"}, headers=ANALYSER).status_code == 401
    assert client.post("/analysers", json={"name": "x"}, headers=bearer(token)).status_code == 401
    assert client.get("/analysers", headers=bearer(token)).status_code == 401

    insert_app(sql, "com.example.app")
    claimed = client.get("/queue", headers=bearer(token))
    assert claimed.text == "com.example.app"
    listed = client.get("/analysers", headers=ADMIN)
    assert listed.status_code == 200
    (row,) = listed.json()["analysers"]
    assert row["name"] == "pi-attic" and row["revoked"] is None
    assert row["holding"]["appId"] == "com.example.app" and row["holding"]["since"]
    # The lease ends, without a result, PROCESSING_TIMEOUT_MINUTES after it began.
    since, until = (datetime.fromisoformat(row["holding"][k]) for k in ("since", "until"))
    assert until - since == timedelta(minutes=handler.settings().policy.processing_timeout_minutes)
    assert row["lastResult"] is None and row["online"] is False  # no ping yet
    assert client.post(UPLOAD, json={"success": True}, headers=bearer(token)).status_code == 200
    assert client.get("/ping", headers=bearer(token)).status_code == 200
    (row,) = client.get("/analysers", headers=ADMIN).json()["analysers"]
    assert row["online"] is True and row["lastSeen"] and row["holding"] is None
    assert row["lastResult"]["appId"] == "com.example.app" and row["lastResult"]["success"]
    assert (row["results24h"], row["failures24h"], row["outdatedVersion"]) == (1, 0, False)

    rotate = "/analysers/pi-attic/rotate"
    for bad in ({"overlap": "forever"}, {"overlap": 5}, {"other": "1h"}, {"overlap": "31d"}):
        assert client.post(rotate, json=bad, headers=ADMIN).status_code == 400
    assert client.post("/analysers/nobody/rotate", headers=ADMIN).status_code == 404
    rotated = client.post(rotate, headers=ADMIN)  # empty body: the default overlap (24h)
    assert rotated.status_code == 200
    assert set(rotated.json()) == {"name", "rotated", "previousTokenValidUntil", "token"}
    assert rotated.json()["previousTokenValidUntil"] is not None
    tokens.append(rotated.json()["token"])
    assert client.get("/ping", headers=bearer(token)).status_code == 200
    at_once = client.post(rotate, json={"overlap": "0"}, headers=ADMIN).json()
    tokens.append(at_once["token"])
    assert at_once["previousTokenValidUntil"] is None
    # No overlap: the token before is refused, and so is the first (only one is kept).
    assert client.get("/ping", headers=bearer(tokens[1])).status_code == 401
    assert client.get("/ping", headers=bearer(token)).status_code == 401
    assert client.get("/ping", headers=bearer(tokens[2])).status_code == 200

    assert client.delete("/analysers/nobody", headers=ADMIN).status_code == 404
    assert client.delete("/analysers/bad%20name", headers=ADMIN).status_code == 400
    gone = client.delete("/analysers/pi-attic", headers=ADMIN)
    assert gone.status_code == 200 and gone.json()["revoked"]
    assert client.get("/ping", headers=bearer(tokens[2])).status_code == 401
    assert client.post(rotate, headers=ADMIN).status_code == 409
    (row,) = client.get("/analysers", headers=ADMIN).json()["analysers"]
    assert row["revoked"] is not None and row["online"] is False

    # A token is in the answer that made it and nowhere else: not in a later answer, not
    # in any log line.
    later = client.get("/analysers", headers=ADMIN).text
    logged = caplog.text + "".join(capsys.readouterr())
    for secret in tokens:
        assert secret not in later and secret not in logged
        assert handler.token_hash(secret).hex() not in later + logged


@pytest.mark.parametrize("how", ["revoked", "expired", "unknown"])
@pytest.mark.parametrize(("method", "path", "body"), ANALYSER_ROUTES)
def test_a_dead_token_gets_401_on_every_analyser_route(client, sql, how, method, path, body):
    insert_app(sql, "com.example.app")
    headers = add(client, "pi-dead")
    if how == "revoked":
        assert client.delete("/analysers/pi-dead", headers=ADMIN).status_code == 200
    elif how == "expired":
        rotated = client.post("/analysers/pi-dead/rotate", json={"overlap": "1h"}, headers=ADMIN)
        assert rotated.status_code == 200
        assert call(client, "GET", "/ping", None, headers) == 200  # still in its overlap
        # The overlap ends (the clock moved by rewriting the row's end, not by waiting).
        sql.run("UPDATE analysers SET previous_token_expires = now() - interval '1 second'")
    else:
        headers = bearer(handler.new_analyser_token())
    before = sql.run("SELECT status, analysis::text FROM apps")
    assert call(client, method, path, body, headers) == 401
    assert sql.run("SELECT status, analysis::text FROM apps") == before


def test_the_shared_password_can_be_turned_off(client, database_url, monkeypatch, sql):
    insert_app(sql, "com.example.app")
    named = add(client, "pi-1")
    configure_service(monkeypatch, database_url, ACCEPT_SHARED_UPLOAD_PASSWORD="false")
    for method, path, body in ANALYSER_ROUTES:
        assert call(client, method, path, body, ANALYSER) == 401, path
    assert client.get("/queue", headers=named).text == "com.example.app"
    configure_service(monkeypatch, database_url, ACCEPT_SHARED_UPLOAD_PASSWORD="yes")
    with pytest.raises(handler.ConfigError, match="ACCEPT_SHARED_UPLOAD_PASSWORD"):
        handler.load_settings()


# --- identity on leases and results ----------------------------------------------------


def test_a_named_claim_fences_other_credentials_tokenless_results(client, sql):
    insert_app(sql, "com.example.app")
    one, two = add(client, "pi-1"), add(client, "pi-2")
    claim = client.get("/queue", headers=one)
    token = claim.headers["x-analysis-claim-token"]
    assert identity(sql, "com.example.app")["claimed_by"] == "pi-1"
    before = sql.run("SELECT * FROM apps")
    for headers in (two, ANALYSER):
        for path, kwargs in ((UPLOAD, {"json": {"success": True}}), (FAILURE, {"content": b"x"})):
            extra = {} if "json" in kwargs else {"Content-Type": "text/plain"}
            answer = client.post(path, headers={**headers, **extra}, **kwargs)
            assert answer.status_code == 409, answer.text
            assert "not this analyser's" in answer.json()["detail"]
    assert sql.run("SELECT * FROM apps") == before  # nothing written
    # The claim token works for any credential, as ever.
    with_token = {**two, "X-Analysis-Claim-Token": token}
    assert client.post(UPLOAD, json={"success": 1}, headers=with_token).status_code == 200
    assert app_row(sql, "com.example.app")["status"] == "analysed"
    assert identity(sql, "com.example.app")["analysed_by"] == "pi-2"
    # The lease is over: pi-1's late tokenless result is no claim of its.
    assert client.post(UPLOAD, json={"late": True}, headers=one).status_code == 409


def test_a_shared_password_claim_takes_shared_results_only(client, sql):
    insert_app(sql, "com.example.app")
    named = add(client, "pi-1")
    assert client.get("/queue", headers=ANALYSER).text == "com.example.app"
    assert identity(sql, "com.example.app")["claimed_by"] is None
    assert client.post(UPLOAD, json={"success": True}, headers=named).status_code == 409
    assert client.post(UPLOAD, json={"success": True}, headers=ANALYSER).status_code == 200
    assert identity(sql, "com.example.app")["analysed_by"] is None


def test_the_own_tokenless_result_ends_the_own_claim_even_after_expiry(client, sql):
    """The deployed loop: claim, then a result with no claim token, under its name."""
    insert_app(sql, "com.example.app")
    named = add(client, "pi-1")
    assert client.get("/queue", headers=named).text == "com.example.app"
    sql.run("UPDATE apps SET processing_started = now() - interval '3 hours'")  # expired
    failure = {**named, "Content-Type": "text/plain"}
    assert client.post(FAILURE, content=b"usb error", headers=failure).status_code == 200
    assert app_row(sql, "com.example.app")["status"] == "failed"
    assert identity(sql, "com.example.app")["analysed_by"] == "pi-1"
    (last,) = client.get("/analysers", headers=ADMIN).json()["analysers"]
    assert (last["results24h"], last["failures24h"]) == (0, 1)
    assert sql.run("SELECT analyser FROM app_analyses") == [["pi-1"]]


def test_a_re_claim_by_a_release_that_knows_no_names_ends_the_named_claim(client, sql):
    """claimed_by is bound to the claim's token: a writer that hands the row out again
    without naming anyone (the previous release, the old server) changes the token, and
    the named analyser's tokenless result is then refused."""
    insert_app(sql, "com.example.app")
    named = add(client, "pi-1")
    assert client.get("/queue", headers=named).text == "com.example.app"
    sql.run("UPDATE apps SET analysis_claim_token = gen_random_uuid(), processing_started = now()")
    assert identity(sql, "com.example.app") == {
        "claimed_by": "pi-1",  # left as it was, and no longer the holder
        "holder": None,
        "analysed_by": None,
    }
    assert client.post(UPLOAD, json={"success": True}, headers=named).status_code == 409
    assert client.post(UPLOAD, json={"success": True}, headers=ANALYSER).status_code == 200


def test_heartbeats_come_from_the_credential(client, sql):
    named = add(client, "pi-1")
    # A named analyser cannot pose as another host's label: the header is not read.
    assert client.get("/ping", headers={**named, "X-Analyser-Id": "pi-2"}).status_code == 200
    assert sql.run("SELECT count(*) FROM analyser_heartbeats") == [[0]]
    assert sql.run("SELECT name FROM analysers WHERE last_seen IS NOT NULL") == [["pi-1"]]
    assert client.get("/ping", headers={**ANALYSER, "X-Analyser-Id": "pi-9"}).status_code == 200
    assert sql.run("SELECT analyser_id FROM analyser_heartbeats") == [["pi-9"]]
    health = client.get("/healthz/analyser").json()
    assert health["status"] == "online" and health["analysersLastHour"] == 2
    assert "pi-1" not in client.get("/healthz/analyser").text


def test_queue_status_lists_each_analyser(client, database_url, sql):
    insert_app(sql, "com.example.app")
    insert_app(sql, "com.example.two")
    one, two = add(client, "pi-1"), add(client, "pi-2")
    assert client.get("/queue", headers=one).status_code == 200
    assert client.get("/queue", headers=two).status_code == 200
    held = client.get("/analysers", headers=ADMIN).json()["analysers"]
    appid = held[1]["holding"]["appId"]
    old = f"/uploadAnalysis?appId={appid}&analysisVersion=3"
    assert client.post(old, json={"success": True}, headers=two).status_code == 200
    client.get("/ping", headers=one)
    printed = cli(database_url, "queue-status")
    assert printed.returncode == 0, printed.stderr
    lines = [line for line in printed.stdout.splitlines() if line.startswith("  pi-")]
    assert len(lines) == 2
    assert "online" in lines[0] and "holding com.example." in lines[0]
    assert "offline" in lines[1] and "outdated analysis version" in lines[1]
    assert " 1 ok / 0 failed" in lines[1]


# --- what is public --------------------------------------------------------------------


def test_a_public_answer_holds_no_failure_record(client, sql):
    secret_log = b"login as someone@example.com password hunter2: usb error"
    insert_app(sql, "com.example.app")
    named = add(client, "pi-1")
    client.get("/queue", headers=named)
    failed = client.post(
        FAILURE, content=secret_log, headers={**named, "Content-Type": "text/plain"}
    )
    assert failed.status_code == 200
    public = client.get("/apps/com.example.app")
    assert public.status_code == 200
    view = public.json()
    assert view["status"] == "failed" and view["analysis"] is None
    assert view["failure"] == {"reason": "analysis_failed", "retryable": True}
    assert "hunter2" not in public.text and "pi-1" not in public.text
    # Any other credential is the public answer too.
    for headers in (ANALYSER, named, bearer("wrong")):
        assert client.get("/apps/com.example.app", headers=headers).json() == view
    admin = client.get("/apps/com.example.app", headers=ADMIN).json()
    assert admin["analysis"]["logs"] == secret_log.decode()
    assert (admin["analysedBy"], admin["claimedBy"]) == ("pi-1", None)
    # Queued again for a retry, the failure record is still the stored analysis: still
    # not public.
    refetch_apps(handler.api_connection(), ["com.example.app"])
    again = client.get("/apps/com.example.app")
    assert again.json()["status"] == "queued" and "hunter2" not in again.text
    # A successful analysis is public.
    client.get("/queue", headers=named)
    client.post(UPLOAD, json={"success": True, "trackers": ["a"]}, headers=named)
    assert client.get("/apps/com.example.app").json()["analysis"] == {
        "success": True,
        "trackers": ["a"],
    }


# --- the docs page's checkable claims --------------------------------------------------


def test_docs_analysers_states_what_the_code_does():
    text = (handler.HERE / "docs" / "analysers.md").read_text()
    assert handler.DEFAULT_ROTATION_OVERLAP == "24h" and "default 24 h" in text
    assert handler.MAX_ROTATION_OVERLAP_SECONDS == 30 * 86400 and "at most 30 days" in text
    assert f"`{handler.ANALYSER_TOKEN_PREFIX}` followed by 43" in text
    assert len(handler.new_analyser_token()) == len(handler.ANALYSER_TOKEN_PREFIX) + 43
    assert handler.ANALYSER_NAME.pattern == r"(?!\.\.?\Z)[A-Za-z0-9._:@-]{1,64}"
    assert "1 to 64 letters, digits or `._:@-`, not `.` or `..`" in text
    assert "ACCEPT_SHARED_UPLOAD_PASSWORD=false" in text
    assert "AcceptSharedUploadPassword=false" in text
    template = (handler.HERE / "template.yaml").read_text()
    assert "ACCEPT_SHARED_UPLOAD_PASSWORD: !Ref AcceptSharedUploadPassword" in template
    assert handler.overlap_seconds("0") == 0 and handler.overlap_seconds("90s") == 90
    assert handler.overlap_seconds("30m") == 1800 and handler.overlap_seconds("7d") == 604800
    for route in ("POST /analysers", "GET /analysers", "DELETE /analysers/{name}"):
        assert f"`{route}" in text
    assert "`POST\n  /analysers/{name}/rotate`" in text or "POST /analysers/{name}/rotate" in text
    assert "`ActiveAnalysers`" in text
    # The shared password and the admin token: their rules on this page, once.
    assert text.count("\n## The shared password and the admin token\n") == 1
    for command in ("credentials import", "credentials rotate", "credentials-import"):
        assert command in text, command


def test_the_schema_says_get_apps_is_public_with_an_optional_admin_token():
    paths = handler.app.openapi()["paths"]
    assert paths["/apps/{appId}"]["get"]["security"] == [{}, {"AdminToken": []}]
    for path in ("/analysers", "/analysers/{name}", "/analysers/{name}/rotate"):
        for operation in paths[path].values():
            assert operation["security"] == [{"AdminToken": []}], path
    for path in ("/ping", "/queue", "/uploadAnalysis", "/reportAnalysisFailure"):
        for operation in paths[path].values():
            assert operation["security"] == [{"AnalyserPassword": []}], path


def test_active_analysers_agree_everywhere_and_revoked_ones_drop_out(client, sql, capsys):
    """ActiveAnalysers (the report's metric), /healthz/analyser's analysersLastHour and
    queue-status's analysers_last_hour are one figure, and each named analyser counted in
    it is `online`: a revoked analyser drops out of all of them (its requests get 401),
    and so does a heartbeat the service cannot have written (in the future)."""
    one, two = add(client, "pi-1"), add(client, "pi-2")
    for headers in (one, two, {**ANALYSER, "X-Analyser-Id": "shared-1"}):
        assert client.get("/ping", headers=headers).status_code == 200

    def figures() -> tuple[int, int, int, int]:
        health = client.get("/healthz/analyser").json()["analysersLastHour"]
        status = handler.queue_status(handler.api_connection(), handler.settings().policy)
        online = sum(analyser["online"] for analyser in status.analysers)
        capsys.readouterr()
        handler.report(load_event("schedule.json"), LambdaContext())
        (emf,) = json_lines(capsys.readouterr().out)
        metric = emf["ActiveAnalysers"]
        metric = metric[0] if isinstance(metric, list) else metric
        return health, status.analysers_last_hour, metric, online

    assert figures() == (3, 3, 3, 2)
    assert client.delete("/analysers/pi-2", headers=ADMIN).status_code == 200
    assert client.get("/ping", headers=two).status_code == 401
    assert figures() == (2, 2, 2, 1)
    sql.run("UPDATE analysers SET last_seen = now() + interval '1 day' WHERE name = 'pi-1'")
    assert figures() == (1, 1, 1, 0)


def test_the_last_ping_counts_an_analyser_revoked_since(client, sql):
    """The last ping is every analyser's: one that pinged and was then revoked did ping,
    so queue-status, /healthz/analyser and the report never say "never" after it; it is
    no longer active (analysersLastHour)."""
    token = add(client, "pi-gone")
    assert client.get("/ping", headers=token).status_code == 200
    assert client.delete("/analysers/pi-gone", headers=ADMIN).status_code == 200
    health = client.get("/healthz/analyser").json()
    status = handler.queue_status(handler.api_connection(), handler.settings().policy)
    assert health["analysersLastHour"] == status.analysers_last_hour == 0
    assert health["minutesSinceLastPing"] is not None
    assert health["status"] == "offline"  # no analyser is active: /healthz/analyser is 503
    assert 0 <= status.minutes_since_last_ping < 5
    assert "Last analyser ping: never" not in handler.format_queue_status(status)
