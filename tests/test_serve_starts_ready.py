"""`serve` takes its first request ready, and keeps one connection per database thread.

Before it takes requests, serve starts its database threads, each connected, with the
public read's statements run and the claim parsed on its connection (handler.
start_serving_threads), so the first request of a new process costs what a later one does
(bench/claims.py's first_public_read_extra_ms). Its threads never end, so however the
requests come (bursts, pauses), it holds at most SERVE_WORKER_THREADS connections; and a
database that does not answer at start does not keep it from serving.
"""

from __future__ import annotations

import http.client
import threading

import pytest
from pg8000.native import to_statement

import handler
from live import serving


def _service_sessions(sql) -> int:
    ((count,),) = sql.run(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = :name",
        name=handler.SERVICE_NAME,
    )
    return count


def _on_every_thread(work) -> list:
    """work() once on each database thread (they wait for each other, so each runs one)."""
    threads = handler.SERVE_WORKER_THREADS
    together = threading.Barrier(threads)

    def each():
        together.wait(30)
        return work()

    pool = handler.runtime().worker_pool()
    return [job.result(60) for job in [pool.submit(each) for _ in range(threads)]]


def test_every_thread_is_connected_and_warm_before_the_first_request(database_url, sql):
    with serving(handler.app):
        assert _service_sessions(sql) == handler.SERVE_WORKER_THREADS
        prepared = _on_every_thread(
            lambda: handler.api_connection().run("SELECT statement FROM pg_prepared_statements")
        )
        for statements in prepared:
            texts = {row[0] for row in statements}
            for warmed in (handler.FIND_APP, handler.QUEUE_POSITION, handler.CLAIM_NEXT_APP):
                assert to_statement(warmed)[0] in texts
        # and the requests use those connections: none is opened for them
        assert _service_sessions(sql) == handler.SERVE_WORKER_THREADS


def _get(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_bursts_and_pauses_never_open_more_connections_than_threads(database_url, sql, monkeypatch):
    # anyio's threads (which served blocking work before) end after 10 s idle and their
    # connections stayed open; at 0 s every pause ends them. serve's own threads do not.
    from anyio._backends import _asyncio

    monkeypatch.setattr(_asyncio.WorkerThread, "MAX_IDLE_TIME", 0)
    with serving(handler.app) as server:
        for _burst in range(4):
            statuses: list[int] = []

            def client(answers: list[int] = statuses) -> None:
                answers.append(_get(server.port, "/apps/com.example.none"))

            clients = [
                threading.Thread(target=client) for _ in range(2 * handler.SERVE_WORKER_THREADS)
            ]
            for client in clients:
                client.start()
            for client in clients:
                client.join(60)
            assert statuses == [404] * len(clients)
            assert _service_sessions(sql) <= handler.SERVE_WORKER_THREADS


def serve_start_line(capsys) -> str:
    """What start_serving_threads said on stderr: one line."""
    handler.start_serving_threads()
    said = capsys.readouterr().err
    assert said.count("\n") == 1, said
    return said


def test_a_database_down_at_start_does_not_keep_serve_from_serving(
    database_url, monkeypatch, capsys
):
    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1:1/none")
    handler.use_runtime(handler.Runtime(handler.load_settings(), worker_threads=2))
    try:
        assert serve_start_line(capsys).startswith("serve: the database cannot serve yet: ")
    finally:
        handler.use_runtime(None)


def test_serve_on_an_unmigrated_database_says_to_migrate_in_one_line(
    databases, monkeypatch, capsys
):
    monkeypatch.setenv("DATABASE_URL", databases.create(migrated=False))
    handler.use_runtime(handler.Runtime(handler.load_settings(), worker_threads=2))
    try:
        line = serve_start_line(capsys)
    finally:
        handler.use_runtime(None)
    assert line.startswith("serve: the database cannot serve yet: ")
    assert "run `python3 handler.py migrate` first" in line
    assert "{" not in line  # the reason in words, not a raw error record


@pytest.mark.parametrize("threads", [1, 3])
def test_start_workers_warms_each_thread_once(database_url, threads):
    runtime = handler.use_runtime(handler.Runtime(handler.load_settings(), worker_threads=threads))
    warmed: list[str] = []
    lock = threading.Lock()

    def warm(db):
        with lock:
            warmed.append(threading.current_thread().name)

    try:
        runtime.start_workers(warm, 30)
        assert len(warmed) == len(set(warmed)) == threads
    finally:
        handler.use_runtime(None)
