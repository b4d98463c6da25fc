"""The local server as a developer runs it: `python handler.py serve` with nothing set."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import handler
from live import free_port


def test_serve_starts_an_embedded_postgres_and_migrates_when_nothing_is_set():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "DB_"))}
    for name in ("UPLOAD_PASSWORD", "ADMIN_TOKEN"):
        env.pop(name, None)
    server = subprocess.Popen(
        [sys.executable, str(handler.HERE / "handler.py"), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not answer within 90 s"
            time.sleep(0.3)
        admin = {"Authorization": "Bearer local-admin-token"}
        analyser = {"Authorization": "Bearer local-upload-password"}
        added = httpx.post(f"{base}/apps", json={"appId": "com.example.serve"}, headers=admin)
        assert added.status_code in (200, 201)
        claimed = httpx.get(f"{base}/queue?appId=com.example.serve", headers=analyser)
        assert claimed.status_code == 200
    finally:
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=30)
    assert "embedded PostgreSQL" in output
    assert "migrations applied" in output


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
    db = handler.Database(lambda: arguments)
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
