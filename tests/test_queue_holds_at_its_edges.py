"""The queue's edges an outside attack found (docs/queue.md): an operator's command run
with other settings than the API's, an empty list of apps, a tokenless result stored while
a refetch waited, a waiting refetch and back-off, out-of-range settings, a client that
disconnects mid-upload; and where the result rules meet the other features: a stored
analysis of a version above the current one under older analysers and back-off, a result
that queued its app for a refetch sent again. Each on real PostgreSQL; the wide ones with
generated cases (and tests/test_queue_follows_its_rules.py for every interleaving)."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN, ANALYSER, configure_service, time_passes

import handler
from helpers import (
    LambdaContext,
    app_row,
    call_cli,
    days_ago,
    history,
    insert_app,
    refetch_apps,
    table_digest,
)
from live import LiveServer


def claim(client, appid: str) -> str:
    answer = client.get(f"/queue?appId={appid}", headers=ANALYSER)
    assert answer.text == appid
    return answer.headers["x-analysis-claim-token"]


def upload(client, appid: str, body: dict, token: str | None = None):
    headers = dict(ANALYSER) if token is None else {**ANALYSER, "X-Analysis-Claim-Token": token}
    return client.post(
        f"/uploadAnalysis?appId={appid}&analysisVersion=4", json=body, headers=headers
    )


def test_a_refetch_run_with_a_shorter_lease_waits_for_the_apis(client, sql):
    """The API (120 minutes, recorded in queue_policy by its promoter) leased the app five
    minutes ago; an operator's command configured with a one-minute lease still waits."""
    insert_app(sql, "com.example.app")
    claim(client, "com.example.app")
    sql.run("UPDATE apps SET processing_started = processing_started - interval '5 minutes'")
    short = handler.QueuePolicy(processing_timeout_minutes=1)
    selected = refetch_apps(handler.api_connection(), ["com.example.app"], True, short)
    assert selected == [{"appid": "com.example.app", "status": "processing", "outcome": "waiting"}]
    time_passes()
    assert client.get("/queue?appId=com.example.app", headers=ANALYSER).text == ""
    assert app_row(sql, "com.example.app")["status"] == "processing"


@pytest.mark.parametrize(
    "event",
    [
        {"command": "queue-refetch", "appIds": [], "apply": True},
        {"command": "queue-refetch", "includeNonRetryable": True, "apply": True},
    ],
)
def test_the_reports_refetch_refuses_a_selection_that_would_widen(database_url, sql, event):
    insert_app(sql, "com.example.done", status="analysed", version=4)
    before = table_digest(sql)
    with pytest.raises(handler.BadInput, match=r"appIds names no app|goes with failed"):
        handler.report(event, LambdaContext())
    assert table_digest(sql) == before


def test_the_holder_replaces_a_tokenless_result_stored_while_a_refetch_waited(client, sql):
    insert_app(sql, "com.example.app")
    token = claim(client, "com.example.app")
    (waiting,) = refetch_apps(
        handler.api_connection(), ["com.example.app"], True, handler.QueuePolicy()
    )
    assert waiting["outcome"] == "waiting"
    stale = upload(client, "com.example.app", {"success": True, "stale": 1})
    assert stale.status_code == 200
    assert app_row(sql, "com.example.app")["status"] == "queued"  # the refetch is done
    mine = upload(client, "com.example.app", {"success": True, "mine": 1}, token)
    assert mine.status_code == 200, mine.text
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysis"]) == ("queued", {"success": True, "mine": 1})
    # The same result sent again is answered as stored; a failure cannot replace it.
    assert upload(client, "com.example.app", {"success": True, "mine": 1}, token).json() == (
        mine.json()
    )
    failed = client.post(
        "/reportAnalysisFailure?appId=com.example.app&analysisVersion=4",
        content=b"usb error",
        headers={**ANALYSER, "X-Analysis-Claim-Token": token, "Content-Type": "text/plain"},
    )
    assert failed.status_code == 409


def test_a_waiting_refetch_wins_over_back_off(client, sql):
    insert_app(sql, "com.example.app")
    claim(client, "com.example.app")
    sql.run("UPDATE apps SET lease_attempts = 3")  # its third lease in a row
    refetch_apps(handler.api_connection(), ["com.example.app"], True, handler.QueuePolicy())
    sql.run("UPDATE apps SET processing_started = processing_started - interval '3 hours'")
    promotion = handler.promote_due_apps(
        handler.api_connection(), handler.settings().policy, force=True
    )
    assert (promotion.requeued, promotion.abandoned) == (1, 0)
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["failure_reason"]) == ("queued", None)


def test_without_a_refetch_the_third_expired_lease_backs_off(client, sql):
    insert_app(sql, "com.example.app")
    claim(client, "com.example.app")
    sql.run("UPDATE apps SET lease_attempts = 3")
    sql.run("UPDATE apps SET processing_started = processing_started - interval '3 hours'")
    promotion = handler.promote_due_apps(
        handler.api_connection(), handler.settings().policy, force=True
    )
    assert (promotion.requeued, promotion.abandoned) == (0, 1)
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["failure_reason"]) == ("failed", "lease_expired")


def refetch(appid: str) -> str:
    (selected,) = refetch_apps(handler.api_connection(), [appid], True, handler.QueuePolicy())
    return selected["outcome"]


def test_older_analysers_and_back_off_never_replace_a_newer_analysis(client, sql):
    """An analysis of version 5 is stored; the service's setting says 4 (a fleet upgraded
    before the setting, or the setting rolled back). It is not stale by age for analysers
    of version 4, which could only be refused; after an operator's refetch, a version-4
    holder's refusal ends its lease (not a lease without a result), and leases that expire
    again and again back off to the stored analysis, never to an older failure."""
    newer = {"success": True, "trackers": {"v5": 1}}
    insert_app(sql, "com.example.app", status="analysed", version=5, analysed=days_ago(400))
    sql.run("UPDATE apps SET analysis = CAST(:a AS jsonb)", a=json.dumps(newer))
    assert client.get("/queue", headers=ANALYSER).text == ""
    assert refetch("com.example.app") == "queued"
    for _ in range(3):
        token = claim(client, "com.example.app")
        refused = upload(client, "com.example.app", {"success": True, "v4": 1}, token)
        assert refused.status_code == 409
        assert "its lease ended" in refused.json()["detail"]
        row = app_row(sql, "com.example.app")
        assert (row["status"], row["analysis"], row["analysisversion"]) == ("analysed", newer, 5)
        assert sql.run("SELECT lease_attempts FROM apps") == [[0]]
        assert refetch("com.example.app") == "queued"
    # A hanging analyser of version 4, again and again: the back-off's lease_expired
    # failure would be older than the stored analysis too.
    for _ in range(3):
        claim(client, "com.example.app")
        sql.run("UPDATE apps SET processing_started = processing_started - interval '3 hours'")
    promotion = handler.promote_due_apps(
        handler.api_connection(), handler.settings().policy, force=True
    )
    assert (promotion.abandoned, promotion.returned) == (0, 1)
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysis"], row["analysisversion"]) == ("analysed", newer, 5)
    assert history(sql, "com.example.app") == [[newer, 5, True]]
    time_passes()
    assert client.get("/queue", headers=ANALYSER).text == ""


def test_an_outdated_analysers_refused_result_answers_its_lease(client, sql):
    """A stale analysis of the current version, claimed by an analyser of an older one:
    its result is refused, and its lease counts as answered (lease_attempts 0: three of
    them are not three leases without a result) but runs out as any lease does, so the
    analyser's next claim does not get the same app back at once."""
    stored = {"success": True, "trackers": {"v4": 1}}
    insert_app(sql, "com.example.app", status="analysed", version=4, analysed=days_ago(400))
    sql.run("UPDATE apps SET analysis = CAST(:a AS jsonb)", a=json.dumps(stored))
    for attempt in range(3):
        time_passes()
        answer = client.get("/queue", headers=ANALYSER)
        assert answer.text == "com.example.app"
        token = answer.headers["x-analysis-claim-token"]
        old = "/uploadAnalysis?appId=com.example.app&analysisVersion=3"
        refused = client.post(old, json={"success": True, "v3": attempt}, headers=ANALYSER)
        assert refused.status_code == 409
        assert "its lease counts as answered" in refused.json()["detail"]
        row = app_row(sql, "com.example.app")
        assert (row["status"], row["claim_token"]) == ("processing", token)
        assert sql.run("SELECT lease_attempts FROM apps") == [[0]]
        time_passes()
        assert client.get("/queue", headers=ANALYSER).text == ""  # a lease later, again
        sql.run("UPDATE apps SET processing_started = processing_started - interval '3 hours'")
    time_passes()
    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysis"]) == ("processing", stored)  # never backed off
    assert history(sql, "com.example.app") == []


def test_the_back_offs_failure_is_stored_by_no_analyser(client, sql):
    """The lease_expired failure is the server's result: who stored the app's result
    (analysedBy) is nobody, not the analyser whose result it replaced."""
    insert_app(sql, "com.example.app")
    made = client.post("/analysers", json={"name": "pi-1"}, headers=ADMIN).json()
    named = {"Authorization": f"Bearer {made['token']}"}
    client.get("/queue?appId=com.example.app", headers=named)
    path = "/uploadAnalysis?appId=com.example.app&analysisVersion=4"
    assert client.post(path, json={"success": True}, headers=named).status_code == 200
    assert refetch("com.example.app") == "queued"
    for _ in range(3):
        claim(client, "com.example.app")
        sql.run("UPDATE apps SET processing_started = processing_started - interval '3 hours'")
    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    view = client.get("/apps/com.example.app", headers=ADMIN).json()
    assert (view["status"], view["failure"]["reason"]) == ("failed", "lease_expired")
    assert view["analysedBy"] is None


@pytest.mark.parametrize("with_token", [False, True], ids=["tokenless", "with its token"])
@pytest.mark.parametrize("named", [False, True], ids=["shared password", "named analyser"])
def test_a_result_that_queued_its_app_for_a_refetch_is_answered_as_the_first_time(
    client, sql, named, with_token
):
    insert_app(sql, "com.example.app")
    credential = dict(ANALYSER)
    if named:
        made = client.post("/analysers", json={"name": "pi-1"}, headers=ADMIN).json()
        credential = {"Authorization": f"Bearer {made['token']}"}
    answer = client.get("/queue?appId=com.example.app", headers=credential)
    headers = dict(credential)
    if with_token:
        headers["X-Analysis-Claim-Token"] = answer.headers["x-analysis-claim-token"]
    assert refetch("com.example.app") == "waiting"
    path = "/uploadAnalysis?appId=com.example.app&analysisVersion=4"
    first = client.post(path, json={"success": True, "n": 1}, headers=headers)
    assert first.status_code == 200, first.text
    assert app_row(sql, "com.example.app")["status"] == "queued"  # the refetch is done
    again = client.post(path, json={"success": True, "n": 1}, headers=headers)
    assert (again.status_code, again.json()) == (200, first.json())
    assert app_row(sql, "com.example.app")["status"] == "queued"  # and stays done
    assert len(history(sql, "com.example.app")) == 1


def test_a_late_tokenless_result_does_not_undo_a_refetch_that_waited(client, sql):
    """An app queued again by its result for the refetch that waited for its lease: no
    claim is open and no exact-app host was handed it, so a result without a token (from
    an analyser whose lease was taken over) is late, as for the finished app it was."""
    insert_app(sql, "com.example.app")
    claim(client, "com.example.app")
    assert refetch("com.example.app") == "waiting"
    path = "/uploadAnalysis?appId=com.example.app&analysisVersion=4"
    assert client.post(path, json={"success": True, "n": 1}, headers=ANALYSER).status_code == 200
    late = client.post(path, json={"success": True, "n": 2}, headers=ANALYSER)
    assert late.status_code == 409
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysis"]) == ("queued", {"success": True, "n": 1})


NUMBER_SETTINGS = {
    "CURRENT_ANALYSIS_VERSION": handler.INT32_MAX,
    "STALE_ANALYSIS_DAYS": handler.SETTING_MAXIMUMS["STALE_ANALYSIS_DAYS"],
    "PROCESSING_TIMEOUT_MINUTES": handler.SETTING_MAXIMUMS["PROCESSING_TIMEOUT_MINUTES"],
    "MAX_LEASE_ATTEMPTS": handler.SETTING_MAXIMUMS["MAX_LEASE_ATTEMPTS"],
    "STATEMENT_TIMEOUT_MS": handler.INT32_MAX,
    "PROMOTION_BUDGET_MS": handler.INT32_MAX,
    "MAX_BODY_BYTES": handler.INT32_MAX,
}


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(NUMBER_SETTINGS)), over=st.integers(1, 10**30))
def test_a_number_setting_past_its_maximum_is_refused_naming_it(name, over):
    value = NUMBER_SETTINGS[name] + over
    with pytest.raises(handler.ConfigError, match=f"{name} must be at most"):
        handler.load_settings({name: str(value)})


def test_the_queue_works_at_every_settings_maximum(client, sql, database_url, monkeypatch):
    insert_app(sql, "com.example.app")
    insert_app(sql, "com.example.done", status="analysed", version=4)
    maxima = {k: str(v) for k, v in NUMBER_SETTINGS.items() if k != "STATEMENT_TIMEOUT_MS"}
    configure_service(monkeypatch, database_url, **maxima)
    for path in ("/queue", "/queue", "/apps/com.example.done"):
        headers = ANALYSER if path == "/queue" else {}
        assert client.get(path, headers=headers).status_code == 200, path
    status = handler.queue_status(handler.api_connection(), handler.settings().policy)
    assert status.counts["processing"] == 2


def test_cli_numbers_out_of_range_are_one_usage_error(tmp_path):
    for args in (
        ("serve", "--port", "99999"),
        ("priority-report", "--limit", "99999999999999999999"),
        ("queue-status", "--top", "0"),
    ):
        done = call_cli(*args, env={"DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"})
        assert done.returncode == 2, args
        assert "Traceback" not in done.stderr, args
        assert done.stderr.splitlines()[-1].startswith("handler.py"), done.stderr


def test_a_client_that_leaves_mid_upload_is_not_an_error(database_url, sql, capsys):
    insert_app(sql, "com.example.app")
    with LiveServer(handler.app) as server:
        capsys.readouterr()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
            raw.sendall(
                b"POST /uploadAnalysis?appId=com.example.app&analysisVersion=4 HTTP/1.1\r\n"
                b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Authorization: {ANALYSER['Authorization']}\r\n".encode()
                + b"Content-Length: 100000\r\n\r\n"
                + b'{"success": true, "pad": "'
            )
        # Another request through, so the first one's handling has finished.
        import httpx

        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
    logged = capsys.readouterr().err
    assert "unhandled error" not in logged
    assert app_row(sql, "com.example.app")["status"] == "queued"


def as_setting(monkeypatch, database_url: str, version: int) -> None:
    """A process whose CURRENT_ANALYSIS_VERSION is `version` (a new Runtime)."""
    configure_service(monkeypatch, database_url, CURRENT_ANALYSIS_VERSION=str(version))


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    current=st.integers(3, 6),
    late_version=st.integers(2, 4),
    late_success=st.booleans(),
    holder_version=st.integers(5, 6),
)
def test_a_tokenless_result_never_ends_the_token_holders_lease(
    client, sql, monkeypatch, database_url, current, late_version, late_success, holder_version
):
    """A stored analysis of version 5 and any setting; after a refetch a host claims the app
    and keeps its claim token. A result without a token under the shared password, of an
    older version (a late one, another host's), is refused; whatever the setting, the
    holder's token still works and its result is stored (a tokenless result cannot show it
    is the holder's, so it never ends the lease)."""
    sql.run("DELETE FROM app_analyses")
    sql.run("DELETE FROM apps")
    as_setting(monkeypatch, database_url, current)
    newer = {"success": True, "trackers": {"v5": 1}}
    insert_app(sql, "com.example.app", status="analysed", version=5, analysed=days_ago(400))
    sql.run("UPDATE apps SET analysis = CAST(:a AS jsonb)", a=json.dumps(newer))
    assert refetch("com.example.app") == "queued"
    token = claim(client, "com.example.app")
    base = "?appId=com.example.app&analysisVersion="
    if late_success:
        late = client.post(f"/uploadAnalysis{base}{late_version}", json={"v": 1}, headers=ANALYSER)
    else:
        headers = {**ANALYSER, "Content-Type": "text/plain"}
        late = client.post(
            f"/reportAnalysisFailure{base}{late_version}", content=b"usb", headers=headers
        )
    assert late.status_code == 409, late.text
    assert "its lease ended" not in late.json()["detail"]
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["claim_token"]) == ("processing", token)
    mine = {"success": True, "trackers": {"holder": holder_version}}
    headers = {**ANALYSER, "X-Analysis-Claim-Token": token}
    stored = client.post(f"/uploadAnalysis{base}{holder_version}", json=mine, headers=headers)
    assert stored.status_code == 200, stored.text
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysis"], row["analysisversion"]) == (
        "analysed",
        mine,
        holder_version,
    )


@pytest.mark.parametrize("later", [3, 4, 5])
def test_the_back_offs_failure_under_a_higher_setting_never_blocks_a_result(
    client, sql, monkeypatch, database_url, later
):
    """A process set to version 6 (a setting rolled back since, or a command run with
    another setting) backs an app off: its lease_expired failure carries version 6. It is
    no analysis, so it is never a newer result: an analyser of a lower version replaces
    it, with or without a token."""
    as_setting(monkeypatch, database_url, 6)
    insert_app(sql, "com.example.app")
    for _ in range(3):
        claim(client, "com.example.app")
        sql.run("UPDATE apps SET processing_started = processing_started - interval '3 hours'")
    promotion = handler.promote_due_apps(
        handler.api_connection(), handler.settings().policy, force=True
    )
    assert promotion.abandoned == 1
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["failure_reason"], row["analysisversion"]) == (
        "failed",
        "lease_expired",
        6,
    )
    as_setting(monkeypatch, database_url, later)
    assert refetch("com.example.app") == "queued"
    claim(client, "com.example.app")
    path = f"/uploadAnalysis?appId=com.example.app&analysisVersion={later}"
    answer = client.post(path, json={"success": True, "v": later}, headers=ANALYSER)
    assert answer.status_code == 200, answer.text
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysisversion"]) == ("analysed", later)


def test_the_back_offs_failure_is_given_back_as_lease_expired(sql):
    """The state an app goes back to when a lease ends over the back-off's failure (as
    BACK_OFF_APPLY writes it) is lease_expired, not the analysis_failed an analyser's
    unknown reason is classified as."""
    insert_app(sql, "com.example.app")
    record = {
        "success": False,
        "reason": "lease_expired",
        "retryable": True,
        "analysis_source": handler.SERVER_FAILURE_SOURCE,
        "logs": "no result after 3 leases in a row of 120 minutes each",
    }
    sql.run("UPDATE apps SET analysis = CAST(:a AS jsonb)", a=json.dumps(record))
    (parts,) = handler.api_connection().records(
        handler.STORED_RESULT_PARTS, appids=["com.example.app"]
    )
    assert handler.stored_result_state(parts) == handler.AnalysisState(
        "failed", "lease_expired", True
    )
    # An analyser's own record saying the same is its own text, classified as ever.
    sql.run("UPDATE apps SET analysed_by = 'pi-1'")
    (parts,) = handler.api_connection().records(
        handler.STORED_RESULT_PARTS, appids=["com.example.app"]
    )
    assert handler.stored_result_state(parts).failure_reason == handler.ANALYSIS_FAILED


@pytest.mark.parametrize("success", [True, False], ids=["an analysis", "a failure"])
@pytest.mark.parametrize("setting", [4, 6], ids=["the API's setting", "a higher setting"])
def test_the_holders_late_result_with_its_token_replaces_the_back_offs_failure(
    client, sql, monkeypatch, database_url, success, setting
):
    """The back-off's failure is the open claim's result, written without its token: the
    holder's own result, arriving after it with the token, is stored over it (as over any
    tokenless result of its claim), whatever setting the process that backed off had."""
    insert_app(sql, "com.example.app")
    token = claim(client, "com.example.app")
    sql.run("UPDATE apps SET lease_attempts = 3")
    sql.run("UPDATE apps SET processing_started = processing_started - interval '3 hours'")
    as_setting(monkeypatch, database_url, setting)
    promotion = handler.promote_due_apps(
        handler.api_connection(), handler.settings().policy, force=True
    )
    assert promotion.abandoned == 1
    as_setting(monkeypatch, database_url, 4)
    base = "?appId=com.example.app&analysisVersion=4"
    headers = {**ANALYSER, "X-Analysis-Claim-Token": token}
    if success:
        answer = client.post(f"/uploadAnalysis{base}", json={"success": True}, headers=headers)
    else:
        headers["Content-Type"] = "text/plain"
        answer = client.post(f"/reportAnalysisFailure{base}", content=b"usb", headers=headers)
    assert answer.status_code == 200, answer.text
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["analysisversion"]) == (
        ("analysed", 4) if success else ("failed", 4)
    )
    with_token = {**ANALYSER, "X-Analysis-Claim-Token": token}
    again = client.post(
        f"/uploadAnalysis{base}", json={"success": True, "other": 1}, headers=with_token
    )
    assert again.status_code == 409  # the claim's result is stored: it has had its answer
