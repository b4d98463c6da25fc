"""Deploys that cannot hang, and say why they failed.

The migration custom resource's FAILED reason, as CloudFormation shows it, carries the
root cause (connection refused, TLS verification failed, authentication failed, lock
timeout on file X) and never a secret; its reply cannot outlast the time it keeps back.
"""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
import time

import pg8000.native
import pytest
from kit import configure_service
from pg_password import PasswordServer

import handler
from helpers import LambdaContext, ResponseURL, cfn_event, connect, load_event

SECRET_PASSWORD = "pw-do-not-show-5d1c"


def failed_reason(event_name: str = "cfn-update.json") -> str:
    server = ResponseURL()
    try:
        handler.migrate(cfn_event(event_name, server), LambdaContext("analysis-queue-Migration"))
        reply = server.reply()
    finally:
        server.close()
    assert reply["Status"] == "FAILED", reply
    assert SECRET_PASSWORD not in reply["Reason"]
    return reply["Reason"]


def test_connection_refused(database_url, monkeypatch):
    configure_service(monkeypatch, f"postgresql://postgres:{SECRET_PASSWORD}@127.0.0.1:9/queue")
    assert failed_reason() == (
        "migration failed: cannot connect to the database at 127.0.0.1:9: connection refused"
    )


class UntrustedTls(threading.Thread):
    """A loopback stand-in for a database whose certificate the client does not trust:
    it accepts PostgreSQL's SSLRequest and presents a self-signed certificate."""

    def __init__(self, directory):
        super().__init__(daemon=True)
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "db.example")])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(1)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256())
        )
        (directory / "cert.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        (directory / "key.pem").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(20)
        self.port = self.listener.getsockname()[1]
        self.start()

    def run(self) -> None:
        try:
            connection, _ = self.listener.accept()
            with connection:
                connection.recv(8)  # SSLRequest
                connection.sendall(b"S")
                try:
                    self.context.wrap_socket(connection, server_side=True)
                except (ssl.SSLError, OSError):
                    pass  # the client refused the certificate
        finally:
            self.listener.close()


def test_tls_verification_failed(database_url, monkeypatch, tmp_path):
    server = UntrustedTls(tmp_path)
    configure_service(
        monkeypatch,
        f"postgresql://queue:{SECRET_PASSWORD}@127.0.0.1:{server.port}/queue?sslmode=verify-full",
    )
    reason = failed_reason()
    server.join(10)
    assert reason == (
        f"migration failed: cannot connect to the database at 127.0.0.1:{server.port}:"
        " TLS verification failed: self-signed certificate"
    )


@pytest.fixture(scope="module")
def password_server():
    server = PasswordServer()
    yield server
    server.stop()


def test_authentication_failed(password_server, database_url, monkeypatch):
    admin = connect(password_server.admin_url())
    role = "queue_deployer"
    try:
        admin.run(f"CREATE ROLE {role} LOGIN PASSWORD 'the-right-one'")
        configure_service(
            monkeypatch,
            f"postgresql://{role}:{SECRET_PASSWORD}@127.0.0.1:{password_server.port}/postgres",
        )
        reason = failed_reason()
    finally:
        admin.run(f"DROP ROLE {role}")
        admin.close()
    assert reason == (
        f"migration failed: cannot connect to the database at 127.0.0.1:{password_server.port}:"
        f' authentication failed (28P01: password authentication failed for user "{role}")'
    )


@pytest.mark.private_database  # migrates, with a file that alters apps
def test_lock_timeout_names_the_file(database_url, sql, monkeypatch, tmp_path):
    directory = tmp_path / "sql"
    directory.mkdir()
    for path in handler.SQL_DIR.glob("*.sql"):
        (directory / path.name).write_bytes(path.read_bytes())
    (directory / "900_add_column.sql").write_text("ALTER TABLE apps ADD COLUMN note text;\n")
    monkeypatch.setattr(handler, "SQL_DIR", directory)
    configure_service(monkeypatch, database_url, MIGRATION_LOCK_TIMEOUT="300ms")
    holder = connect(database_url)
    try:
        holder.run("BEGIN")
        holder.run("LOCK TABLE apps IN ACCESS SHARE MODE")  # a long read, say
        reason = failed_reason()
        holder.run("ROLLBACK")
    finally:
        holder.close()
    assert reason == (
        "migration failed: lock timeout on 900_add_column.sql: another session held a lock"
        " on its table longer than MIGRATION_LOCK_TIMEOUT; nothing of it was applied"
    )
    assert "note" not in [
        row[0]
        for row in sql.run(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'apps'"
        )
    ]


def test_misconfiguration_and_refusals_keep_their_words(database_url, monkeypatch):
    configure_service(monkeypatch, database_url, DB_SSLMODE="prefer")
    assert failed_reason().startswith("migration failed: misconfigured: DB_SSLMODE")


# ---------------------------------------------------------------------------------------
# The reply cannot outlast the time migrate keeps back.
# ---------------------------------------------------------------------------------------


def test_the_worst_case_fits_in_the_margin():
    worst = (
        handler.CFN_END_SESSION_SECONDS
        + handler.CFN_REPLY_ATTEMPTS * handler.CFN_REPLY_TIMEOUT_SECONDS
        + sum(handler.CFN_REPLY_PAUSES[: handler.CFN_REPLY_ATTEMPTS - 1])
    )
    assert worst <= handler.CFN_REPLY_MARGIN_SECONDS


class Dripping(threading.Thread):
    """A ResponseURL that accepts each PUT and then answers one byte at a time, slowly
    enough that no socket timeout ever fires: only a hard limit per attempt ends it."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        connections = []
        try:
            while not self.stop.is_set():
                try:
                    connection, _ = self.listener.accept()
                    self.accepted += 1
                    connections.append(connection)
                except TimeoutError:
                    pass
                for connection in connections:
                    try:
                        connection.sendall(b" ")
                    except OSError:
                        pass
        finally:
            for connection in connections:
                connection.close()
            self.listener.close()


@pytest.mark.no_database
def test_a_reply_that_never_completes_gives_up_within_the_limits(monkeypatch):
    monkeypatch.setattr(handler, "CFN_REPLY_TIMEOUT_SECONDS", 1)
    monkeypatch.setattr(handler, "CFN_REPLY_PAUSES", (0.1, 0.1))
    peer = Dripping()
    event = load_event("cfn-delete.json")
    event["ResponseURL"] = f"http://127.0.0.1:{peer.port}/cfn-response"
    started = time.monotonic()
    try:
        handler.migrate(event, LambdaContext("analysis-queue-Migration"))
        elapsed = time.monotonic() - started
    finally:
        peer.stop.set()
        peer.join(5)
    assert peer.accepted == handler.CFN_REPLY_ATTEMPTS
    # 3 attempts of 1 s and 0.2 s of pauses; the dripping peer would hold a socket
    # timeout off for ever, so without the hard limit this would not return at all.
    assert elapsed < 30


def test_pg8000_connection_errors_keep_their_cause():
    """_root_cause relies on pg8000 chaining the OS error it met."""
    with pytest.raises(pg8000.native.InterfaceError) as caught:
        pg8000.native.Connection(user="postgres", host="127.0.0.1", port=9, timeout=5)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
