"""The public answers agree with each other, whatever the caller sends and whatever state
the database is in: GET /apps/{appId} stays public under any Authorization and any
admin-token configuration; /healthz, and every other route, answer a database the ledger
has not reached with a reason (503), never a 500."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN, ADMIN_TOKEN, ANALYSER, UPLOAD_PASSWORD, configure_service

import handler
import legacy
from helpers import UNREACHABLE_DATABASE, call_api, connect, gateway_event, insert_app, migrate

pytestmark = pytest.mark.usefixtures("lambda_container")

PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
TOKENS = st.one_of(
    PRINTABLE,
    st.sampled_from(
        [ADMIN_TOKEN, UPLOAD_PASSWORD, "aqa_" + "x" * 43, "", " ", ADMIN_TOKEN + " ", "null"]
    ),
)
SCHEMES = st.sampled_from(["Bearer", "bearer", "BEARER", "Basic", "Token", "", "Bearer:"])


@st.composite
def authorization_values(draw) -> str:
    """One Authorization value: a bearer token, another scheme, a bare token or scheme,
    or several of them as API Gateway joins a header sent more than once (commas)."""
    parts = [
        f"{draw(SCHEMES)} {draw(TOKENS)}".strip()
        if draw(st.booleans())
        else draw(st.one_of(TOKENS, SCHEMES))
        for _ in range(draw(st.integers(1, 3)))
    ]
    return ", ".join(parts)


ADMIN_CONFIGURATIONS = ["admin token set", "admin token unset", "admin secret unreadable"]


@pytest.fixture(params=ADMIN_CONFIGURATIONS)
def admin_configuration(request, database_url, monkeypatch, aws):
    """The API with the admin token in the environment, with none at all, or in a
    Secrets Manager secret that cannot be read (moto has no such secret)."""
    if request.param == "admin token set":
        configure_service(monkeypatch, database_url)
    elif request.param == "admin token unset":
        configure_service(monkeypatch, database_url, ADMIN_TOKEN="")
    else:
        configure_service(
            monkeypatch, database_url, ADMIN_TOKEN="", ADMIN_TOKEN_SECRET="secretsmanager:gone"
        )
    return request.param


def get_app(headers: dict[str, str]) -> dict:
    return call_api(gateway_event("GET", "/apps/com.example.failed", headers=headers))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(authorization=authorization_values())
def test_get_app_is_public_under_any_authorization_and_configuration(
    admin_configuration, sql, authorization
):
    """The same request without a header gets the public answer; with any Authorization
    (any bearer, another scheme, a malformed or repeated header) it gets the same public
    answer, 200, under every admin-token configuration. Only the admin token itself, when
    the server has one, adds what operators see."""
    if not sql.run("SELECT 1 FROM apps"):
        insert_app(sql, "com.example.failed", status="failed", retryable=True, version=4)
    public = get_app({})
    assert public["statusCode"] == 200, public
    assert json.loads(public["body"])["analysis"] is None  # a failure record: admin only
    answer = get_app({"authorization": authorization})
    assert answer["statusCode"] == 200, (authorization, answer)
    scheme, _, token = authorization.partition(" ")
    is_admin_token = scheme.lower() == "bearer" and token.strip() == ADMIN_TOKEN
    if admin_configuration == "admin token set" and is_admin_token:
        assert json.loads(answer["body"])["analysis"] is not None
    else:
        assert answer["body"] == public["body"], authorization


def test_the_admin_token_still_opens_the_admin_view(database_url, sql):
    insert_app(sql, "com.example.failed", status="failed", retryable=True, version=4)
    for scheme in ("Bearer", "bearer"):
        answer = get_app({"authorization": f"{scheme} {ADMIN_TOKEN}"})
        view = json.loads(answer["body"])
        assert answer["statusCode"] == 200
        assert view["analysis"]["logs"] == "boom"
        assert "claimedBy" in view and "analysedBy" in view


def test_a_hold_a_pause_and_the_why_are_for_operators_only(database_url, sql):
    """An operator's hold (who, from where, why) and the queue's pause are the operators'
    business: the public answer is the same as before them and names neither; the admin
    token's answer says why the app is not handed out, its hold and the pause included."""
    insert_app(sql, "com.example.failed", status="failed", retryable=True, version=4)
    before = get_app({})
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    held = call_api(
        gateway_event(
            "POST",
            "/apps/com.example.failed/hold",
            headers={**admin, "content-type": "application/json"},
            body=json.dumps({"reason": "ticket 4711: legal asked"}).encode(),
        )
    )
    assert held["statusCode"] == 200, held
    sql.run("UPDATE queue_pause SET paused_at = now(), paused_by = 'ops', reason = 'db upgrade'")
    public = get_app({})
    assert public["body"] == before["body"]
    for private in ("4711", "203.0.113.9", "db upgrade", "why", "held"):
        assert private not in public["body"], private
    why = json.loads(get_app(admin)["body"])["why"]
    assert (why["candidate"], why["held"], why["hold"]["reason"]) == (
        False,
        "hold",
        "ticket 4711: legal asked",
    )
    assert "203.0.113.9" in why["hold"]["by"] and why["queuePaused"] is not None


@pytest.mark.parametrize("status", ["failed", "processing", "queued", "analysed"])
@pytest.mark.parametrize("success", [False, True])
def test_what_is_stored_decides_what_is_public_in_every_status(database_url, sql, status, success):
    """A stored failure record (the analyser's own log) is admin-only whatever the app's
    status: failed, claimed again for a retry (processing), queued again by a refetch, or
    in a row another program wrote (analysed); a stored success is public in each."""
    log = "login as someone@example.com password hunter2: usb error"
    if success:
        stored = {"success": True, "bundleID": "com.example.failed", "trackers": {}}
    else:
        stored = {"success": False, "logs": log, "reason": "analysis_failed", "retryable": True}
    insert_app(sql, "com.example.failed", status="failed", retryable=True, analysis=stored)
    sql.run(
        "UPDATE apps SET status = :status, processing_started = CASE :status"
        " WHEN 'processing' THEN now() END, failure_reason = CASE :status WHEN 'failed'"
        " THEN failure_reason END, failure_retryable = CASE :status WHEN 'failed'"
        " THEN failure_retryable END",
        status=status,
    )
    public = get_app({})
    assert public["statusCode"] == 200, public
    view = json.loads(public["body"])
    assert view["status"] == status
    assert view["analysis"] == (stored if success else None)
    assert "hunter2" not in public["body"]
    admin = json.loads(get_app({"authorization": f"Bearer {ADMIN_TOKEN}"})["body"])
    assert admin["analysis"] == stored


# --- every state the database can be in -------------------------------------------------

NAMED_TOKEN = {"Authorization": "Bearer aqa_" + "n" * 43}
ROUTES = [
    ("GET", "/ping", ANALYSER, None),
    ("GET", "/ping", NAMED_TOKEN, None),
    ("GET", "/queue", ANALYSER, None),
    ("GET", "/queue?appId=com.example.app", ANALYSER, None),
    (
        "POST",
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        {**ANALYSER, "Content-Type": "application/json"},
        b'{"success": true}',
    ),
    (
        "POST",
        "/reportAnalysisFailure?appId=com.example.app&analysisVersion=4",
        {**ANALYSER, "Content-Type": "text/plain"},
        b"usb error",
    ),
    (
        "POST",
        "/apps",
        {**ADMIN, "Content-Type": "application/json"},
        b'{"appId": "com.example.app", "details": {"reviews": "3"}}',
    ),
    ("GET", "/apps/com.example.app", {}, None),
    ("GET", "/apps/com.example.app", ADMIN, None),
    ("GET", "/healthz/analyser", {}, None),
    ("POST", "/analysers", {**ADMIN, "Content-Type": "application/json"}, b'{"name": "pi"}'),
    ("GET", "/analysers", ADMIN, None),
    ("POST", "/analysers/pi/rotate", ADMIN, None),
    ("DELETE", "/analysers/pi", ADMIN, None),
]


def every_route_answers_without_a_500(client, capsys) -> list[tuple[str, int]]:
    """Each route once: no 500, every 5xx a 503 that says why, and no traceback logged."""
    capsys.readouterr()
    answers = []
    for method, path, headers, body in ROUTES:
        answer = client.request(method, path, headers=headers, content=body)
        assert answer.status_code != 500, (method, path, answer.text)
        if answer.status_code >= 500:
            assert answer.status_code == 503, (method, path, answer.text)
            body = answer.json()
            # /healthz/analyser's 503 is its answer "no analyser online", which says so.
            assert body.get("detail") or body.get("status") == "offline", (method, path, body)
        answers.append((f"{method} {path}", answer.status_code))
    logged = capsys.readouterr().err
    assert "Traceback" not in logged
    assert "unhandled error" not in logged
    return answers


def healthz(client) -> dict:
    answer = client.get("/healthz")
    body = answer.json()
    assert answer.status_code == (200 if body["status"] == "ok" else 503), body
    assert body["version"] == handler.package_version()
    return body


def recorded_ledger(url: str) -> str | None:
    sql = connect(url)
    try:
        if sql.run("SELECT to_regclass('schema_migrations')") == [[None]]:
            return None
        ((last,),) = sql.run("SELECT max(filename) FROM schema_migrations")
        return last
    finally:
        sql.close()


def assert_not_migrated(client, url: str) -> None:
    body = healthz(client)
    assert body["status"] == "not migrated", body
    at = recorded_ledger(url)
    assert body["databaseLedger"] == at
    assert (at or "no ledger") in body["detail"]
    assert handler.ledger_file_names()[-1] in body["detail"]


@pytest.fixture
def service_on(monkeypatch):
    """A TestClient of the service configured for a database URL."""
    from fastapi.testclient import TestClient

    clients = []

    def serve(url: str):
        configure_service(monkeypatch, url)
        client = TestClient(handler.app, raise_server_exceptions=False)
        clients.append(client)
        return client

    yield serve
    handler.use_runtime(None)


def test_every_prefix_of_the_ledger_answers_not_migrated_never_500(
    empty_database, service_on, capsys
):
    """An empty database, then each prefix of the ledger applied in turn (a first deploy
    whose migration stopped at that file): /healthz says "not migrated" and names the last
    file the ledger records; no route answers 500 or logs a traceback. At the head of the
    ledger /healthz is ok."""
    client = service_on(empty_database)
    assert_not_migrated(client, empty_database)
    every_route_answers_without_a_500(client, capsys)
    for name in legacy.ALL_OUR_FILES[:-1]:
        migrate(empty_database, legacy._our_files_up_to(name[:3]))
        handler.use_runtime(None)
        client = service_on(empty_database)
        assert_not_migrated(client, empty_database)
        every_route_answers_without_a_500(client, capsys)
    migrate(empty_database)
    client = service_on(empty_database)
    assert healthz(client)["status"] == "ok"
    every_route_answers_without_a_500(client, capsys)


@pytest.mark.parametrize("state", legacy.STATES)
def test_a_database_another_program_left_answers_not_migrated_then_ok(
    empty_database, service_on, capsys, state
):
    """Each state the old server and this service's earlier releases left (tests/legacy.py):
    not migrated, with the file its ledger is at, and no 500 on any route; migrated, ok."""
    legacy.build(empty_database, state)
    client = service_on(empty_database)
    assert_not_migrated(client, empty_database)
    every_route_answers_without_a_500(client, capsys)
    migrate(empty_database)
    handler.use_runtime(None)
    assert healthz(service_on(empty_database))["status"] == "ok"


@pytest.mark.private_database  # the database's own setting
def test_a_read_only_database_says_so(database_url, service_on, sql, capsys):
    name = urlsplit(database_url).path[1:]
    sql.run(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    client = service_on(database_url)
    body = healthz(client)
    assert body["status"] == "unavailable"
    assert body["detail"] == "the database is read-only (a replica?)"
    every_route_answers_without_a_500(client, capsys)


@pytest.mark.parametrize("table", ["apps", "schema_migrations"])
def test_a_locked_table_answers_busy_within_the_lock_timeout(
    database_url, service_on, monkeypatch, table
):
    """A migration holding apps (its rewrite) or the ledger (adding its checksum column):
    /healthz answers 503 "busy" after LOCK_TIMEOUT_MS, never 500."""
    client = service_on(database_url)
    configure_service(monkeypatch, database_url, LOCK_TIMEOUT_MS="200")
    holder = connect(database_url)
    holder.run("BEGIN")
    holder.run(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    try:
        answer = client.get("/healthz")
    finally:
        holder.run("ROLLBACK")
        holder.close()
    assert answer.status_code == 503
    assert "busy" in answer.json()["detail"]
    assert healthz(client)["status"] == "ok"


def test_an_unreachable_database_says_so(service_on, capsys):
    client = service_on(UNREACHABLE_DATABASE)
    answer = client.get("/healthz")
    assert (answer.status_code, answer.json()) == (
        503,
        {"detail": "database unavailable, try again shortly"},
    )
    every_route_answers_without_a_500(client, capsys)


# --- a failure's reason: the service's, never the analyser's own text ------------------

ANALYSER_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
WRITTEN_REASONS = st.one_of(
    ANALYSER_TEXT,
    st.sampled_from(sorted(handler.FAILURE_REASONS)),
    st.sampled_from(["App Not Found", " paid_app", "lease_expired", "<script>", "x" * 5000]),
    st.none(),
    st.integers(),
    # Text PostgreSQL can store: a NUL anywhere in a document is refused (400) before any
    # reason is read (tests/test_hostile_input_changes_nothing.py).
    st.lists(st.text(st.characters(exclude_characters="\x00"), max_size=3), max_size=2),
)
appids = iter(f"com.example.reason{n}" for n in range(10**6))


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(reason=WRITTEN_REASONS, retryable=st.one_of(st.none(), st.booleans()), logs=ANALYSER_TEXT)
def test_the_public_failure_shows_the_classified_reason_never_the_analysers_text(
    database_url, sql, reason, retryable, logs
):
    """Whatever `reason` an analyser writes into a failed upload, the public answer (and
    the failure_reason column the website and the metrics read) holds one of the
    service's reasons: the analyser's if it names one it may, else analysis_failed.
    Whether a retry will come is its own `retryable`, else the reason's. The analyser's
    text is kept verbatim in the stored record, which only the admin view shows."""
    appid = next(appids)
    insert_app(sql, appid)
    payload = {"success": False, "logs": logs}
    if reason is not None:
        payload["reason"] = reason
    if retryable is not None:
        payload["retryable"] = retryable
    stored = call_api(
        gateway_event(
            "POST",
            "/uploadAnalysis",
            f"appId={appid}&analysisVersion=4",
            headers={
                "authorization": f"Bearer {UPLOAD_PASSWORD}",
                "content-type": "application/json",
            },
            body=json.dumps(payload).encode(),
        )
    )
    assert stored["statusCode"] == 200, stored
    written = reason if isinstance(reason, str) and reason else None
    if written is None:
        expected, _ = handler.classify_analysis_failure(logs)
    elif written in handler.FAILURE_REASONS - {"lease_expired"}:
        expected = written
    else:
        expected = "analysis_failed"
    will_retry = (
        retryable if retryable is not None else expected not in handler.NON_RETRYABLE_REASONS
    )
    public = json.loads(call_api(gateway_event("GET", f"/apps/{appid}"))["body"])
    assert public["failure"] == {"reason": expected, "retryable": will_retry}
    assert public["analysis"] is None
    assert sql.run(
        "SELECT failure_reason, failure_retryable FROM apps WHERE appid = :a", a=appid
    ) == [[expected, will_retry]]
    admin = json.loads(
        call_api(
            gateway_event(
                "GET", f"/apps/{appid}", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
            )
        )["body"]
    )
    assert admin["failure"] == public["failure"]
    assert admin["analysis"] == payload  # the analyser's own words, for the operators


@pytest.mark.parametrize(
    "legacy_reason", ["device offline: see /var/log/pi7", "", "lease_expired", None]
)
def test_a_row_holding_an_analysers_own_reason_shows_a_classified_one(
    database_url, sql, legacy_reason
):
    """A failure written before reasons were classified (or by the old server, or the
    previous release during a deploy) may hold an analyser's text in failure_reason: the
    public answer shows analysis_failed instead; the service's reasons, and none, as
    they are."""
    insert_app(sql, "com.example.legacy", status="failed", retryable=True, version=4)
    sql.run("UPDATE apps SET failure_reason = :r", r=legacy_reason)
    public = json.loads(call_api(gateway_event("GET", "/apps/com.example.legacy"))["body"])
    expected = legacy_reason if legacy_reason in (None, "lease_expired") else "analysis_failed"
    assert public["failure"] == {"reason": expected, "retryable": True}
