"""`python handler.py serve` is fair: /queue is answered while large uploads are parsed
and stored (their blocking work runs on worker threads, each with its own connection),
and a client that trickles its request headers is cut off. Loopback only, bounded."""

from __future__ import annotations

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
from helpers import insert_app
from live import free_port

UPLOADS = 8
# Generous: an idle server answers /queue in milliseconds; behind 8 large uploads on the
# event loop it took many seconds.
QUEUE_BOUND_SECONDS = 10


@pytest.fixture
def served(database_url):
    """`handler.py serve` on a loopback port against the test database; its base URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "handler.py", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=handler.HERE,
        env={**os.environ, "DATABASE_URL": database_url},
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


def large_analysis() -> bytes:
    """About 4 MB of small nested arrays: slow to parse and check, as a large result is."""
    body = json.dumps({"success": True, "items": [[n % 10] for n in range(850_000)]})
    assert len(body) < handler.DEFAULT_MAX_BODY_BYTES
    return body.encode()


def test_queue_is_answered_while_large_uploads_are_in_flight(served, sql):
    for n in range(UPLOADS):
        # Failed, so a tokenless success is stored (docs/queue.md, "Results"); not a
        # candidate (current version, fresh), so /queue hands out com.example.next.
        insert_app(sql, f"up.{n}", status="failed", version=4, retryable=True)
        sql.run("UPDATE apps SET analysed = now() WHERE appid = :a", a=f"up.{n}")
    insert_app(sql, "com.example.next", reviews="5")
    body = large_analysis()
    finished: list[float] = []
    answers: list[int] = []

    def upload(n: int) -> None:
        answer = httpx.post(
            f"{served}/uploadAnalysis?appId=up.{n}&analysisVersion=4",
            content=body,
            headers={**ANALYSER, "Content-Type": "application/json"},
            timeout=120,
        )
        answers.append(answer.status_code)
        finished.append(time.monotonic())

    threads = [threading.Thread(target=upload, args=(n,)) for n in range(UPLOADS)]
    for thread in threads:
        thread.start()
    time.sleep(1)  # the uploads are sent and being worked on (sequencing, not a timing check)
    asked = time.monotonic()
    claimed = httpx.get(f"{served}/queue", headers=ANALYSER, timeout=120)
    answered = time.monotonic()
    in_flight = UPLOADS - len(finished)
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert (claimed.status_code, claimed.text) == (200, "com.example.next")
    assert answered - asked < QUEUE_BOUND_SECONDS, (answered - asked, finished)
    # An order, not a time: /queue went ahead of every upload. On the event loop it waited
    # for them (measured: 7.0 s, after the first two finished; off it, 0.6 s, before any).
    assert in_flight == UPLOADS, f"/queue waited for {UPLOADS - in_flight} upload(s)"
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
