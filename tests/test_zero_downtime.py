"""New ledger files must never block the previous release's writes for long.

Files from 013 on (000-012 are history, exempt) are parsed with pglast, PostgreSQL's own
parser, and held to these rules:

* an index on a table that exists before the file is built CONCURRENTLY (a plain build
  blocks writes for the whole build); a UNIQUE or PRIMARY KEY constraint is added
  `USING INDEX` an index built that way;
* a CHECK or FOREIGN KEY constraint on such a table is added NOT VALID, and validated in
  another file (validating it in the same transaction scans under the ADD's lock);
* no column changes type (a rewrite under ACCESS EXCLUSIVE);
* no column is added with a volatile default, a serial type, or as a stored generated or
  identity column (each rewrites the table); volatility is PostgreSQL's own (pg_proc);
* no DO block (the check cannot see the statements inside it);
* a no-transaction file (`-- ledger: no-transaction`) holds one statement, and its index
  builds say IF NOT EXISTS, so that a re-run after a failure is harmless.
"""

from __future__ import annotations

import pytest

import handler
from ledger_rules import violations

FIRST_CHECKED = "013"
NEW_FILES = [
    path for path in sorted(handler.SQL_DIR.glob("*.sql")) if path.name[:3] >= FIRST_CHECKED
]


def test_there_are_new_files_to_check():
    assert [path.name for path in NEW_FILES][:2] == [
        "015_analysis_day.sql",
        "016_apps_stale_day_order.sql",
    ]


@pytest.mark.parametrize("path", NEW_FILES, ids=lambda path: path.name)
def test_new_ledger_files_keep_the_zero_downtime_rules(path, is_volatile):
    assert violations(path.read_text(), is_volatile) == []


BREAKING = {
    "index built in place": (
        "CREATE INDEX apps_title ON apps ((details->>'title'));",
        "index apps_title on apps is not built CONCURRENTLY",
    ),
    "unique constraint built in place": (
        "ALTER TABLE apps ADD CONSTRAINT apps_title_key UNIQUE (appid, status);",
        "constraint apps_title_key on apps builds its index in place",
    ),
    "check constraint validated at once": (
        "ALTER TABLE apps ADD CONSTRAINT apps_x CHECK (due IS NOT NULL);",
        "constraint apps_x on apps is not added NOT VALID",
    ),
    "foreign key validated at once": (
        "ALTER TABLE app_analyses ADD CONSTRAINT h_fk FOREIGN KEY (appid) REFERENCES apps;",
        "constraint h_fk on app_analyses is not added NOT VALID",
    ),
    "validated in the same file": (
        "ALTER TABLE apps ADD CONSTRAINT apps_x CHECK (due IS NOT NULL) NOT VALID;\n"
        "ALTER TABLE apps VALIDATE CONSTRAINT apps_x;",
        "apps_x is validated in the file that adds it (under its lock)",
    ),
    "column type change": (
        "ALTER TABLE apps ALTER COLUMN failure_reason TYPE varchar(200);",
        "apps.failure_reason changes type (rewrites apps)",
    ),
    "volatile default": (
        "ALTER TABLE apps ADD COLUMN lease uuid DEFAULT gen_random_uuid();",
        "apps.lease defaults to volatile gen_random_uuid()",
    ),
    "volatile default inside an expression": (
        "ALTER TABLE apps ADD COLUMN seen timestamptz NOT NULL DEFAULT"
        " (clock_timestamp() + interval '1 day');",
        "apps.seen defaults to volatile clock_timestamp()",
    ),
    "serial column": (
        "ALTER TABLE apps ADD COLUMN n bigserial;",
        "apps.n is bigserial: a volatile default (nextval) rewrites apps",
    ),
    "stored generated column": (
        "ALTER TABLE apps ADD COLUMN p numeric GENERATED ALWAYS AS (app_popularity(details))"
        " STORED;",
        "apps.p is a stored generated column (rewrites apps)",
    ),
    "DO block": (
        "DO $$ BEGIN EXECUTE 'CREATE INDEX a ON apps (added)'; END $$;",
        "a DO block hides its statements from this check",
    ),
    "two statements without a transaction": (
        "-- ledger: no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS a ON apps (added);\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS b ON apps (analysed);",
        "a no-transaction file holds one statement, not 2",
    ),
    "no-transaction build that cannot re-run": (
        "-- ledger: no-transaction\nCREATE INDEX CONCURRENTLY a ON apps (added);",
        "index a: a re-run needs IF NOT EXISTS",
    ),
}


@pytest.mark.parametrize("rule", BREAKING)
def test_the_check_rejects_a_file_that_breaks_a_rule(rule, is_volatile):
    text, problem = BREAKING[rule]
    assert violations(text, is_volatile) == [problem]


def test_the_check_accepts_what_the_rules_allow(is_volatile):
    allowed = """
    CREATE TABLE fresh (id bigserial PRIMARY KEY, at timestamptz DEFAULT clock_timestamp());
    CREATE INDEX fresh_at ON fresh (at);
    ALTER TABLE fresh ADD CONSTRAINT fresh_positive CHECK (id > 0);
    CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_added ON apps (added);
    ALTER TABLE apps ADD CONSTRAINT apps_added_key UNIQUE USING INDEX apps_added_unique;
    ALTER TABLE apps ADD COLUMN IF NOT EXISTS seen timestamptz DEFAULT now();
    ALTER TABLE apps ADD COLUMN IF NOT EXISTS note text NOT NULL DEFAULT 'none';
    ALTER TABLE apps ADD CONSTRAINT apps_note CHECK (note <> '') NOT VALID;
    ALTER TABLE apps VALIDATE CONSTRAINT apps_processing_claim_token_check;
    """
    assert violations(allowed, is_volatile) == []
    one = "-- ledger: no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS a ON apps (added);"
    assert violations(one, is_volatile) == []
