"""Every act is one act (docs/queue.md, "Every act is one act"): a change and its record,
a check and what it guards, in one transaction, on every route of the table.

The walks send a valid request for every route and every credential (tests/route_walk.py
builds them from the route tables, so a route added later is walked the day it is
added), each on a database reset to the same state, through handler.api as Lambda calls
it:

- the record's table locked past the service's lock timeout: an operator's write (any
  route but a GET that the admin token or the sign-in opens) answers 503 and changes
  nothing; without the lock it changes the database and writes its record; no other
  route is held up by it;
- the database gone before each unit of work a request does, in turn: a request
  answered 5xx changed nothing;
- the reply to each COMMIT lost once, in turn (the transaction committed, the service
  does not know): an operator's write answers as it does when nothing is lost, with one
  record, never two;
- a query parameter given twice: 400 and nothing changed; an answer of a route only the
  admin token opens: no-store.

Each walk is shown catching a probe route that breaks its rule. The classes' own tests
follow: the sign-in limit under bursts of guesses, a sign-out with a bearer token beside
the cookie, a client's document that claims the service's own analysis_source.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlencode

import pg8000.native
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN, ADMIN_TOKEN, ANALYSER, TableReset, configure_service
from route_walk import APP_ID, Call, Values, calls_for, routes_walked

import handler
from helpers import (
    LambdaContext,
    connect,
    database_at,
    gateway_event,
    insert_app,
    lock_waiters,
)

# The walks reset their database between requests with TRUNCATE, a change of catalogs.
pytestmark = pytest.mark.private_database

# The service's lock timeout in these walks: a lock the walk holds throughout is waited
# for this long, then refused (the walk never lets go of it in between).
LOCK_TIMEOUT_MS = "50"


def who(call: Call) -> str:
    return call.label.rsplit(" (", 1)[1].rstrip(")")


# The walk's credentials of the admin routes: the admin token, and a named operator's.
ADMIN_CREDENTIALS = ("admin", "named operator")


def operator_write(call: Call) -> bool:
    """An operator's action: a write an operator's credential opens (the admin API, the
    web view's JSON), or a sign-in (anyone may try one: it is recorded either way)."""
    signs_in = call.method == "POST" and call.path == "/admin/login"
    return call.method not in ("GET", "HEAD") and (who(call) in ADMIN_CREDENTIALS or signs_in)


def send(call: Call, query: str | None = None) -> dict:
    headers = {name.lower(): value for name, value in call.headers.items()}
    query = urlencode(call.params) if query is None else query
    event = gateway_event(call.method, call.path, query, headers, call.body, base64_body=True)
    return handler.api(event, LambdaContext("analysis-queue-ApiFunction"))


def everything(sql) -> dict[str, list]:
    """Every row of every table the service writes, to tell whether a request changed
    anything."""
    tables = sql.run(
        "SELECT oid::regclass::text FROM pg_class WHERE relkind = 'r'"
        " AND relnamespace = current_schema()::regnamespace AND relname <> 'schema_migrations'"
    )
    return {t: sql.run(f"SELECT t::text FROM {t} t ORDER BY 1") for (t,) in tables}


def requests_own(rows: dict[str, list]) -> dict[str, list]:
    """What a request's own act may change: not queue_policy, where the promoter, which
    a claim runs on its way (each of its passes an act of its own, committed), records
    the policy in force (docs/queue.md, "The promoter")."""
    return {table: rows[table] for table in rows if table != "queue_policy"}


def records(sql) -> int:
    ((count,),) = sql.run("SELECT count(*) FROM operator_actions")
    return count


def hold_the_app(sql, call: Call) -> None:
    sql.run("UPDATE apps SET held_at = now(), held_by = 'walk' WHERE appid = :a", a=APP_ID)


def pause_the_queue(sql, call: Call) -> None:
    sql.run("UPDATE queue_pause SET paused_at = now(), paused_by = 'walk'")


def pause_its_analyser(sql, call: Call) -> None:
    name = call.path.split("/")[-2]  # .../analysers/{name}/resume
    sql.run("UPDATE analysers SET paused_at = now(), paused_by = 'walk' WHERE name = :n", n=name)


# What a route needs in the database to have an act to do: a release, a held app; a
# resume, a paused analyser or queue. (Asked of what is as asked already, each changes
# nothing and records nothing, as a revoked analyser's second revocation does.)
ARRANGED = {
    "POST /apps/{appId}/release": hold_the_app,
    "POST /admin/api/apps/{appId}/release": hold_the_app,
    "POST /queue/resume": pause_the_queue,
    "POST /admin/api/queue/resume": pause_the_queue,
    "POST /analysers/{name}/resume": pause_its_analyser,
    "POST /admin/api/analysers/{name}/resume": pause_its_analyser,
}


class Walk:
    """The calls of a route table, each on the database as it was when the walk began
    (reset between calls) with an app, a named analyser and a session, and what the
    call's route needs (ARRANGED): `each()` yields (call, before) with `before` read
    after the call was built (building one signs in) and its route's state arranged."""

    def __init__(self, sql, app: FastAPI = handler.app):
        self.sql, self.app = sql, app
        self.reset = TableReset(sql.run)
        self.labels = [call.label for call in self.calls()]
        assert set(ARRANGED) <= routes_walked(self.calls())  # none arranged in vain

    def calls(self) -> list[Call]:
        self.reset.apply(self.sql.run)
        insert_app(self.sql, APP_ID)
        return calls_for(self.app, Values(self.sql))

    def call(self, label: str) -> tuple[Call, dict[str, list]]:
        (call,) = [call for call in self.calls() if call.label == label]
        arrange = ARRANGED.get(label.split(" (")[0])
        if arrange is not None:
            arrange(self.sql, call)
        return call, everything(self.sql)

    def each(self) -> Iterator[tuple[Call, dict[str, list]]]:
        for label in self.labels:
            yield self.call(label)


@pytest.fixture
def walked(database_url, sql, monkeypatch) -> Walk:
    configure_service(monkeypatch, database_url, ADMIN_WEB="full", LOCK_TIMEOUT_MS=LOCK_TIMEOUT_MS)
    assert handler.runtime().worker_pool() is None  # a Lambda container's Runtime
    return Walk(sql)


@contextlib.contextmanager
def audit_table_locked(url: str) -> Iterator[None]:
    """operator_actions locked against writes (SHARE: reads go on) until the block ends."""
    holder = connect(url)
    try:
        holder.run("BEGIN")
        holder.run("LOCK TABLE operator_actions IN SHARE MODE")
        yield
    finally:
        holder.run("ROLLBACK")
        holder.close()


# --- (a) a change and its record: together or not at all ------------------------------


def walk_with_the_record_refused(walk: Walk, url: str) -> list[str]:
    problems, answered = [], {}
    for call, _ in walk.each():
        written = records(walk.sql)
        answered[call.label] = status = send(call)["statusCode"]
        if operator_write(call) and (status >= 400 or records(walk.sql) == written):
            problems.append(f"{call.label}: {status} without a new record")
    for call, before in walk.each():
        with audit_table_locked(url):
            status = send(call)["statusCode"]
        changed = everything(walk.sql) != before
        if operator_write(call) and (status != 503 or changed):
            problems.append(f"{call.label}: with its record refused, {status}, changed {changed}")
        elif not operator_write(call) and status != answered[call.label]:
            problems.append(f"{call.label}: held up by the record's table: {status}")
    return problems


def test_an_operator_action_and_its_record_commit_together_or_not_at_all(walked, database_url):
    writes = {label for label in walked.labels if label.startswith(("POST", "DELETE"))}
    assert len(writes) >= 9  # the walk reaches the operators' writes
    assert walk_with_the_record_refused(walked, database_url) == []


class Faults:
    """Counts the service's units of database work (every SharedConnection.transaction
    and autocommit: run and records go through it) and makes the `armed`-th find the
    database gone, as a connection lost twice over would."""

    def __init__(self, monkeypatch):
        self.seen, self.armed = 0, 0
        for name in ("transaction", "autocommit"):
            real = getattr(handler.SharedConnection, name)
            monkeypatch.setattr(handler.SharedConnection, name, self._unit(real))

    def _unit(self, real: Callable) -> Callable:
        def unit(connection, work):
            self.seen += 1
            if self.seen == self.armed:
                raise handler.DatabaseUnavailable("the walk: the database went away")
            return real(connection, work)

        return unit

    def arm(self, armed: int) -> None:
        self.seen, self.armed = 0, armed


class LostCommitReplies:
    """The `armed`-th COMMIT a request sends commits, then its reply is lost: the
    connection breaks, as a network would break it after the server committed."""

    def __init__(self, monkeypatch):
        self.seen, self.armed = 0, 0
        real = handler.Session.execute

        def execute(session, sql):
            real(session, sql)
            if sql == "COMMIT":
                self.seen += 1
                if self.seen == self.armed:
                    session.close()
                    raise pg8000.native.InterfaceError("the walk: the COMMIT's reply was lost")

        monkeypatch.setattr(handler.Session, "execute", execute)

    def arm(self, armed: int) -> None:
        self.seen, self.armed = 0, armed


def each_fault(walk: Walk, label: str, fault: Faults | LostCommitReplies) -> Iterator[tuple]:
    """The call of `label` on a fresh database, sent with the fault at its first unit,
    then its second, ..., until it ends before the fault's turn: (the unit, the answer,
    the rows before it, the records before it)."""
    unit = 1
    while True:
        call, before = walk.call(label)
        written = records(walk.sql)
        fault.arm(unit)
        answer = send(call)
        reached = fault.seen >= unit
        fault.arm(0)
        yield unit, answer, before, written
        if not reached:
            return
        unit += 1


def walk_with_the_database_lost(walk: Walk, faults: Faults) -> list[str]:
    problems = []
    for label in walk.labels:
        for unit, answer, before, _ in each_fault(walk, label, faults):
            now = requests_own(everything(walk.sql))
            if answer["statusCode"] >= 500 and now != requests_own(before):
                problems.append(f"{label}: 5xx after unit {unit} failed, yet it changed")
    return problems


def test_a_request_answered_5xx_changed_nothing(walked, monkeypatch):
    assert walk_with_the_database_lost(walked, Faults(monkeypatch)) == []


def walk_with_commit_replies_lost(walk: Walk, lost: LostCommitReplies) -> list[str]:
    problems = []
    for label in walk.labels:
        call, _ = walk.call(label)
        if not operator_write(call):
            continue
        written = records(walk.sql)
        expected = send(call)["statusCode"], records(walk.sql) - written
        for commit, answer, _, written in each_fault(walk, label, lost):
            got = answer["statusCode"], records(walk.sql) - written
            if got != expected:
                problems.append(f"{label}: COMMIT {commit}'s reply lost: {got}, not {expected}")
    return problems


def test_an_operator_action_whose_commit_reply_is_lost_is_done_once(walked, monkeypatch):
    assert walk_with_commit_replies_lost(walked, LostCommitReplies(monkeypatch)) == []


def copy_with_a_probe(path: str) -> FastAPI:
    """handler.app's routes (the web view's dispatcher too) and one probe route more, an
    operator's write (admin token) that commits its change and its record apart."""
    copy = FastAPI(docs_url=None, redoc_url=None, redirect_slashes=False)
    copy.router.routes.extend(route for route in handler.app.routes if isinstance(route, APIRoute))
    copy.exception_handlers.update(handler.app.exception_handlers)

    @copy.post(path)
    async def apart(
        request: Request, operator: handler.Operator = Depends(handler.require_admin)
    ) -> JSONResponse:
        def work() -> None:
            db = handler.api_connection()
            db.run("UPDATE apps SET details = '{\"probe\": 1}' WHERE appid = :a", a=APP_ID)
            handler.act(db, operator, lambda session: (None, handler.ActionRecord("probe")))

        await handler.blocking(work)
        return JSONResponse({"done": True})

    return copy


def test_the_walks_catch_a_change_committed_apart_from_its_record(database_url, sql, monkeypatch):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full", LOCK_TIMEOUT_MS=LOCK_TIMEOUT_MS)
    monkeypatch.setattr(handler, "deployed_app", copy_with_a_probe("/probe/apart"))
    walk = Walk(sql, handler.deployed_app)
    assert "POST /probe/apart (admin)" in walk.labels
    problems = walk_with_the_record_refused(walk, database_url)
    assert problems == [
        f"POST /probe/apart ({who}): with its record refused, 503, changed True"
        for who in ADMIN_CREDENTIALS
    ]
    faults = Faults(monkeypatch)
    # Unit 1 checks the credential (the admin token's row, or the operator's), unit 2 is
    # the probe's change, unit 3 its record, which fails after the change committed.
    assert walk_with_the_database_lost(walk, faults) == [
        f"POST /probe/apart ({who}): 5xx after unit 3 failed, yet it changed"
        for who in ADMIN_CREDENTIALS
    ]


# --- one rule for every route: a repeated parameter; what only the admin token opens -----


def test_a_repeated_query_parameter_is_refused_on_every_route(walked):
    for call, before in walked.each():
        repeated = urlencode([*call.params.items(), ("appId", APP_ID), ("appId", APP_ID)])
        answer = send(call, query=repeated)
        assert answer["statusCode"] == 400, (call.label, answer)
        assert "appId given more than once" in answer["body"], call.label
        assert answer["headers"].get("cache-control") == "no-store", call.label  # an error
        assert everything(walked.sql) == before, call.label


def with_a_key_twice(body: bytes | None) -> bytes:
    """The JSON object `body` with its first key given again, another value last (a key
    of its own when it has none): `{"dryRun": true, ..., "dryRun": false}`."""
    sent = json.loads(body or b"{}")
    key, value = next(iter(sent.items()), ("x", True))
    pairs = [json.dumps(k) + ": " + json.dumps(v) for k, v in sent.items()]
    pairs = pairs or [json.dumps(key) + ": " + json.dumps(value)]
    other = json.dumps(key) + ": " + json.dumps(not value if isinstance(value, bool) else None)
    return ("{" + ", ".join([*pairs, other]) + "}").encode()


def test_a_key_given_twice_in_an_operators_body_is_refused_on_every_route(walked):
    """An operator's JSON body is never read as a key's first or last value: on every
    operator write that takes a JSON body, a key given twice is a 400 that changes
    nothing ({"dryRun": true, "dryRun": false} must not apply)."""
    tried = []
    for call, before in walked.each():
        json_body = call.headers.get("Content-Type") == "application/json"
        if not (operator_write(call) and json_body):
            continue
        call.body = with_a_key_twice(call.body)
        answer = send(call)
        assert answer["statusCode"] == 400, (call.label, answer)
        assert "more than once" in json.loads(answer["body"])["detail"], call.label
        assert everything(walked.sql) == before, call.label
        tried.append(call.label.split(" (")[0])
    # The web view's writes and the admin API's: every one that takes a body.
    assert {"POST /admin/api/refetch", "POST /apps", "POST /analysers"} <= set(tried)


def test_every_answer_only_the_admin_token_opens_is_kept_by_no_cache(walked):
    for call, _ in walked.each():
        if who(call) not in ADMIN_CREDENTIALS or call.path.startswith("/apps/"):
            continue  # GET /apps/{appId} is public, and says so for its admin answer
        answer = send(call)
        assert answer["statusCode"] < 400, (call.label, answer)
        assert answer["headers"].get("cache-control") == "no-store", call.label


# --- the sign-in limit: one decision with its record ----------------------------------


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    refused_before=st.integers(0, handler.SIGN_IN_REFUSALS_ALLOWED),
    guesses=st.integers(2, 16),
)
def test_a_burst_of_guesses_from_one_address_gets_no_more_tries_than_the_limit(
    database_url, sql, monkeypatch, refused_before, guesses
):
    """The guesses count and record while a writer holds the record's table, so each has
    read its count before any writes: counted apart from their records, every one would
    see the same count. Let go, they must still be decided one after another."""
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    source = "198.51.100.77"
    sql.run("SET session_replication_role = replica")  # empties the append-only record
    sql.run("DELETE FROM operator_actions")
    sql.run("SET session_replication_role = origin")
    for _ in range(refused_before):
        handler.sign_in(handler.api_connection(), "wrong", source)
    answers: list[int] = []
    lock = threading.Lock()

    def guess() -> None:
        db = database_at(database_url)
        try:
            db.transaction(lambda session: None)  # connected before the burst
            try:
                handler.sign_in(db, "a wrong guess", source)
                status = 401
            except handler.HTTPException as refusal:
                status = refusal.status_code
            with lock:
                answers.append(status)
        finally:
            db.discard()

    holder, watcher = connect(database_url), connect(database_url)
    threads = [threading.Thread(target=guess, daemon=True) for _ in range(guesses)]
    try:
        holder.run("BEGIN")
        holder.run("LOCK TABLE operator_actions IN SHARE MODE")
        for thread in threads:
            thread.start()
        # Every guess waits (on the table, or for its turn) or is answered already (429:
        # it writes nothing). Bounded: a guess that does neither fails the test.
        deadline = time.monotonic() + 60
        while lock_waiters(watcher) + len(answers) < guesses:
            assert time.monotonic() < deadline, "a guess neither waited nor ended"
            time.sleep(0.005)
        holder.run("ROLLBACK")
        for thread in threads:
            thread.join(60)
    finally:
        holder.close()
        watcher.close()
    tries = min(guesses, handler.SIGN_IN_REFUSALS_ALLOWED - refused_before)
    assert sorted(answers) == [401] * tries + [429] * (guesses - tries)
    ((refused,),) = sql.run(
        "SELECT count(*) FROM operator_actions WHERE action = 'sign-in refused' AND source = :s",
        s=source,
    )
    assert refused == refused_before + tries <= handler.SIGN_IN_REFUSALS_ALLOWED


# --- a sign-out says what it did ------------------------------------------------------


def test_a_sign_out_ends_the_cookies_session_whatever_else_authorised_it(walked):
    cookie = handler.sign_in(handler.api_connection(), ADMIN_TOKEN, "203.0.113.5")
    browser = {"Cookie": f"{handler.ADMIN_SESSION_COOKIE}={cookie}"}
    page = Call("GET /admin", "GET", "/admin", {}, browser, None, {"200"})
    assert send(page)["statusCode"] == 200
    both = {**browser, **ADMIN, "Content-Type": "application/json"}
    out = Call("sign-out", "POST", "/admin/logout", {}, both, b"{}", {"200"})
    answer = send(out)
    assert (answer["statusCode"], json.loads(answer["body"])) == (200, {"signedOut": True})
    assert send(page)["statusCode"] == 303  # the session is over: to the sign-in page
    written = records(walked.sql)
    again = send(out)  # its session ended already: it says it ended none, and records none
    assert (again["statusCode"], json.loads(again["body"])) == (200, {"signedOut": False})
    assert records(walked.sql) == written


# --- what only the service writes, no client may claim --------------------------------


@pytest.mark.parametrize("credential", ["shared password", "named analyser"])
def test_a_document_claiming_the_services_own_source_is_refused(walked, credential):
    token = handler.new_analyser_token()
    walked.sql.run(
        "INSERT INTO analysers (name, token_hash) VALUES ('pi-claims', :h)",
        h=handler.token_hash(token),
    )
    headers = ANALYSER if credential == "shared password" else {"Authorization": f"Bearer {token}"}
    claim = Call("claim", "GET", "/queue", {}, headers, None, {"200"})
    claimed = send(claim)
    assert claimed["statusCode"] == 200 and claimed["body"] == APP_ID
    claim_token = claimed["headers"][handler.CLAIM_TOKEN_HEADER.lower()]
    before = everything(walked.sql)
    document = {
        "success": False,
        "reason": "lease_expired",
        "retryable": True,
        "analysis_source": handler.SERVER_FAILURE_SOURCE,
    }
    upload = Call(
        "upload",
        "POST",
        "/uploadAnalysis",
        {"appId": APP_ID, "analysisVersion": "4"},
        {**headers, "Content-Type": "application/json", handler.CLAIM_TOKEN_HEADER: claim_token},
        json.dumps(document).encode(),
        {"400"},
    )
    answer = send(upload)
    assert answer["statusCode"] == 400, answer
    assert "queue server's own" in json.loads(answer["body"])["detail"]
    assert everything(walked.sql) == before
    document["analysis_source"] = "trackerscan-ios"  # the analyser's own: stored
    upload.body = json.dumps(document).encode()
    assert send(upload)["statusCode"] == 200


@pytest.mark.parametrize(("mode", "status"), [("off", 404), ("full", 401)])
def test_the_web_views_own_door_answers_before_the_query_rule(
    mode, status, database_url, monkeypatch
):
    """Under /admin the query rule comes after ADMIN_WEB and the route's guard, with the
    web view's headers: off, every path is 404 as an unknown one; unsigned, 401."""
    configure_service(monkeypatch, database_url, ADMIN_WEB=mode)
    repeated = Call("repeated", "GET", "/admin/api/status", {}, {}, None, {str(status)})
    answer = send(repeated, query="x=1&x=2")
    assert answer["statusCode"] == status, answer
    assert answer["headers"]["x-frame-options"] == "DENY"
