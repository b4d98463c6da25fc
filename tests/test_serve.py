"""The local server as a developer runs it: `python3 handler.py serve` with nothing set."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

import handler
from live import free_port


# A checkout of its own for each test (handler.py, sql/, web/, events/ in a temporary folder),
# so that its .local/pgdata is not the developer's; removed, with anything running in it
# stopped, whatever the test's outcome.
@pytest.fixture
def checkout():
    base = Path(tempfile.mkdtemp(prefix="queue-co-"))
    shutil.copy(handler.HERE / "handler.py", base)
    for folder in ("sql", "web", "events"):
        shutil.copytree(handler.HERE / folder, base / folder)
    try:
        yield base
    finally:
        pid = postmaster_pid(base)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGINT)  # a fast shutdown of a server a test left behind
            stopped(pid)
        shutil.rmtree(base, ignore_errors=True)


def postmaster_pid(checkout: Path) -> int | None:
    """The embedded PostgreSQL's pid, as its data directory records it; None if none."""
    pid_file = checkout / ".local" / "pgdata" / "postmaster.pid"
    if not pid_file.exists():
        return None
    return int(pid_file.read_text().splitlines()[0])


def users(checkout: Path) -> list[int]:
    """The pids of the processes using the checkout's embedded PostgreSQL."""
    return json.loads((checkout / ".local" / "pgdata" / ".handle_pids.json").read_text())


def unconfigured() -> dict[str, str]:
    """The environment of a newcomer's shell: no database, no tokens, and no session
    runtime directory (a container's shell has none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "DB_"))}
    for name in ("UPLOAD_PASSWORD", "ADMIN_TOKEN", "XDG_RUNTIME_DIR"):
        env.pop(name, None)
    return env


def command(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "handler.py", *args],
        cwd=checkout,
        env=unconfigured(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def start_serve(checkout: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "handler.py", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=checkout,
        env=unconfigured(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if server.poll() is not None:
            raise AssertionError(server.stdout.read())
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return server, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise AssertionError("serve did not answer within 90 s")
        time.sleep(0.3)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie has ended: its parent, here often the container's
    init, has just not collected it yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stopped(pid: int) -> bool:
    """Whether the process ends within 60 s (a PostgreSQL stops in well under one)."""
    deadline = time.monotonic() + 60
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(
    ("stop_with", "exit_code"), [(signal.SIGINT, 0), (signal.SIGTERM, 128 + signal.SIGTERM)]
)
def test_serve_shares_its_embedded_postgres_and_stops_it_on_a_signal(
    checkout, stop_with, exit_code
):
    server, base = start_serve(checkout)
    try:
        admin = {"Authorization": "Bearer local-admin-token"}
        analyser = {"Authorization": "Bearer local-upload-password"}
        added = httpx.post(f"{base}/apps", json={"appId": "com.example.serve"}, headers=admin)
        assert added.status_code in (200, 201)
        postgres = postmaster_pid(checkout)
        assert postgres is not None and users(checkout) == [server.pid]
        # Another command of the same checkout, while serve runs: the same server, which
        # it leaves running for serve.
        status = command(checkout, "queue-status")
        assert status.returncode == 0, status.stderr
        assert "com.example.serve" in status.stdout
        assert postmaster_pid(checkout) == postgres and alive(postgres)
        assert users(checkout) == [server.pid]
        claimed = httpx.get(f"{base}/queue?appId=com.example.serve", headers=analyser)
        assert (claimed.status_code, claimed.text) == (200, "com.example.serve")
    finally:
        server.send_signal(stop_with)
        try:
            output, _ = server.communicate(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(30)
    assert server.returncode == exit_code, output
    assert stopped(postgres), "the embedded PostgreSQL is still running"
    assert users(checkout) == []
    assert "embedded PostgreSQL" in output
    assert "migrations applied" in output
    assert "web view (ADMIN_WEB): off" in output
    assert "warning" not in (output + status.stderr).lower()
    assert "Traceback" not in output and "ERROR" not in output  # a clean stop, not a crash


def test_a_postgres_left_by_a_killed_serve_is_reused_then_stopped(checkout):
    server, _ = start_serve(checkout)
    try:
        postgres = postmaster_pid(checkout)
    finally:
        server.kill()  # a crash: no handler runs
        server.communicate(timeout=60)
    assert alive(postgres)  # left behind, still using the data directory
    assert users(checkout) == [server.pid]
    report = command(checkout, "priority-report")
    assert report.returncode == 0, report.stderr
    assert f"left running by process {server.pid}" in report.stderr
    assert "reusing it" in report.stderr
    # The next user found it, used it, and as its last live user stopped it.
    assert stopped(postgres), "the left-over PostgreSQL is still running"
    assert users(checkout) == []


def test_the_last_live_user_stops_the_postgres_when_another_was_killed_meanwhile(checkout):
    first, _ = start_serve(checkout)
    second = None
    try:
        postgres = postmaster_pid(checkout)
        second, _ = start_serve(checkout)  # a second terminal: the same server
        assert postmaster_pid(checkout) == postgres
        assert sorted(users(checkout)) == sorted([first.pid, second.pid])
    finally:
        first.kill()  # a crash while the second one runs
        first.communicate(timeout=60)
        if second is not None:
            second.send_signal(signal.SIGTERM)
            try:
                second.communicate(timeout=60)
            finally:
                if second.poll() is None:
                    second.kill()
                    second.wait(30)
    assert second.returncode == 128 + signal.SIGTERM
    assert stopped(postgres), "the embedded PostgreSQL is still running"
    assert users(checkout) == []


def test_every_command_uses_the_embedded_postgres_when_nothing_is_set(checkout):
    dry = command(checkout, "migrate", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "Pending: 000_apps.sql" in dry.stdout
    applied = command(checkout, "migrate")
    assert applied.returncode == 0, applied.stderr
    assert "Applied: 000_apps.sql" in applied.stdout
    again = command(checkout, "invoke", "migrate", "events/cfn-update.json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["Status"] == "SUCCESS"
    refetch = command(checkout, "queue-refetch", "--failed")
    assert refetch.returncode == 0, refetch.stderr
    assert "Would queue 0 apps for refetch" in refetch.stdout
    for done in (dry, applied, again, refetch):
        assert "embedded PostgreSQL" in done.stderr
        assert "warning" not in done.stderr.lower()
    assert postmaster_pid(checkout) is None or stopped(postmaster_pid(checkout))
    assert users(checkout) == []


class RefusesTls(threading.Thread):
    """A loopback PostgreSQL stand-in that answers an SSLRequest with 'N' (no TLS) and
    records whether the client went on in plaintext."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]
        self.plaintext = False

    def run(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except TimeoutError:
            return
        with connection:
            connection.settimeout(5)
            request = connection.recv(8)
            if request[4:8] == (80877103).to_bytes(4, "big"):  # SSLRequest
                connection.sendall(b"N")
                try:
                    self.plaintext = bool(connection.recv(1024))  # a startup message?
                except (TimeoutError, OSError):
                    pass
        self.listener.close()


@pytest.mark.parametrize("sslmode", ["verify-full", "require"])
def test_no_silent_plaintext_fallback(sslmode):
    server = RefusesTls()
    server.start()
    config = handler.load_settings(
        {"DATABASE_URL": f"postgresql://queue:pw@db.example:{server.port}/queue?sslmode={sslmode}"}
    )
    arguments = handler.connection_arguments(config)
    arguments["host"] = "127.0.0.1"  # reach the stand-in, keep the TLS settings
    db = handler.SharedConnection(lambda: arguments)
    with pytest.raises(handler.DatabaseUnavailable):
        db.run("SELECT 1")
    server.join(timeout=10)
    assert server.plaintext is False


def test_tls_settings():
    remote = handler.load_settings({"DATABASE_URL": "postgresql://u@db.example/q"})
    context = handler.connection_arguments(remote)["ssl_context"]
    assert context.check_hostname is True  # verify-full is the default off this machine
    local = handler.load_settings({"DATABASE_URL": "postgresql://u@127.0.0.1/q"})
    assert handler.connection_arguments(local)["ssl_context"] is None
    with pytest.raises(handler.ConfigError, match="does not exist"):
        handler.connection_arguments(
            handler.load_settings(
                {"DATABASE_URL": "postgresql://u@db.example/q?sslrootcert=/nonexistent.pem"}
            )
        )
    with pytest.raises(handler.ConfigError, match="sslmode"):
        handler.connection_arguments(
            handler.load_settings({"DATABASE_URL": "postgresql://u@db.example/q?sslmode=allow"})
        )
