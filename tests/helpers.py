"""The tests' kit: connections and the ledger, queue rows arranged directly in the
database, the Lambda entry points' events and contexts, the custom resource's ResponseURL,
log records, the CLI, and races of two operations interleaved by a lock. (The databases
themselves are in kit.py; the fixtures in conftest.py.)"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.server
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pg8000.native

import handler

EVENTS = handler.HERE / "events"
UNREACHABLE_DATABASE = "postgresql://postgres@127.0.0.1:9/unreachable"


# --- connections and the ledger -------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """url, naming database `name` instead."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def connect(url: str, application_name: str | None = None) -> pg8000.native.Connection:
    """A plain autocommit connection to url, for arranging and checking rows (the tests'
    only way to open one)."""
    config = handler.load_settings({"DATABASE_URL": url})
    return pg8000.native.Connection(
        **handler.connection_arguments(config), application_name=application_name
    )


def database_at(url: str) -> handler.SharedConnection:
    """handler's own SharedConnection on url (no timeouts): what the ledger runner, or a process
    of the service, uses."""
    return handler.SharedConnection(
        lambda: handler.connection_arguments(handler.load_settings({"DATABASE_URL": url}))
    )


def migrate(url: str, directory: Path | None = None) -> list[str]:
    """The ledger's files (sql/, or `directory`) applied to url; the files applied."""
    db = database_at(url)
    try:
        return handler.apply_migrations(db, directory=directory)
    finally:
        db.discard()


def ledger(database: str | pg8000.native.Connection) -> list:
    """The ledger's rows, [filename, checksum, applied_at], in filename order; `database`
    is a URL or an open connection."""
    query = "SELECT filename, checksum, applied_at FROM schema_migrations ORDER BY filename"
    if not isinstance(database, str):
        return database.run(query)
    connection = connect(database)
    try:
        return connection.run(query)
    finally:
        connection.close()


def record_in_ledger(sql, name: str) -> None:
    """A ledger row as the previous server wrote it: the file name alone, no checksum."""
    sql.run("INSERT INTO schema_migrations (filename) VALUES (:f)", f=name)


# Who the tests' own operator actions are recorded as.
TEST_OPERATOR = handler.Operator("tests", "pytest")


def refetch_apps(
    db: handler.SharedConnection,
    app_ids: list[str],
    apply: bool = True,
    policy: handler.QueuePolicy | None = None,
    force: bool = False,
) -> list[dict[str, str]]:
    """A refetch of the named apps run to the end, as `queue-refetch --appid` runs it
    (handler.refetch_in_batches with a RefetchRequest): the apps it selected, each
    {"appid", "status", "outcome"} (the status before; what happened or, in a dry run,
    would)."""
    request = handler.RefetchRequest(app_ids=tuple(app_ids), apply=apply, force=force)
    selected: list[dict[str, str]] = []
    handler.refetch_in_batches(
        db, request, lambda rows, _: selected.extend(rows), TEST_OPERATOR, policy=policy
    )
    return selected


def days_ago(days: float) -> datetime:
    return datetime.now(UTC) - timedelta(days=days)


def minutes_ago(minutes: float) -> datetime:
    return datetime.now(UTC) - timedelta(minutes=minutes)


def insert_app(
    sql,
    appid: str,
    *,
    status: str = "queued",
    reviews=None,
    added: datetime | None = None,
    analysed: datetime | None = None,
    version: int | None = None,
    processing_started: datetime | None = None,
    retryable: bool | None = None,
    reason: str | None = None,
    analysis=None,
    streak: int | None = None,
    held: bool = False,
    retry_due: bool = False,
) -> None:
    """One apps row in a given state, as the service would have left it. `streak` is
    its failures in a row (apps.failure_streak): by default a failed row is one failure
    (1), any other row none (0). `held`: an operator holds it (held_at); `retry_due`: the
    promoter's retry flag is set on it (whether or not the rule backs it)."""
    if streak is None:
        streak = 1 if status == "failed" else 0
    details = {"appId": appid, "title": appid}
    if reviews is not None:
        details["reviews"] = reviews
    if analysis is None and status == "analysed":
        analysis = {"success": True, "bundleID": appid, "trackers": {}}
    if analysis is None and status == "failed":
        analysis = {"success": False, "logs": "boom", "reason": reason, "retryable": retryable}
    if status == "failed" and reason is None:
        reason = "analysis_failed"
    sql.run(
        """INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added, status,
                             processing_started, failure_reason, failure_retryable,
                             failure_streak, held_at, retry_due)
           VALUES (:appid, CAST(:details AS jsonb), CAST(:analysis AS jsonb), :version,
                   :analysed, COALESCE(CAST(:added AS timestamptz), now()), :status,
                   :started, :reason, :retryable, :streak,
                   CASE WHEN :held THEN now() END, :retry_due)""",
        appid=appid,
        details=json.dumps(details),
        analysis=None if analysis is None else json.dumps(analysis),
        version=version,
        analysed=analysed,
        added=added,
        status=status,
        started=processing_started,
        reason=reason if status == "failed" else None,
        retryable=retryable if status == "failed" else None,
        streak=streak,
        held=held,
        retry_due=retry_due,
    )


# The states arrange() makes an app in.
ARRANGED_STATES = ("queued", "live lease", "expired lease", "analysed", "failed", "failed for good")


def arrange(sql, appid: str, state: str, reviews: int = 1) -> None:
    """An app in one of ARRANGED_STATES, of `reviews` popularity."""
    if state == "live lease":
        insert_app(sql, appid, status="processing", processing_started=minutes_ago(5))
    elif state == "expired lease":
        insert_app(sql, appid, status="processing", processing_started=minutes_ago(500))
    elif state == "analysed":
        insert_app(sql, appid, status="analysed", version=4, analysed=minutes_ago(60 * 24))
    elif state == "failed":
        insert_app(sql, appid, status="failed", retryable=True, version=4)
    elif state == "failed for good":
        insert_app(sql, appid, status="failed", retryable=False, reason="paid_app", version=4)
    else:
        insert_app(sql, appid)
    sql.run(
        "UPDATE apps SET details = details || jsonb_build_object('reviews', CAST(:r AS text))"
        " WHERE appid = :a",
        r=str(reviews),
        a=appid,
    )


def app_row(sql, appid: str) -> dict:
    columns = [
        "appid",
        "status",
        "analysis",
        "analysisversion",
        "analysed",
        "processing_started",
        "failure_reason",
        "failure_retryable",
        "claim_token",
        "due",
        "failure_streak",
        "retry_due",
        "held_at",
    ]
    # The service's claim token is apps.analysis_claim_token (uuid), compared as the text
    # the X-Analysis-Claim-Token header carries.
    selected = [
        "CAST(analysis_claim_token AS text)" if name == "claim_token" else name for name in columns
    ]
    rows = sql.run(f"SELECT {', '.join(selected)} FROM apps WHERE appid = :appid", appid=appid)
    return dict(zip(columns, rows[0], strict=True)) if rows else None


def history(sql, appid: str) -> list:
    return sql.run(
        "SELECT analysis, analysisversion, success FROM app_analyses WHERE appid = :appid"
        " ORDER BY id",
        appid=appid,
    )


def table_digest(sql) -> list:
    """Everything the API could change, to prove a rejected request changed nothing."""
    return [
        sql.run("SELECT * FROM apps ORDER BY appid"),
        sql.run("SELECT * FROM app_analyses ORDER BY id"),
        sql.run("SELECT analyser_id, pings FROM analyser_heartbeats ORDER BY analyser_id"),
    ]


# --- the oracle ----------------------------------------------------------------------
# The queue's candidate rule (docs/queue.md) written out in Python, evaluated on
# the rows themselves; whatever /queue hands out must be the first candidate in its order.


def popularity(details) -> int:
    reviews = (details or {}).get("reviews")
    if isinstance(reviews, bool) or reviews is None:
        return 0
    text = str(reviews)
    return int(text) if re.fullmatch(r"[0-9]+", text) else 0


def lease_expired(started: datetime | None, minutes: int, now: datetime) -> bool:
    """handler.lease_expired in Python: started more than a lease ago, never, or more than
    a lease ahead of now (a foreign write)."""
    lease = timedelta(minutes=minutes)
    return started is None or started < now - lease or started > now + lease


def is_candidate(row: dict, policy: handler.QueuePolicy, now: datetime) -> bool:
    """handler.CANDIDATE in Python: whether a claim may hand the row out by the rule's
    upper tiers (queued, an expired lease, an outdated or stale result). A held app
    (held_at) is none, by any rule."""
    if row.get("held_at") is not None:
        return False
    status = row["status"]
    if status == "queued":
        return True
    lease_ago = now - timedelta(minutes=policy.processing_timeout_minutes)
    if status == "processing":
        expired = lease_expired(row["processing_started"], policy.processing_timeout_minutes, now)
        return expired and row["lease_attempts"] < policy.max_lease_attempts
    eligible = status == "analysed" or (status == "failed" and row["failure_retryable"])
    if not eligible:
        return False
    analysed = row["analysed"]
    version = row["analysisversion"] or 0
    old_version = version < policy.analysis_version and (analysed is None or analysed < lease_ago)
    # A version above the current one is never stale (docs/queue.md, "The rule").
    stale = version <= policy.analysis_version and (
        analysed is None or analysed < now - timedelta(days=policy.stale_days)
    )
    return old_version or stale


def retry_time(
    streak: int, analysed: datetime | None, policy: handler.QueuePolicy
) -> datetime | None:
    """When a retryable failure, the `streak`-th in a row, stored at `analysed`, may be
    retried (handler.RETRY_TIME): RETRY_BACKOFF's streak-th step after it; None when it
    never is by the back-off (RETRY_BACKOFF=off, past the last step, or no time stored).
    A failed row counted 0 (stored by a release that does not count) is a first failure
    (handler.FAILURES_IN_A_ROW)."""
    streak = max(streak, 1)
    if analysed is None or streak > len(policy.retry_backoff):
        return None
    return analysed + timedelta(seconds=policy.retry_backoff[streak - 1])


def is_due_retry(row: dict, policy: handler.QueuePolicy, now: datetime) -> bool:
    """handler.RETRY_DUE in Python: a retryable failure at the current version, not
    held, whose retry (retry_time) has come. The lowest tier: handed out only when no
    candidate (is_candidate) is."""
    if row.get("held_at") is not None:
        return False
    if row["status"] != "failed" or not row["failure_retryable"]:
        return False
    if (row["analysisversion"] or 0) != policy.analysis_version:
        return False
    due = retry_time(row["failure_streak"], row["analysed"], policy)
    return due is not None and due <= now


ORACLE_COLUMNS = [
    "appid",
    "details",
    "status",
    "processing_started",
    "failure_retryable",
    "analysisversion",
    "analysed",
    "added",
    "lease_attempts",
    "failure_streak",
    "held_at",
    "retry_due",
]


def oracle_tiers(
    sql, policy: handler.QueuePolicy, flagged_only: bool = False
) -> tuple[list[str], list[str]]:
    """(the candidates, the due retries), each in claim order. The due retries are
    those the promoter flagged (retry_due) when `flagged_only`, as a claim that runs no
    promotion (or a partial one) finds them; else every due retry, as a claim that runs
    a whole promotion does (it flags each retry due within its horizon)."""
    ((now,),) = sql.run("SELECT now()")
    rows = [
        dict(zip(ORACLE_COLUMNS, r, strict=True))
        for r in sql.run(f"SELECT {', '.join(ORACLE_COLUMNS)} FROM apps")
    ]

    def claim_order(chosen: list[dict]) -> list[str]:
        chosen.sort(key=lambda r: (-popularity(r["details"]), r["added"], r["appid"]))
        return [r["appid"] for r in chosen]

    candidates = [r for r in rows if is_candidate(r, policy, now)]
    retries = [
        r
        for r in rows
        if not is_candidate(r, policy, now)
        and is_due_retry(r, policy, now)
        and (r["retry_due"] or not flagged_only)
    ]
    return claim_order(candidates), claim_order(retries)


def oracle_order(sql, policy: handler.QueuePolicy, flagged_only: bool = False) -> list[str]:
    """What GET /queue hands out, in order: every candidate in claim order, then (the
    lowest tier, once no candidate is left) the due retries in claim order
    (oracle_tiers)."""
    candidates, retries = oracle_tiers(sql, policy, flagged_only)
    return candidates + retries


class OracleAtEachClaim:
    """The oracle as each claim of the service sees it: handler.promote_due_apps (which
    every claim runs first) wrapped so that, once it is done and just before the claim's
    own statement, oracle_order is read with the retry flags as they are then
    (flagged_only). `last` is the order the latest claim was to follow: exact whatever
    the promoter did (a partial pass included), where an oracle read before the claim
    cannot know which retries its promotion flags."""

    def __init__(self, sql, monkeypatch):
        self.sql = sql
        self.last: list[str] | None = None
        promote = handler.promote_due_apps

        def promote_then_read(db, policy, *args, **kwargs):
            done = promote(db, policy, *args, **kwargs)
            self.last = oracle_order(self.sql, policy, flagged_only=True)
            return done

        monkeypatch.setattr(handler, "promote_due_apps", promote_then_read)

    def expected(self) -> list[str]:
        """The latest claim's oracle, taken (so no claim is checked against another's)."""
        assert self.last is not None, "no claim ran a promotion"
        last, self.last = self.last, None
        return last


# --- the Lambda entry points: events, contexts, answers --------------------------------


def load_event(name: str) -> dict:
    """An event file of events/, parsed."""
    return json.loads((EVENTS / name).read_text())


def env_json(function: str) -> dict[str, str]:
    """events/env.json's variables for `function` (as `sam local --env-vars` reads them)."""
    return load_event("env.json")[function]


def LambdaContext(
    name: str = "analysis-queue-Function", remaining_ms: int = 600_000
) -> handler.LocalContext:
    """A Lambda context for function `name` with remaining_ms left."""
    return handler.LocalContext(remaining_ms / 1000, function_name=name)


def call_api(event: dict, function_name: str = "analysis-queue-ApiFunction") -> dict:
    """handler.api(event) as the ApiFunction's Lambda runtime calls it."""
    return handler.api(event, LambdaContext(function_name))


def invoke_api(name: str, headers: dict[str, str | None] | None = None) -> dict:
    """handler.api on the event file `name`, its headers updated with `headers` (a None
    value removes that header)."""
    event = load_event(name)
    merged = {**event["headers"], **(headers or {})}
    event["headers"] = {key: value for key, value in merged.items() if value is not None}
    return call_api(event)


def gateway_event(
    method: str,
    path: str,
    query: str = "",
    headers: dict[str, str] | None = None,
    body: bytes | str | None = None,
    base64_body: bool = False,
) -> dict:
    """An HTTP API (payload 2.0) event as API Gateway sends it to handler.api."""
    if isinstance(body, bytes):
        body = base64.b64encode(body).decode() if base64_body else body.decode("latin-1")
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": query,
        "headers": {"host": "api.example.com", **(headers or {})},
        "requestContext": {
            "http": {
                "method": method,
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": "203.0.113.9",
            },
            "requestId": "test",
            "stage": "$default",
        },
        "body": body,
        "isBase64Encoded": base64_body,
    }


def json_answer(answer: dict) -> object:
    """The body of an API answer that must be JSON, parsed."""
    assert answer["headers"]["content-type"] == "application/json"
    assert answer["isBase64Encoded"] is False
    assert int(answer["headers"]["content-length"]) == len(answer["body"].encode())
    return json.loads(answer["body"])


def text_answer(answer: dict) -> str:
    """The body of an API answer that must be plain text."""
    assert answer["headers"]["content-type"] == "text/plain; charset=utf-8"
    assert answer["isBase64Encoded"] is False
    return answer["body"]


# --- the custom resource: a stand-in for CloudFormation's ResponseURL ------------------


class ResponseURL:
    """A local HTTP server standing in for CloudFormation's pre-signed S3 URL: records
    each PUT (path, Content-Type, body). Answers 503 to the first `fail_first` PUTs. It
    serves on 127.0.0.1 only and stops by itself after `lifetime` seconds."""

    def __init__(self, fail_first: int = 0, lifetime: float = 60.0):
        self.replies: list[tuple[str, str | None, bytes]] = []
        self.attempts = 0
        self._arrived = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.attempts += 1
                if outer.attempts <= fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                outer.replies.append((self.path, self.headers.get("Content-Type"), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                outer._arrived.set()

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self._server.timeout = 0.05
        self._stop = threading.Event()
        deadline = time.monotonic() + lifetime

        def serve() -> None:
            while not self._stop.is_set() and time.monotonic() < deadline:
                self._server.handle_request()
            self._server.server_close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/cfn-response/stack?X-Amz-Signature=abc123"

    def reply(self) -> dict:
        """The one reply received (JSON), checked for what CloudFormation requires."""
        assert self._arrived.wait(5), "no reply arrived"
        assert len(self.replies) == 1, self.replies
        path, content_type, body = self.replies[0]
        assert path == "/cfn-response/stack?X-Amz-Signature=abc123"
        assert content_type == ""  # a pre-signed S3 PUT is signed without one
        assert len(body) < 4096
        return json.loads(body)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def cfn_event(name: str, response: ResponseURL, **changes) -> dict:
    """The custom resource's event file `name`, answering `response`, with `changes`."""
    event = load_event(name)
    event["ResponseURL"] = response.url
    event.update(changes)
    return event


def invoke_migrate(event: dict, remaining_ms: int = 600_000) -> dict:
    """handler.migrate(event) as the MigrationFunction's Lambda runtime calls it."""
    return handler.migrate(event, LambdaContext("analysis-queue-MigrationFunction", remaining_ms))


# --- log records ---------------------------------------------------------------------


def json_lines(text: str, *, skip_other_lines: bool = False) -> list[dict]:
    """The JSON documents of `text`, one a line (log records on stderr, EMF documents on
    stdout). Every non-empty line must be one, unless skip_other_lines: then only lines
    opening with `{` are read."""
    if skip_other_lines:
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [json.loads(line) for line in text.splitlines() if line]


def output_records(captured) -> tuple[list[dict], list[dict]]:
    """(log records from stderr, EMF documents from stdout) of capsys' `captured`."""
    return json_lines(captured.err), json_lines(captured.out)


def one_record(records: list[dict], message: str) -> dict:
    """The one record whose message is `message`."""
    found = [record for record in records if record.get("message") == message]
    assert len(found) == 1, records
    return found[0]


# --- the CLI ---------------------------------------------------------------------------


def run_together(targets: list, timeout: float) -> None:
    """Run each callable on its own thread, all at once, and wait for every one; a thread
    still running after `timeout` seconds is a hang, and fails the test."""
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads)


def run_python(code: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in a fresh interpreter with env: a cold start, as Lambda's."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python3 handler.py ARGS` in its own process with env, as an operator runs it: for
    what needs a process of its own (a signal, an exit code by signal, the embedded
    PostgreSQL's lifecycle, a fresh import, a call from a thread). Otherwise call_cli,
    which answers the same without a second's import."""
    return subprocess.run(
        [sys.executable, str(handler.HERE / "handler.py"), *args],
        env=env,
        cwd=handler.HERE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# main() installs these; call_cli puts back the test process's own after each call.
CLI_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def call_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """handler.main(ARGS) in this process, answering as run_cli does (exit code, stdout,
    stderr): os.environ is exactly env and the working directory the repository's for the
    call, sys.argv handler.py's, stdin empty (not a terminal), stdout and stderr captured
    (the logger's lines too: handler's logger writes to sys.stderr as it is at each
    write), a SystemExit's code the exit code. Afterwards the environment, directory,
    argv, the SIGTERM and SIGHUP handlers main() installed and Powertools' parameter cache
    are as before, and the service's Runtime is built again at its next use. It needs a
    database named (DATABASE_URL or DB_HOST in env: without one, serve and invoke would
    start the embedded PostgreSQL in this process) and the main thread (signal handlers
    are set there only): otherwise, run_cli."""
    from aws_lambda_powertools.utilities import parameters

    assert threading.current_thread() is threading.main_thread(), "call_cli: use run_cli"
    assert env.get("DATABASE_URL") or env.get("DB_HOST"), "no database named: use run_cli"
    saved_env, saved_cwd, saved_argv, saved_stdin = (
        dict(os.environ),
        os.getcwd(),
        sys.argv,
        sys.stdin,
    )
    saved_signals = {number: signal.getsignal(number) for number in CLI_SIGNALS}
    out, err = io.StringIO(), io.StringIO()
    parameters.clear_caches()  # a new process has read no secret yet
    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(handler.HERE)
        sys.argv, sys.stdin = [str(handler.HERE / "handler.py"), *args], io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = handler.main(list(args))
            except SystemExit as exit_:
                if exit_.code is None or isinstance(exit_.code, int):
                    code = exit_.code or 0
                else:  # sys.exit("text"): Python prints it and exits 1
                    print(exit_.code, file=sys.stderr)
                    code = 1
    finally:
        handler.use_runtime(None)
        parameters.clear_caches()
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv, sys.stdin = saved_argv, saved_stdin
        for number, previous in saved_signals.items():
            signal.signal(number, previous)
    return subprocess.CompletedProcess(
        [sys.executable, "handler.py", *args], code, out.getvalue(), err.getvalue()
    )


# --- races: two operations at once, interleaved by a lock ------------------------------


@dataclasses.dataclass
class Outcome:
    """What one raced operation did: the value it returned, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None


def lock_waiters(watcher: pg8000.native.Connection) -> int:
    """How many client sessions of the watcher's database wait for a lock now."""
    ((count,),) = watcher.run(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND backend_type = 'client backend' AND wait_event_type = 'Lock'"
    )
    return count


def race(
    url: str,
    hold: Callable[[pg8000.native.Connection], Any],
    first: Callable[[], Any],
    second: Callable[[], Any],
    *,
    first_starts: bool = True,
    timeout: float = 60,
) -> tuple[Outcome, Outcome]:
    """first() and second() at once, each on a database connection of its own (they open
    or hold their own: two callables on one connection would wait in Python, not in
    PostgreSQL, and fail the round), in an order a lock decides, never a sleep: a third
    connection opens a transaction and runs hold(connection), which takes a lock both
    need (a row's FOR UPDATE; for a row not there yet, an INSERT of its key). The one that
    starts is seen waiting for that lock (or done, if it needed none) before the other
    starts and is seen the same; then the holder rolls back and the waiters go on in the
    order PostgreSQL queued them: a row lock's waiters in the order they came. (first's
    outcome, second's outcome). An operation that neither waits nor ends within `timeout`
    seconds fails the round."""
    holder, watcher = connect(url), connect(url)
    outcomes = (Outcome(), Outcome())

    def runner(work: Callable[[], Any], outcome: Outcome) -> threading.Thread:
        def target() -> None:
            try:
                outcome.value = work()
            except BaseException as error:  # the caller judges it
                outcome.error = error

        return threading.Thread(target=target, daemon=True)

    threads = [runner(first, outcomes[0]), runner(second, outcomes[1])]
    started: list[threading.Thread] = []
    try:
        holder.run("BEGIN")
        hold(holder)
        for thread in threads if first_starts else threads[::-1]:
            thread.start()
            started.append(thread)
            deadline = time.monotonic() + timeout
            # Every operation started and not done is waiting for a lock.
            while lock_waiters(watcher) < sum(t.is_alive() for t in started):
                assert time.monotonic() < deadline, "an operation neither waited nor ended"
                time.sleep(0.005)
        holder.run("ROLLBACK")
        for thread in threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in threads), "an operation hangs"
    finally:
        holder.close()
        watcher.close()
    return outcomes


def races(
    url: str,
    hold: Callable[[pg8000.native.Connection, int], Any],
    first: Callable[[int], Any],
    second: Callable[[int], Any],
    rounds: int,
    setup: Callable[[int], Any] | None = None,
) -> list[tuple[Outcome, Outcome]]:
    """race() `rounds` times, the first operation starting first in even rounds and the
    second in odd ones (so both queue orders are run); setup() before each round, hold()
    (with the holder's connection) and the operations get the round's number."""
    results = []
    for number in range(rounds):
        if setup is not None:
            setup(number)
        results.append(
            race(
                url,
                lambda connection, n=number: hold(connection, n),
                lambda n=number: first(n),
                lambda n=number: second(n),
                first_starts=number % 2 == 0,
            )
        )
    return results
