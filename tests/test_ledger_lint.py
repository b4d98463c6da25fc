"""squawk, the field's migration linter, over the ledger files production has not run
(tests/ledger_lint.py, .squawk.toml): the new files pass it; it catches on sample SQL the
hazards the pglast rules (tests/ledger_rules.py) do not look for; every file after the
production cutoff is linted, as the runner runs it; every ignore says why."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import ledger_lint
import pytest

import handler
from helpers import connect, migrate
from ledger_rules import violations

# Each hazard (in a file that runs in a transaction, as the runner runs one) and the rule
# squawk names it by. The pglast rules find nothing wrong with any of them.
MISSED_BY_PGLAST = {
    "SET NOT NULL (scans apps under ACCESS EXCLUSIVE)": (
        "ALTER TABLE apps ALTER COLUMN details SET NOT NULL;",
        "adding-not-nullable-field",
    ),
    "a renamed column (the previous release still names it)": (
        "ALTER TABLE apps RENAME COLUMN failure_reason TO reason;",
        "renaming-column",
    ),
    "a renamed table": ("ALTER TABLE app_analyses RENAME TO analyses;", "renaming-table"),
    "a dropped column": ("ALTER TABLE apps DROP COLUMN claim_token;", "ban-drop-column"),
    "a dropped table": ("DROP TABLE analyser_heartbeats;", "ban-drop-table"),
    "a dropped constraint": (
        "ALTER TABLE apps DROP CONSTRAINT apps_processing_claim_token_check;",
        "ban-drop-constraint",
    ),
    "DROP INDEX without CONCURRENTLY": (
        "DROP INDEX apps_due;",
        "require-concurrent-index-deletion",
    ),
    "REINDEX without CONCURRENTLY": ("REINDEX INDEX apps_due;", "require-concurrent-reindex"),
    "REINDEX of a table": ("REINDEX TABLE apps;", "require-concurrent-reindex"),
}


def lint_text(tmp_path: Path, name: str, text: str) -> set[str]:
    path = tmp_path / name
    path.write_text(text)
    return {found["rule_name"] for found in ledger_lint.findings([path])}


def test_the_new_ledger_files_pass_squawk():
    files = ledger_lint.new_ledger_files()
    assert files, "no ledger file after the production cutoff"
    assert ledger_lint.findings(files) == []


@pytest.mark.parametrize("hazard", MISSED_BY_PGLAST)
def test_squawk_catches_what_the_pglast_rules_miss(hazard, tmp_path, is_volatile):
    text, rule = MISSED_BY_PGLAST[hazard]
    assert violations(text, is_volatile) == []
    assert lint_text(tmp_path, "020_sample.sql", text) == {rule}


def test_a_justified_ignore_silences_only_its_rule(tmp_path):
    text = (
        "-- claim_token has not been written since 018 and the previous release no longer\n"
        "-- reads it.\n"
        "-- squawk-ignore ban-drop-column\n"
        "ALTER TABLE apps DROP COLUMN claim_token;\n"
        "ALTER TABLE apps RENAME COLUMN failure_reason TO reason;\n"
    )
    assert lint_text(tmp_path, "020_sample.sql", text) == {"renaming-column"}


def test_files_are_linted_as_the_runner_runs_them(tmp_path):
    """In a transaction unless marked no-transaction: the same statement that a
    transaction rolls back whole must, run alone, be safe to run again."""
    add = "ALTER TABLE apps ADD COLUMN seen timestamptz;\n"
    assert lint_text(tmp_path, "020_inside.sql", add) == set()
    alone = handler.NO_TRANSACTION_MARKER + "\n" + add
    assert lint_text(tmp_path, "021_alone.sql", alone) == {"prefer-robust-stmts"}
    build = "CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_added ON apps (added);\n"
    assert (
        lint_text(tmp_path, "022_build.sql", handler.NO_TRANSACTION_MARKER + "\n" + build) == set()
    )
    assert ledger_lint.NO_TRANSACTION_MARKER == handler.NO_TRANSACTION_MARKER


def test_every_file_after_the_cutoff_is_new_whatever_its_name(tmp_path):
    sql = tmp_path / "sql"
    shutil.copytree(handler.SQL_DIR, sql)
    for name in ("020_next.sql", "023_later.sql", "100_far.sql"):
        (sql / name).write_text("SELECT 1;\n")
    names = [path.name for path in ledger_lint.new_ledger_files(sql)]
    after = sorted(p.name for p in sql.glob("*.sql") if p.name > "018_analysis_claim_token.sql")
    assert names == after
    assert names[0] == "019_validate_claim_token_check.sql"
    assert {"020_next.sql", "023_later.sql", "100_far.sql"} <= set(names)
    assert not {p.name for p in sql.glob("01[0-8]_*.sql")} & set(names)
    # The cutoff is a file of the ledger: a typo would make every file, or none, new.
    (sql / ledger_lint.LAST_APPLIED_IN_PRODUCTION).unlink()
    with pytest.raises(SystemExit, match="production cutoff"):
        ledger_lint.new_ledger_files(sql)


def test_every_ignore_in_a_new_file_says_why():
    for path in ledger_lint.new_ledger_files():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if "squawk-ignore" not in line:
                continue
            assert re.fullmatch(r"-- squawk-ignore [a-z-]+(, [a-z-]+)*", line), (path, line)
            before = lines[number - 1] if number else ""
            assert before.startswith("-- ") and "squawk-ignore" not in before, (path, number)


def test_the_excluded_rule_is_kept_by_the_runner(empty_database, tmp_path):
    """.squawk.toml leaves out require-lock-timeout because the runner sets one on its
    session before any file (a file waiting for a lock fails, instead of queueing every
    writer behind it); and require-statement-timeout, which the runner leaves unset."""
    config = ledger_lint.CONFIG.read_text()
    excluded = re.search(r"excluded_rules = \[(.*?)\]", config, re.S).group(1)
    assert set(re.findall(r'"([a-z-]+)"', excluded)) == {
        "require-lock-timeout",
        "require-statement-timeout",
    }
    ledger = tmp_path / "sql"
    ledger.mkdir()
    (ledger / "000_seen.sql").write_text(
        "CREATE TABLE seen AS SELECT current_setting('lock_timeout') AS lock_timeout,"
        " current_setting('statement_timeout') AS statement_timeout;\n"
    )
    assert migrate(empty_database, ledger) == ["000_seen.sql"]
    connection = connect(empty_database)
    try:
        assert connection.run("SELECT lock_timeout, statement_timeout FROM seen") == [["10s", "0"]]
    finally:
        connection.close()


def test_the_docs_say_what_the_lint_does(tmp_path):
    text = (handler.HERE / "docs" / "migrations.md").read_text()
    assert f"`{ledger_lint.LAST_APPLIED_IN_PRODUCTION}`" in text
    for rule in ("require-lock-timeout", "require-statement-timeout"):
        assert f"`{rule}`" in text, rule
    # The example of a justified ignore is one squawk accepts (and the form the test
    # above asks for).
    (example,) = re.findall(r"```sql\n(.*?)```", text, re.S)
    assert "squawk-ignore" in example
    assert lint_text(tmp_path, "020_example.sql", example) == set()
    assert lint_text(tmp_path, "021_bare.sql", example.splitlines()[-1] + "\n") == {
        "ban-drop-column"
    }
