"""`python3 handler.py serve` is fair: /queue is answered while large uploads are in flight
(their blocking work runs on worker threads, each with its own connection), and a client
that trickles its request headers is cut off. Loopback only, bounded. Orders, not times:
how long /queue took behind the uploads is a row of docs/benchmarks.md's figures."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from kit import ANALYSER

import handler
from helpers import connect, insert_app
from live import free_port

# Each waiting upload holds one of serve's worker threads: /queue gets the one left.
UPLOADS = handler.SERVE_WORKER_THREADS - 1
# Bounds for a failure to show, never reached when serve is fair: the uploads reach the
# database within seconds, and /queue is answered in milliseconds.
REACH_SECONDS = 120
QUEUE_TIMEOUT_SECONDS = 60


@contextlib.contextmanager
def serving(database_url: str, **variables: str):
    """`handler.py serve` on a loopback port against the test database (with `variables`
    set); its base URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "handler.py", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=handler.HERE,
        env={**os.environ, "DATABASE_URL": database_url, **variables},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            if server.poll() is not None:
                raise AssertionError(server.stderr.read())
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not answer within 60 s"
            time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        try:
            server.communicate(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(30)


@pytest.fixture
def served(database_url):
    with serving(database_url) as base:
        yield base


def large_analysis() -> bytes:
    """About 4 MB of small nested arrays: slow to parse and check, as a large result is."""
    body = json.dumps({"success": True, "items": [[n % 10] for n in range(850_000)]})
    assert len(body) < handler.DEFAULT_MAX_BODY_BYTES
    return body.encode()


def waiting_for_a_lock(sql) -> int:
    """The sessions of this database that wait for a lock."""
    ((count,),) = sql.run(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    return count


@pytest.mark.slow  # ~20 s
def test_queue_is_answered_while_large_uploads_are_in_flight(database_url, sql):
    """The test holds the uploads' rows locked, so each upload stays in flight (its body
    parsed, its UPDATE waiting) until the test lets go: /queue must be answered before
    that. With the work on the event loop, the first waiting upload held up every other
    request: no second upload reached the database, and /queue was not answered."""
    for n in range(UPLOADS):
        # Failed, so a tokenless success is stored (docs/queue.md, "Results"); not a
        # candidate (current version, fresh), so /queue hands out com.example.next.
        insert_app(sql, f"up.{n}", status="failed", version=4, retryable=True)
        sql.run("UPDATE apps SET analysed = now() WHERE appid = :a", a=f"up.{n}")
    insert_app(sql, "com.example.next", reviews="5")
    body = large_analysis()
    answers: list[int] = []

    def upload(n: int) -> None:
        answer = httpx.post(
            f"{base}/uploadAnalysis?appId=up.{n}&analysisVersion=4",
            content=body,
            headers={**ANALYSER, "Content-Type": "application/json"},
            timeout=REACH_SECONDS + QUEUE_TIMEOUT_SECONDS + 60,
        )
        answers.append(answer.status_code)

    # Locks are waited for as long as the test holds them, not LOCK_TIMEOUT_MS's 1 s.
    patient = {"LOCK_TIMEOUT_MS": "600000", "STATEMENT_TIMEOUT_MS": "900000"}
    holder = connect(database_url)
    with serving(database_url, **patient) as base:
        threads = [threading.Thread(target=upload, args=(n,)) for n in range(UPLOADS)]
        try:
            holder.run("BEGIN")
            holder.run("SELECT appid FROM apps WHERE appid LIKE 'up.%' FOR UPDATE")
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + REACH_SECONDS
            while (reached := waiting_for_a_lock(sql)) < UPLOADS:
                assert time.monotonic() < deadline, (
                    f"{reached} of {UPLOADS} uploads reached the database (answered: {answers})"
                )
                time.sleep(0.1)
            try:
                claimed = httpx.get(
                    f"{base}/queue", headers=ANALYSER, timeout=QUEUE_TIMEOUT_SECONDS
                )
            except httpx.TimeoutException:
                raise AssertionError(
                    "/queue was not answered while uploads were in flight"
                ) from None
            # Still in flight: none could finish while the test held the rows.
            assert waiting_for_a_lock(sql) == UPLOADS and answers == []
            assert (claimed.status_code, claimed.text) == (200, "com.example.next")
        finally:
            holder.close()  # the uploads go on
            for thread in threads:
                if thread.ident is not None:  # started
                    thread.join(timeout=REACH_SECONDS + QUEUE_TIMEOUT_SECONDS + 60)
    assert not any(thread.is_alive() for thread in threads)
    assert answers == [200] * UPLOADS


def test_a_client_that_trickles_its_headers_is_cut_off(served):
    port = int(served.rsplit(":", 1)[1])
    started = time.monotonic()
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        for _ in range(4 * handler.SERVE_HEADER_SECONDS):  # bounded: one byte a second
            try:
                client.sendall(b"a")
            except OSError:  # reset: cut off
                closed = True
                break
            client.settimeout(1)
            try:
                if client.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
    assert closed, "the server kept a connection that trickled its headers"
    assert time.monotonic() - started < 4 * handler.SERVE_HEADER_SECONDS
    # A well-behaved client is served as before, and on a kept-alive connection too.
    with httpx.Client(base_url=served, timeout=10) as regular:
        assert regular.get("/healthz").status_code == 200
        assert regular.get("/ping", headers=ANALYSER).text == "online"
