"""IAM authentication to the database (DB_USER), tested as far as this machine allows.

What is shown here:

* the token `handler.iam_auth_token` makes is boto3's `generate_db_auth_token`, byte for
  byte, for moto's fake credentials with and without a session token (a long one with
  `/`, `+` and `=` included), user names that need percent-encoding, a cluster's host and
  an RDS Proxy's, two ports and two regions; its shape (`host:port/?Action=connect&DBUser=`,
  15 minutes, a credential scope for `rds-db` in the region on the signing day); and every
  signer input changes it;
* making it, and `connection_arguments` with DB_USER, opens no socket and imports neither
  boto3 nor botocore's signer;
* the settings that cannot work are refused, naming the variable;
* the plumbing: `connection_arguments` with DB_USER logs in to a PostgreSQL of this
  file's own over TLS (verify-full, against a CA made here) with the token as the
  password, as DB_USER, or as DB_MIGRATION_USER for the migrations (`owner=True`); a
  token other than the one made for that user, host, port and time is refused; so is a
  certificate, from the trusted CA, for another host name.

What only a real account can show: that RDS or RDS Proxy takes the token, i.e. that the
role's credentials, its `rds-db:connect` grant and the database user's `rds_iam` role add
up. A local server cannot verify an IAM token: here the token is simply the role's
password, checked by SCRAM-SHA-256, where RDS asks for it in cleartext over TLS and has
IAM check its signature.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import pwd
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import unquote

import pg8000.exceptions
import pg8000.native
import pytest
from kit import ROOT

import handler
from live import free_port

# moto's conventional fake credentials (its `aws` fixture in conftest.py sets the same).
MOTO_KEY_ID = MOTO_SECRET = MOTO_SESSION_TOKEN = "testing"
# An STS session token as long as a real one, with every character of base64's alphabet
# that a query string must percent-encode.
LONG_SESSION_TOKEN = (
    "IQoJb3JpZ2luX2VjE"
    + base64.b64encode(
        b"".join(hashlib.sha512(bytes([n])).digest() for n in range(16))[:767]
    ).decode()
)
SESSION_TOKENS = {"none": None, "moto's": MOTO_SESSION_TOKEN, "a long one": LONG_SESSION_TOKEN}

HOSTS = (
    "queue.cluster-c9akciq32lce.eu-west-1.rds.amazonaws.com",
    "queue-proxy.proxy-c9akciq32lce.eu-west-1.rds.amazonaws.com",
)
PORTS = (5432, 6543)
REGIONS = ("eu-west-1", "us-east-1")
USERS = ("queue_api", "queue api", "dé jà vu", "a+b/c=d&e?f", "100%_sure@example.com")

SIGNED_AT = datetime(2026, 12, 4, 9, 30, 15, tzinfo=UTC)


# --- credentials and tokens ---------------------------------------------------------------


def use_credentials(monkeypatch, session_token: str | None, region: str = "eu-west-1") -> None:
    """moto's fake credentials in the environment, where Lambda puts a role's; no profile
    or config file that boto3 could read instead."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOTO_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOTO_SECRET)
    monkeypatch.setenv("AWS_REGION", region)
    if session_token:
        monkeypatch.setenv("AWS_SESSION_TOKEN", session_token)


def identity_in(region: str) -> handler.AwsIdentity:
    """The identity handler.aws_identity reads from the environment, in `region`."""
    return handler.aws_identity({**os.environ, "AWS_REGION": region})


def query_fields(token: str) -> list[tuple[str, str]]:
    """The token's query string as (name, decoded value) pairs, in order."""
    _, _, query = token.partition("/?")
    return [tuple(unquote(part) for part in pair.split("=", 1)) for pair in query.split("&")]


def signing_time(token: str) -> datetime:
    stamp = dict(query_fields(token))["X-Amz-Date"]
    return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)


# --- the token against boto3's --------------------------------------------------------------


@pytest.mark.no_database
@pytest.mark.parametrize("session_token", SESSION_TOKENS.values(), ids=SESSION_TOKENS.keys())
def test_the_token_is_boto3s_byte_for_byte(monkeypatch, session_token):
    import boto3

    use_credentials(monkeypatch, session_token)
    # A session of its own: boto3's default one keeps the credentials it read first.
    session = boto3.session.Session()
    clients = {region: session.client("rds", region_name=region) for region in REGIONS}
    differences = []
    for host, port, user, region in itertools.product(HOSTS, PORTS, USERS, REGIONS):
        boto3s = clients[region].generate_db_auth_token(host, port, user)
        ours = handler.iam_auth_token(
            host, port, user, identity_in(region), now=signing_time(boto3s)
        )
        if ours != boto3s:
            differences.append(
                f"{host}:{port} {user!r} {region}:\n  ours   {ours}\n  boto3s {boto3s}"
            )
    assert differences == []


@pytest.mark.no_database
def test_the_token_is_a_presigned_connect_request_for_15_minutes(monkeypatch):
    assert {"/", "+", "="} <= set(LONG_SESSION_TOKEN) and len(LONG_SESSION_TOKEN) > 1_000
    use_credentials(monkeypatch, LONG_SESSION_TOKEN, region="us-east-1")
    host, port, user = HOSTS[1], 6543, "a+b/c=d&e?f"
    token = handler.iam_auth_token(host, port, user, handler.aws_identity(), now=SIGNED_AT)

    assert token.startswith(f"{host}:{port}/?Action=connect&DBUser=")
    # Everything after "?" is percent-encoded but the separators: no "/", "+" or space of
    # the user name or the session token is left to be read as something else.
    query = token.partition("/?")[2]
    assert re.fullmatch(r"[A-Za-z0-9_.~%=&-]+", query)
    assert all(pair.count("=") == 1 for pair in query.split("&"))
    fields = query_fields(token)
    assert [name for name, _ in fields] == [
        "Action",
        "DBUser",
        "X-Amz-Algorithm",
        "X-Amz-Credential",
        "X-Amz-Date",
        "X-Amz-Expires",
        "X-Amz-SignedHeaders",
        "X-Amz-Security-Token",
        "X-Amz-Signature",
    ]
    values = dict(fields)
    assert values["DBUser"] == user
    assert values["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
    assert values["X-Amz-Credential"] == f"{MOTO_KEY_ID}/20261204/us-east-1/rds-db/aws4_request"
    assert values["X-Amz-Date"] == "20261204T093015Z"
    assert values["X-Amz-Expires"] == "900"
    assert values["X-Amz-SignedHeaders"] == "host"
    assert values["X-Amz-Security-Token"] == LONG_SESSION_TOKEN
    assert re.fullmatch(r"[0-9a-f]{64}", values["X-Amz-Signature"])

    use_credentials(monkeypatch, None)
    without = handler.iam_auth_token(host, port, user, handler.aws_identity(), now=SIGNED_AT)
    assert "X-Amz-Security-Token" not in dict(query_fields(without))


EXAMPLE_IDENTITY = handler.AwsIdentity("AKIDEXAMPLE", "the-secret-key", "the-session", "eu-west-1")


def signature(
    host: str = HOSTS[0],
    port: int = 5432,
    user: str = "queue_api",
    now: datetime = SIGNED_AT,
    **identity_changes: str,
) -> str:
    """The signature of the token for these inputs: the example's, but for those given."""
    identity = dataclasses.replace(EXAMPLE_IDENTITY, **identity_changes)
    token = handler.iam_auth_token(host, port, user, identity, now=now)
    return dict(query_fields(token))["X-Amz-Signature"]


@pytest.mark.no_database
def test_every_signer_input_changes_the_signature():
    signatures = {
        "none": signature(),
        "host": signature(host=HOSTS[1]),
        "port": signature(port=5433),
        "user": signature(user="queue_owner"),
        "time": signature(now=SIGNED_AT + timedelta(seconds=1)),
        "region": signature(region="us-east-1"),
        "access key": signature(access_key_id="AKIDOTHER"),
        "secret key": signature(secret_access_key="another-secret"),
        "session token": signature(session_token="another-session"),
    }
    assert signature() == signatures["none"]  # the inputs alone decide it
    assert len(set(signatures.values())) == len(signatures), signatures


@pytest.mark.no_database
def test_the_secret_key_is_in_neither_the_token_nor_the_identitys_repr():
    token = handler.iam_auth_token(HOSTS[0], 5432, "queue_api", EXAMPLE_IDENTITY, now=SIGNED_AT)
    assert "the-secret-key" not in token
    assert "the-secret-key" not in repr(EXAMPLE_IDENTITY)


@pytest.mark.no_database
def test_the_token_is_signed_at_the_time_it_is_made(monkeypatch):
    use_credentials(monkeypatch, None)
    before = datetime.now(UTC).replace(microsecond=0)
    token = handler.iam_auth_token(HOSTS[0], 5432, "queue_api", handler.aws_identity())
    after = datetime.now(UTC)
    assert before <= signing_time(token) <= after


# --- no network, no boto3 -------------------------------------------------------------------

IAM_SETTINGS = {"DB_HOST": HOSTS[1], "DB_PORT": "5432", "DB_NAME": "queue", "DB_USER": "queue_api"}


def refuse_the_network(monkeypatch) -> list[str]:
    """Every way to the network raises, and is noted (in case the code caught it)."""
    reached: list[str] = []

    def refusal(name: str):
        def refused(*args, **kwargs):
            reached.append(name)
            raise AssertionError(f"{name} was called")

        return refused

    monkeypatch.setattr(socket.socket, "connect", refusal("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refusal("socket.connect_ex"))
    monkeypatch.setattr(socket, "create_connection", refusal("socket.create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refusal("socket.getaddrinfo"))
    return reached


def sign_at(monkeypatch, when: datetime) -> None:
    """Every token handler makes from now on is signed at `when` (connection_arguments
    looks iam_auth_token up when it is called)."""
    monkeypatch.setattr(
        handler, "iam_auth_token", functools.partial(handler.iam_auth_token, now=when)
    )


@pytest.mark.no_database
@pytest.mark.parametrize("sslmode", [None, "verify-full", "verify-ca"])
def test_connection_arguments_with_db_user_carry_the_token_and_reach_no_network(
    monkeypatch, tmp_path, sslmode
):
    use_credentials(monkeypatch, LONG_SESSION_TOKEN)
    sign_at(monkeypatch, SIGNED_AT)
    ca_file = write_certificate_authority(tmp_path).file
    settings = {**IAM_SETTINGS, "DB_SSLROOTCERT": str(ca_file)}
    if sslmode:
        settings["DB_SSLMODE"] = sslmode
    reached = refuse_the_network(monkeypatch)

    arguments = handler.connection_arguments(handler.load_settings(settings))
    context = arguments.pop("ssl_context")
    assert arguments == {
        "user": "queue_api",
        "password": handler.iam_auth_token(HOSTS[1], 5432, "queue_api", handler.aws_identity()),
        "host": HOSTS[1],
        "port": 5432,
        "database": "queue",
    }
    assert arguments["password"].startswith(f"{HOSTS[1]}:5432/?Action=connect&DBUser=queue_api&")
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname == ((sslmode or "verify-full") == "verify-full")
    assert {"commonName": "queue test CA"} in [
        dict(field for (field,) in certificate["subject"]) for certificate in context.get_ca_certs()
    ]
    assert reached == []


# Run in a process of its own: other tests of the run import boto3. Powertools imports the
# top-level botocore package (its __init__, for a user agent) when handler.py is imported;
# what must not be imported is boto3 or any other part of botocore (its signer, its session).
MODULES_THE_ARGUMENTS_IMPORT = """
import json, socket, sys
sys.path.insert(0, sys.argv[1])
import handler

def refused(*args, **kwargs):
    raise SystemExit("the network was reached")

socket.socket.connect = socket.create_connection = socket.getaddrinfo = refused
before = set(sys.modules)
arguments = handler.connection_arguments(handler.load_settings())
print(json.dumps({
    "password": arguments["password"],
    "imported": sorted(set(sys.modules) - before),
    "boto": sorted(name for name in sys.modules if name.split(".")[0] in ("boto3", "botocore")),
}))
"""


@pytest.mark.no_database
def test_making_the_arguments_imports_neither_boto3_nor_botocores_signer():
    environment = {
        "PATH": os.environ["PATH"],
        **IAM_SETTINGS,
        "AWS_ACCESS_KEY_ID": MOTO_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": MOTO_SECRET,
        "AWS_SESSION_TOKEN": LONG_SESSION_TOKEN,
        "AWS_REGION": "eu-west-1",
    }
    done = subprocess.run(
        [sys.executable, "-c", MODULES_THE_ARGUMENTS_IMPORT, str(ROOT)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["password"].startswith(f"{HOSTS[1]}:5432/?Action=connect&DBUser=queue_api&")
    assert [name for name in result["imported"] if name.startswith(("boto", "moto"))] == []
    assert [name for name in result["boto"] if name != "botocore"] == []


# --- settings that cannot work ---------------------------------------------------------------

# (what is wrong, the settings changed from IAM_SETTINGS (None: unset), the variables the
# refusal must name)
REFUSED_SETTINGS = [
    ("a secret as well", {"DB_SECRET_ID": "queue/db"}, ("DB_USER", "DB_SECRET_ID")),
    (
        "a migration secret as well",
        {"DB_MIGRATION_SECRET_ID": "queue/owner"},
        ("DB_USER", "DB_MIGRATION_SECRET_ID"),
    ),
    (
        "a migration user without DB_USER",
        {"DB_USER": None, "DB_MIGRATION_USER": "queue_owner", "DB_SECRET_ID": "queue/db"},
        ("DB_MIGRATION_USER", "DB_USER"),
    ),
    ("TLS disabled", {"DB_SSLMODE": "disable"}, ("DB_USER", "DB_SSLMODE")),
    # A server not verified could take the token and log in with it for 15 minutes.
    ("TLS unverified", {"DB_SSLMODE": "require"}, ("DB_USER", "DB_SSLMODE")),
]


@pytest.mark.no_database
@pytest.mark.parametrize(
    ("changes", "named"),
    [case[1:] for case in REFUSED_SETTINGS],
    ids=[case[0] for case in REFUSED_SETTINGS],
)
def test_settings_that_cannot_work_are_refused_naming_the_variables(changes, named):
    settings = {
        name: value for name, value in {**IAM_SETTINGS, **changes}.items() if value is not None
    }
    with pytest.raises(handler.ConfigError) as refused:
        handler.load_settings(settings)
    assert [name for name in named if not re.search(rf"\b{name}\b", str(refused.value))] == []


ROLE_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": MOTO_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": MOTO_SECRET,
    "AWS_SESSION_TOKEN": MOTO_SESSION_TOKEN,
    "AWS_REGION": "eu-west-1",
}


@pytest.mark.no_database
@pytest.mark.parametrize(
    "missing",
    [("AWS_ACCESS_KEY_ID",), ("AWS_SECRET_ACCESS_KEY",), ("AWS_REGION", "AWS_DEFAULT_REGION")],
    ids=lambda names: names[0],
)
def test_a_missing_credential_or_region_is_named(monkeypatch, missing):
    environment = {k: v for k, v in ROLE_ENVIRONMENT.items() if k not in missing}
    with pytest.raises(handler.ConfigError, match=rf"\b{missing[0]}\b"):
        handler.aws_identity(environment)
    # As the service meets it: at its connection.
    use_credentials(monkeypatch, MOTO_SESSION_TOKEN)
    for name in missing:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(handler.ConfigError, match=rf"\b{missing[0]}\b"):
        handler.connection_arguments(handler.load_settings(IAM_SETTINGS))


@pytest.mark.no_database
def test_a_snapstart_container_is_told_why_it_cannot_sign():
    """SnapStart gives a function its role's credentials by the container endpoint, not
    the variables the token is signed with: the error says so (and the template refuses
    ApiSnapStart with DbAuth iam, test_template_production.py)."""
    snap_start = {
        "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://127.0.0.1:9001/2021-04-23/credentials",
        "AWS_REGION": "eu-west-1",
    }
    with pytest.raises(handler.ConfigError, match="use DbAuth secret with ApiSnapStart"):
        handler.aws_identity(snap_start)
    with pytest.raises(handler.ConfigError) as plain:
        handler.aws_identity({"AWS_REGION": "eu-west-1"})
    assert "SnapStart" not in str(plain.value)


@pytest.mark.no_database
def test_the_identity_is_read_as_lambda_sets_it():
    assert dataclasses.asdict(handler.aws_identity(ROLE_ENVIRONMENT)) == {
        "access_key_id": MOTO_KEY_ID,
        "secret_access_key": MOTO_SECRET,
        "session_token": MOTO_SESSION_TOKEN,
        "region": "eu-west-1",
    }
    default_region = {**ROLE_ENVIRONMENT, "AWS_REGION": "", "AWS_DEFAULT_REGION": "us-east-1"}
    assert handler.aws_identity(default_region).region == "us-east-1"
    both = {**ROLE_ENVIRONMENT, "AWS_DEFAULT_REGION": "us-east-1"}
    assert handler.aws_identity(both).region == "eu-west-1"
    no_session = {**ROLE_ENVIRONMENT, "AWS_SESSION_TOKEN": ""}
    assert handler.aws_identity(no_session).session_token is None


# --- certificates ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its key, as objects and as the PEM file of the certificate."""

    certificate: object
    key: object
    file: Path


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def write_certificate_authority(directory: Path) -> Issued:
    """A CA of the test's own, valid for a day either side of now; ca.pem in `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "queue test CA")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = certificate.public_bytes(serialization.Encoding.PEM)
    return Issued(certificate, key, _write(directory / "ca.pem", pem))


def write_server_certificate(directory: Path, ca: Issued, host_name: str) -> tuple[Path, Path]:
    """A server certificate for `host_name` (its only name) signed by `ca`: the paths of
    server.crt and server.key (mode 0600, as PostgreSQL requires) in `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    ca_key_id = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host_name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host_name)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_key_id.value),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return (
        _write(directory / "server.crt", certificate.public_bytes(serialization.Encoding.PEM)),
        _write(directory / "server.key", key_pem, mode=0o600),
    )


# --- a PostgreSQL of this file's own, with TLS ------------------------------------------------

POSTGRESQL_LIBRARIES = Path("/usr/lib/postgresql")
NEEDS_DEBIAN_POSTGRESQL = (
    "the TLS login tests need Debian's PostgreSQL server, built with OpenSSL"
    f" ({POSTGRESQL_LIBRARIES}/<version>/bin/initdb, postgres and pg_isready: apt-get install"
    " postgresql); the embedded one from PyPI has no OpenSSL"
)
# pg_isready is asked at most this many times, POLL_SECONDS apart, before the test fails.
READY_POLLS = 600
POLL_SECONDS = 0.05


def debian_postgresql_programs() -> Path:
    """The bin directory of the machine's newest Debian PostgreSQL; the test fails saying
    what is missing when there is none."""
    found = [
        directory
        for directory in POSTGRESQL_LIBRARIES.glob("*/bin")
        if all((directory / program).is_file() for program in ("initdb", "postgres", "pg_isready"))
    ]
    if not found:
        pytest.fail(NEEDS_DEBIAN_POSTGRESQL, pytrace=False)
    return max(found, key=lambda directory: [int(n) for n in re.findall(r"\d+", str(directory))])


def server_account() -> pwd.struct_passwd | None:
    """Who runs PostgreSQL: this process's user, or, as root (which PostgreSQL refuses),
    the `postgres` user Debian's package made."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail(
            "the TLS login tests run PostgreSQL, which refuses root, as the user postgres"
            " (Debian's package makes it): there is none",
            pytrace=False,
        )


class TlsPostgres:
    """A throwaway PostgreSQL cluster: TLS on 127.0.0.1:port with a certificate for
    `localhost` from a CA made here (ca_file), and passwords over TLS (SCRAM, or in clear
    for queue_rds) as the only way in from the network; the superuser over a private Unix
    socket (trust)."""

    # queue_rds logs in as RDS asks an IAM user to: the password in clear, inside TLS
    # (pg_hba `password`), which RDS hands to IAM to check; the others by SCRAM.
    ROLES = ("queue_api", "queue_owner", "queue_rds")

    def __init__(self, programs: Path, base: Path, account: pwd.struct_passwd | None):
        self.programs, self.base, self.account = programs, base, account
        self.data, self.sockets, self.tls = base / "data", base / "sockets", base / "tls"
        self.log = base / "postgresql.log"
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        for directory in (self.sockets, self.tls):
            directory.mkdir()
        ca = write_certificate_authority(self.tls)
        self.ca_file = ca.file
        certificate, key = write_server_certificate(self.tls, ca, "localhost")
        self._give_to_server(self.base, self.sockets, self.tls, certificate, key)
        self._run(
            "initdb",
            f"--pgdata={self.data}",
            "--username=postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        (self.data / "pg_hba.conf").write_text(
            "local all postgres trust\nhostssl all queue_rds 127.0.0.1/32 password\n"
            "hostssl all all 127.0.0.1/32 scram-sha-256\n"
        )
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": self.port,
            "unix_socket_directories": self.sockets,
            "ssl": "on",
            "ssl_cert_file": certificate,
            "ssl_key_file": key,
            "fsync": "off",
            "max_connections": 20,
        }
        options = [f"--{name}={value}" for name, value in settings.items()]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [str(self.programs / "postgres"), "-D", str(self.data), *options],
                stdout=log,
                stderr=subprocess.STDOUT,
                **self._as_server(),
            )
        self._wait_until_ready()
        with self.admin() as admin:
            for role in self.ROLES:
                admin.run(f"CREATE ROLE {role} LOGIN")

    def _as_server(self) -> dict:
        if self.account is None:
            return {}
        return {"user": self.account.pw_uid, "group": self.account.pw_gid, "extra_groups": []}

    def _give_to_server(self, *paths: Path) -> None:
        if self.account is not None:
            for path in paths:
                os.chown(path, self.account.pw_uid, self.account.pw_gid)

    def _run(self, program: str, *args: str) -> None:
        done = subprocess.run(
            [str(self.programs / program), *args],
            capture_output=True,
            text=True,
            timeout=120,
            **self._as_server(),
        )
        assert done.returncode == 0, f"{program} failed: {done.stdout}{done.stderr}"

    def _wait_until_ready(self) -> None:
        is_ready = [
            str(self.programs / "pg_isready"),
            "--quiet",
            f"--host={self.sockets}",
            f"--port={self.port}",
        ]
        for _ in range(READY_POLLS):
            if self.process.poll() is not None:
                break
            if subprocess.run(is_ready, timeout=30).returncode == 0:
                return
            time.sleep(POLL_SECONDS)
        log = self.log.read_text(errors="replace")[-2000:]
        pytest.fail(f"the test's PostgreSQL did not start (exit {self.process.poll()}):\n{log}")

    @contextlib.contextmanager
    def admin(self):
        connection = pg8000.native.Connection(
            user="postgres", unix_sock=f"{self.sockets}/.s.PGSQL.{self.port}"
        )
        try:
            yield connection
        finally:
            connection.close()

    def set_password(self, role: str, password: str) -> None:
        with self.admin() as admin:
            admin.run(f"ALTER ROLE {role} PASSWORD {pg8000.native.literal(password)}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # a fast shutdown: sessions are ended
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def tls_postgres():
    programs, account = debian_postgresql_programs(), server_account()
    base = Path(tempfile.mkdtemp(prefix="queue-iam-"))
    server = TlsPostgres(programs, base, account)
    try:
        server.start()
        yield server
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def role_credentials(monkeypatch):
    """moto's credentials with a session token as long as a real one, every token signed
    at SIGNED_AT: the token a test gives a role as its password is the one handler sends."""
    use_credentials(monkeypatch, LONG_SESSION_TOKEN)
    sign_at(monkeypatch, SIGNED_AT)


# --- logging in with the token ---------------------------------------------------------------

WHO_AND_HOW = (
    "SELECT current_user::text, ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
)


def iam_settings(server: TlsPostgres, **changes: str) -> dict[str, str]:
    return {
        "DB_HOST": "localhost",
        "DB_PORT": str(server.port),
        "DB_NAME": "postgres",
        "DB_USER": "queue_api",
        "DB_SSLMODE": "verify-full",
        "DB_SSLROOTCERT": str(server.ca_file),
        **changes,
    }


def token_for(
    server: TlsPostgres, user: str, host: str = "localhost", now: datetime = SIGNED_AT
) -> str:
    return handler.iam_auth_token(host, server.port, user, handler.aws_identity(), now=now)


def log_in(settings: dict[str, str], owner: bool = False) -> tuple[str, bool, str]:
    """Who the handler's connection arguments log in as, whether over TLS, and its version."""
    arguments = handler.connection_arguments(handler.load_settings(settings), owner=owner)
    connection = pg8000.native.Connection(**arguments)
    try:
        ((user, over_tls, version),) = connection.run(WHO_AND_HOW)
        return user, over_tls, version
    finally:
        connection.close()


def refusal_code(settings: dict[str, str]) -> str | None:
    """The SQLSTATE PostgreSQL refused the login with; None if it let it in."""
    try:
        log_in(settings)
    except pg8000.exceptions.DatabaseError as refused:
        return refused.args[0]["C"]
    return None


def test_the_token_is_the_password_of_a_login_over_tls(tls_postgres, role_credentials):
    tls_postgres.set_password("queue_api", token_for(tls_postgres, "queue_api"))
    user, over_tls, version = log_in(iam_settings(tls_postgres))
    assert (user, over_tls) == ("queue_api", True)
    assert version.startswith("TLSv1.")


def test_the_token_goes_in_clear_inside_tls_as_rds_asks_for_it(tls_postgres, role_credentials):
    tls_postgres.set_password("queue_rds", token_for(tls_postgres, "queue_rds"))
    assert log_in(iam_settings(tls_postgres, DB_USER="queue_rds"))[:2] == ("queue_rds", True)
    tls_postgres.set_password("queue_rds", token_for(tls_postgres, "queue_api"))
    assert refusal_code(iam_settings(tls_postgres, DB_USER="queue_rds")) == "28P01"


def test_the_migrations_log_in_as_db_migration_user(tls_postgres, role_credentials):
    for role in ("queue_api", "queue_owner"):
        tls_postgres.set_password(role, token_for(tls_postgres, role))
    settings = iam_settings(tls_postgres, DB_MIGRATION_USER="queue_owner")
    assert log_in(settings, owner=True)[:2] == ("queue_owner", True)
    assert log_in(settings, owner=False)[:2] == ("queue_api", True)


# Tokens the role may have as its password that are not the one handler sends.
OTHER_TOKENS = {
    "another user's": lambda server: token_for(server, "queue_owner"),
    "another second's": lambda server: token_for(
        server, "queue_api", now=SIGNED_AT + timedelta(seconds=1)
    ),
    "one signature digit changed": lambda server: flip_last_digit(token_for(server, "queue_api")),
}


def flip_last_digit(token: str) -> str:
    return token[:-1] + ("0" if token[-1] != "0" else "1")


@pytest.mark.parametrize("other_token", OTHER_TOKENS.values(), ids=OTHER_TOKENS.keys())
def test_a_token_other_than_the_one_made_is_refused(tls_postgres, role_credentials, other_token):
    settings = iam_settings(tls_postgres)
    tls_postgres.set_password("queue_api", other_token(tls_postgres))
    assert refusal_code(settings) == "28P01"  # invalid_password
    # The role and the way in are sound: with the token handler makes, it logs in.
    tls_postgres.set_password("queue_api", token_for(tls_postgres, "queue_api"))
    assert refusal_code(settings) is None


def test_verify_full_refuses_a_certificate_for_another_host_name(tls_postgres, role_credentials):
    """The server's certificate, from the trusted CA, names localhost only. Asked for
    127.0.0.1, the same server, verify-full refuses it before any password is sent, where
    verify-ca (the chain only) logs in: the name is the only difference."""
    tls_postgres.set_password("queue_api", token_for(tls_postgres, "queue_api", host="127.0.0.1"))
    with pytest.raises(ssl.SSLCertVerificationError) as refused:
        log_in(iam_settings(tls_postgres, DB_HOST="127.0.0.1"))
    assert "mismatch" in refused.value.verify_message
    assert "127.0.0.1" in refused.value.verify_message
    chain_only = iam_settings(tls_postgres, DB_HOST="127.0.0.1", DB_SSLMODE="verify-ca")
    assert log_in(chain_only)[:2] == ("queue_api", True)
