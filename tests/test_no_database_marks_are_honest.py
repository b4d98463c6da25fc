"""A test marked `no_database` uses no PostgreSQL, so CI's second pass, on the machine's
PostgreSQL, can leave it out (.ci/run: -m "not no_database"): one that asks for a
database fixture, or opens a connection, fails by name (tests/conftest.py's
no_database_guard, kit.NoDatabase)."""

from __future__ import annotations

import os
import re

import pytest
from kit import DATABASE_FIXTURES, NO_DATABASE, NO_DATABASE_URL, ROOT, NoDatabase

from helpers import connect


@pytest.mark.no_database
def test_no_test_of_this_run_marked_no_database_asks_for_a_database(request):
    marked = [item for item in request.session.items if item.get_closest_marker(NO_DATABASE)]
    assert request.node in marked
    assert [
        (item.nodeid, NoDatabase(item.nodeid, item.fixturenames).asked_for())
        for item in marked
        if NoDatabase(item.nodeid, item.fixturenames).asked_for()
    ] == []


@pytest.mark.no_database
def test_a_marked_test_asking_for_a_database_is_named():
    guard = NoDatabase("tests/test_x.py::test_y", ["tmp_path", "sql", "database_url", "server_url"])
    assert guard.asked_for() == ["database_url", "server_url", "sql"]
    assert guard.message("asks for sql") == (
        "tests/test_x.py::test_y is marked no_database but asks for sql: take the mark off"
    )
    # Every fixture of conftest.py built on a database is one the guard knows.
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    fixtures = {
        name: {parameter.strip() for parameter in parameters.split(",")}
        for name, parameters in re.findall(r"@pytest\.fixture[^\n]*\ndef (\w+)\((.*)\)", conftest)
    }
    on_a_database = {"server_url", "database_url"}
    while grown := {n for n, uses in fixtures.items() if uses & on_a_database} - on_a_database:
        on_a_database |= grown
    assert len(on_a_database) > 5, on_a_database
    assert on_a_database <= DATABASE_FIXTURES, on_a_database - DATABASE_FIXTURES


@pytest.mark.no_database
def test_a_connection_from_a_marked_test_fails_it_by_name(no_database_guard, request):
    assert os.environ["DATABASE_URL"] == NO_DATABASE_URL
    with pytest.raises(pytest.fail.Exception) as failed:
        connect("postgresql://postgres@127.0.0.1:5432/postgres")
    assert str(failed.value) == (
        f"{request.node.nodeid} is marked no_database but opened a PostgreSQL connection:"
        " take the mark off"
    )
    # Caught by the code under test, it still fails the test when it ends.
    assert no_database_guard.attempts == 1
    no_database_guard.attempts = 0  # this test's own attempt, shown above


def test_an_unmarked_test_is_left_alone(no_database_guard):
    assert no_database_guard is None


@pytest.mark.no_database
def test_ci_leaves_the_marked_tests_out_of_its_second_pass_only():
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")  # lines continued
    passes = [line for line in script.splitlines() if "-m pytest" in line]
    assert len(passes) == 2, passes
    assert f'-m "not {NO_DATABASE}"' not in passes[0]
    assert "DATABASE_URL=" in passes[1] and f'-m "not {NO_DATABASE}"' in passes[1]
