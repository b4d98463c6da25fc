"""The CLI as operators and the analyser hosts run it, on a real database: handler.main
in this process (helpers.call_cli), answering as `python3 handler.py` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import handler
from helpers import (
    CLI_SIGNALS,
    app_row,
    call_cli,
    connect,
    days_ago,
    history,
    insert_app,
    minutes_ago,
)
from queue_status import arrange_every_state, assert_the_status_of_every_state


def cli(database_url: str, *args: str, unset=(), **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DATABASE_URL": database_url, **extra}
    for name in unset:
        env.pop(name, None)
    return call_cli(*args, env=env)


def test_a_command_run_in_this_process_leaves_the_process_as_it_found_it(database_url):
    """call_cli runs handler.main here: the environment, working directory, argv, stdin
    and the signal handlers main() installs are the test process's own again after it,
    whatever the command answered, and what it printed was captured, not shown."""

    def state():
        signals = {number: signal.getsignal(number) for number in CLI_SIGNALS}
        return dict(os.environ), os.getcwd(), sys.argv, sys.stdin, signals

    before = state()
    done = cli(database_url, "queue-status", "--json", STALE_ANALYSIS_DAYS="9")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"]["stale_days"] == 9  # env was the call's
    assert "STALE_ANALYSIS_DAYS" not in os.environ
    usage = cli(database_url, "queue-status", "--top", "0")
    assert usage.returncode == 2 and usage.stdout == ""
    assert usage.stderr.splitlines()[-1].startswith("handler.py queue-status: error:")
    assert state() == before


def test_refetch_one_app_for_exact_app_mode(database_url, sql):
    analysis = {"success": True, "trackers": {"a": "b"}}
    insert_app(
        sql,
        "com.example.app",
        status="analysed",
        version=4,
        analysed=days_ago(2),
        analysis=analysis,
    )
    dry = cli(database_url, "queue-refetch", "--appid=COM.example.APP")
    assert dry.returncode == 0, dry.stderr
    assert "Would queue 1 apps for refetch" in dry.stdout
    assert app_row(sql, "com.example.app")["status"] == "analysed"
    history_before = history(sql, "com.example.app")

    done = cli(database_url, "queue-refetch", "--appid=com.example.app", "--apply")
    assert done.returncode == 0, done.stderr
    assert any(line.startswith("Queued 1 apps for refetch.") for line in done.stdout.splitlines())
    row = app_row(sql, "com.example.app")
    assert row["status"] == "queued"
    assert row["analysis"] == analysis  # still visible until the new result arrives
    # The current analysis was snapshotted into history (once).
    assert history(sql, "com.example.app") == [*history_before, [analysis, 4, True]]


def test_refetch_of_an_unknown_app_queues_nothing(database_url):
    done = cli(database_url, "queue-refetch", "--appid=com.example.none", "--apply")
    assert "Queued 0 apps for refetch." in done.stdout


def test_refetch_failed_apps(database_url, sql):
    insert_app(
        sql, "failed.retry", status="failed", retryable=True, version=4, analysed=days_ago(1)
    )
    insert_app(
        sql,
        "failed.final",
        status="failed",
        retryable=False,
        reason="paid_app",
        version=4,
        analysed=days_ago(1),
    )
    insert_app(sql, "analysed.app", status="analysed", version=4, analysed=days_ago(1))
    only_retryable = cli(database_url, "queue-refetch", "--failed", "--apply", "--yes")
    assert "Queued 1 apps for refetch." in only_retryable.stdout
    assert app_row(sql, "failed.retry")["status"] == "queued"
    assert app_row(sql, "failed.final")["status"] == "failed"
    everything = cli(
        database_url, "queue-refetch", "--failed", "--include-non-retryable", "--apply", "--yes"
    )
    assert "Queued 1 apps for refetch." in everything.stdout
    assert app_row(sql, "failed.final")["status"] == "queued"
    assert app_row(sql, "failed.final")["failure_reason"] is None
    assert app_row(sql, "analysed.app")["status"] == "analysed"


def test_refetch_limit_takes_the_most_popular(database_url, sql):
    for n, reviews in enumerate(["5", "500", "50"]):
        insert_app(
            sql, f"app.{n}", status="analysed", version=4, analysed=days_ago(1), reviews=reviews
        )
    done = cli(database_url, "queue-refetch", "--limit=2", "--apply", "--yes")
    assert "Queued 2 apps for refetch." in done.stdout
    assert app_row(sql, "app.1")["status"] == "queued"
    assert app_row(sql, "app.2")["status"] == "queued"
    assert app_row(sql, "app.0")["status"] == "analysed"


def test_refetch_rejects_invalid_bundle_ids(database_url):
    done = cli(database_url, "queue-refetch", "--appid=bad id", "--apply")
    assert done.returncode == 2
    assert "invalid bundle ID" in done.stderr


def test_refetch_refuses_include_non_retryable_without_failed(database_url, sql):
    """As the report function's event refuses includeNonRetryable without failed (one
    RefetchRequest rule), in one line, as a bad bundle ID is refused."""
    insert_app(sql, "app.done", status="analysed", version=4, analysed=days_ago(1))
    done = cli(database_url, "queue-refetch", "--include-non-retryable", "--apply", "--yes")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: --include-non-retryable goes with --failed"]
    assert app_row(sql, "app.done")["status"] == "analysed"


def test_queue_status_report_sections(database_url, sql):
    insert_app(sql, "q.one", reviews="100")
    insert_app(sql, "p.live", status="processing", processing_started=minutes_ago(10))
    insert_app(sql, "p.expired", status="processing", processing_started=minutes_ago(500))
    insert_app(sql, "a.stale", status="analysed", version=4, analysed=days_ago(400))
    insert_app(sql, "a.old", status="analysed", version=2, analysed=days_ago(1))
    insert_app(sql, "f.retry", status="failed", retryable=True, version=3, analysed=days_ago(1))
    sql.run(
        "INSERT INTO app_analyses (appid, analysis, analysed, success)"
        " VALUES ('a.old', '{}', now() - interval '2 hours', true)"
    )
    out = cli(database_url, "queue-status")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for heading in (
        "Apps by state",
        "Backlog under the current policy",
        "Throughput",
        "ETA for the backlog",
        "Being processed (2)",
        "Top of the backlog",
    ):
        assert heading in text
    assert "processing lease expired" in text
    assert "analysis version outdated" in text
    assert "analysis older than the staleness cutoff" in text
    assert "retryable failure, outdated or stale" in text
    assert "p.expired" in text and "lease expired" in text
    # 5 candidates, 1 finished in the last day: 120 hours.
    assert "ETA for the backlog: 120.0 hours" in text
    assert text.index("q.one") < text.index("a.stale")


def test_queue_status_text_says_pauses_holds_and_retries(database_url, sql):
    """queue-status names a paused queue first (since when, by whom, why), counts retries
    due (the lowest tier, listed last), retries waiting and held apps."""
    insert_app(sql, "q.held", reviews="900", held=True)
    insert_app(sql, "q.one", reviews="100")
    insert_app(sql, "f.due", status="failed", retryable=True, version=4, analysed=days_ago(1),
               reviews="5000")  # fmt: skip
    insert_app(sql, "f.soon", status="failed", retryable=True, version=4,
               analysed=minutes_ago(30))  # fmt: skip
    assert cli(database_url, "queue-pause", "--reason", "db upgrade").returncode == 0
    text = cli(database_url, "queue-status").stdout
    first = text.splitlines()[0]
    assert first.startswith("THE QUEUE IS PAUSED since ") and "(db upgrade)" in first
    assert "command line (" in first  # who paused it, from where
    for line, count in (
        ("retry due (handed out last of all)", 1),
        ("retryable failures, retry due in the next hour", 1),
        ("held by an operator (queue-hold)", 1),
    ):
        found = [row for row in text.splitlines() if row.strip().startswith(line)]
        assert found[0].split()[-1] == str(count), found  # the count (then the top's rows)
    assert text.index("q.one") < text.index("f.due")  # the retry last, though more popular
    assert "q.held" not in text.split("Top of the backlog")[1]
    assert cli(database_url, "queue-resume").returncode == 0
    assert "PAUSED" not in cli(database_url, "queue-status").stdout


@pytest.mark.parametrize(
    ("args", "code", "line"),
    [
        (("why", "com.example.nope"), 1, "error: "),
        (("why", "not a bundle id"), 2, "error: "),
        (("queue-hold", "com.example.nope"), 1, "error: "),
        (("queue-release", "com.example.nope"), 1, "error: "),
        (("analysers", "pause", "pi-nope"), 1, "error: "),
        (("analysers", "resume", "pi-nope"), 1, "error: "),
        (("analysers", "pause", "bad name"), 2, "error: "),
        (("queue-pause", "--reason", "x" * 501), 2, "error: "),
        (("queue-refetch", "--failed-by", "bad name"), 2, "error: "),
        (("queue-refetch", "--failed-by", "pi", "--appid", "com.example.app"), 2, "error: "),
    ],
)
def test_the_operators_commands_fail_in_one_line(database_url, sql, args, code, line):
    """A hold, release, pause or why of something that is not there (exit 1), or asked
    wrongly (exit 2, as any bad input), is one `error:` line on stderr and changes
    nothing."""
    insert_app(sql, "com.example.app")
    before = (
        sql.run("SELECT appid, held_at, status FROM apps"),
        sql.run("SELECT paused_at FROM queue_pause"),
    )
    done = cli(database_url, *args)
    assert done.returncode == code, (done.stdout, done.stderr)
    errors = [text for text in done.stderr.splitlines() if text.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line), done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    after = (
        sql.run("SELECT appid, held_at, status FROM apps"),
        sql.run("SELECT paused_at FROM queue_pause"),
    )
    assert after == before
    assert sql.run("SELECT count(*) FROM operator_actions") == [[0]]


def test_priority_report_lists_claim_order(database_url, sql):
    insert_app(sql, "low", reviews="1")
    insert_app(sql, "high", reviews="1000")
    out = cli(database_url, "priority-report", "--limit=5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.index("high") < out.stdout.index("low")


def test_migrate_dry_run_and_apply(empty_database):
    dry = cli(empty_database, "migrate", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "Pending: 000_apps.sql" in dry.stdout
    applied = cli(empty_database, "migrate")
    assert "Applied: 000_apps.sql" in applied.stdout
    again = cli(empty_database, "migrate", "--dry-run")
    assert "Pending: nothing" in again.stdout


def test_cli_reports_an_unreachable_database_clearly():
    out = cli("postgresql://postgres@127.0.0.1:9/none", "queue-status")
    assert out.returncode == 1
    assert "error: cannot connect to the database" in out.stderr
    assert "Traceback" not in out.stderr


def test_invoke_runs_the_entry_points_on_event_files(database_url, sql):
    insert_app(sql, "com.example.app")
    # Without tokens in the environment, invoke uses the events' local ones.
    queued = cli(
        database_url, "invoke", "api", "events/queue.json", unset=("UPLOAD_PASSWORD", "ADMIN_TOKEN")
    )
    assert queued.returncode == 0, queued.stderr
    answer = json.loads(queued.stdout.splitlines()[-1])
    assert (answer["statusCode"], answer["body"]) == (200, "com.example.app")
    assert app_row(sql, "com.example.app")["status"] == "processing"
    scheduled = cli(database_url, "invoke", "report", "events/schedule.json")
    assert scheduled.returncode == 0, scheduled.stderr
    assert json.loads(scheduled.stdout.splitlines()[-1])["counts"] == {
        "queued": 0,
        "processing": 1,
        "analysed": 0,
        "failed": 0,
    }


def test_invoke_migrate_with_the_placeholder_response_url_says_so_in_one_line(empty_database):
    done = cli(empty_database, "invoke", "migrate", "events/cfn-create.json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["Status"] == "SUCCESS"
    # No attempts at a reply nothing can receive: one line says what happened.
    assert "custom resource reply failed" not in done.stderr
    placeholder = [line for line in done.stderr.splitlines() if "ResponseURL" in line]
    assert placeholder == [
        "nothing listens at the event's ResponseURL (a local placeholder): the reply"
        " below was not sent"
    ]


def test_invoke_exits_1_when_the_custom_resource_reply_is_failed(database_url, tmp_path):
    event = json.loads((handler.HERE / "events" / "cfn-create.json").read_text())
    event["RequestType"] = "Replace"  # not a request CloudFormation sends: FAILED
    path = tmp_path / "event.json"
    path.write_text(json.dumps(event))
    done = cli(database_url, "invoke", "migrate", str(path))
    assert done.returncode == 1, done.stdout
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["Status"] == "FAILED"
    assert "unknown RequestType" in answer["Reason"]


@pytest.mark.private_database  # a trigger refuses updates of apps
def test_invoke_exits_1_on_a_server_error_from_the_api(database_url, sql, tmp_path):
    ok = cli(database_url, "invoke", "api", "events/healthz.json")
    assert ok.returncode == 0, ok.stderr
    # A claim's update fails in the database for a reason the API has no answer for: 500.
    insert_app(sql, "com.example.app")
    sql.run(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN RAISE EXCEPTION 'refused by a test'; END$$"
    )
    sql.run("CREATE TRIGGER refuse BEFORE UPDATE ON apps FOR EACH ROW EXECUTE FUNCTION refuse()")
    local_tokens = ("UPLOAD_PASSWORD", "ADMIN_TOKEN")  # the events carry the local ones
    busy = cli(database_url, "invoke", "api", "events/queue.json", unset=local_tokens)
    answer = json.loads(busy.stdout.splitlines()[-1])
    assert answer["statusCode"] == 500, busy.stderr
    assert busy.returncode == 1
    # A client error is the API's answer, not a failure of the entry point.
    unauthorised = json.loads((handler.HERE / "events" / "queue.json").read_text())
    unauthorised["headers"].pop("authorization", None)
    path = tmp_path / "unauthorised.json"
    path.write_text(json.dumps(unauthorised))
    refused = cli(database_url, "invoke", "api", str(path), unset=local_tokens)
    assert json.loads(refused.stdout.splitlines()[-1])["statusCode"] == 401
    assert refused.returncode == 0, refused.stderr


def test_a_command_on_an_unmigrated_database_says_to_migrate(empty_database):
    for args in (("queue-status",), ("priority-report",)):
        out = cli(empty_database, *args)
        assert out.returncode == 1, out.stderr
        assert "run `python3 handler.py migrate` first" in out.stderr
        assert "Traceback" not in out.stderr


def test_serve_and_invoke_never_migrate_a_configured_database(empty_database):
    cli(empty_database, "invoke", "api", "events/healthz.json")
    sql = connect(empty_database)
    try:
        assert sql.run("SELECT to_regclass('schema_migrations')") == [[None]]
    finally:
        sql.close()


def test_queue_refetch_names_an_unknown_app_and_exits_1(database_url, sql):
    """The analyser hosts' exact-app mode waits for "Queued 1 apps": a bundle ID that is
    not in the queue says so, and the exit code says so too."""

    insert_app(sql, "com.example.known", status="analysed", version=4)
    done = cli(
        database_url,
        "queue-refetch",
        "--appid=COM.example.known",
        "--appid=com.example.nope",
        "--apply",
    )
    assert done.returncode == 1
    assert "Queued 1 apps for refetch." in done.stdout.splitlines()
    assert done.stderr.splitlines()[-1] == "unknown app: com.example.nope"
    known = cli(database_url, "queue-refetch", "--appid=com.example.known")
    assert known.returncode == 0 and "unknown app" not in known.stderr


def test_invoke_with_an_unreadable_event_says_so_in_one_line(database_url, tmp_path):
    missing = cli(database_url, "invoke", "api", str(tmp_path / "nope.json"))
    assert missing.returncode == 2
    assert (
        missing.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: cannot read the event {tmp_path / 'nope.json'}:")
    )
    assert "Traceback" not in missing.stderr
    (tmp_path / "list.json").write_text("[]")
    listed = cli(database_url, "invoke", "api", str(tmp_path / "list.json"))
    assert (listed.returncode, listed.stderr.strip()) == (
        2,
        f"error: the event {tmp_path / 'list.json'} is not a JSON object",
    )


@pytest.mark.parametrize("accepted", ["true", "false"])
def test_serve_and_invoke_announce_only_the_tokens_they_accept(database_url, accepted):
    """With the shared password turned off, no local upload password is announced (it
    would be refused: 401); the local admin token still is, and works."""
    env = {"ACCEPT_SHARED_UPLOAD_PASSWORD": accepted}
    local_tokens = ("UPLOAD_PASSWORD", "ADMIN_TOKEN")
    done = cli(database_url, "invoke", "api", "events/ping.json", unset=local_tokens, **env)
    announced = "UPLOAD_PASSWORD is unset; using 'local-upload-password' locally"
    assert (announced in done.stderr) == (accepted == "true"), done.stderr
    assert "ADMIN_TOKEN is unset; using 'local-admin-token' locally" in done.stderr
    ping = json.loads(done.stdout.splitlines()[-1])
    assert ping["statusCode"] == (200 if accepted == "true" else 401)
    if accepted == "false":
        assert "analysers need a token of their own" in done.stderr
    added = cli(database_url, "invoke", "api", "events/add-app.json", unset=local_tokens, **env)
    assert json.loads(added.stdout.splitlines()[-1])["statusCode"] == 201


def test_queue_status_json_is_the_scheduled_reports_document(database_url, sql):
    """`queue-status --json` prints the document the scheduled report logs and returns:
    held to the same expectation as the report (tests/test_entry_report.py), and equal to
    the report's answer but for the figures that move with the clock."""
    arrange_every_state(sql)
    printed = cli(database_url, "queue-status", "--json")
    assert printed.returncode == 0, printed.stderr
    document = json.loads(printed.stdout)
    assert_the_status_of_every_state(document)
    scheduled = cli(database_url, "invoke", "report", "events/schedule.json")
    assert scheduled.returncode == 0, scheduled.stderr
    reported = json.loads(scheduled.stdout.splitlines()[-1])

    def steady(status: dict) -> dict:
        moving = {**status, "minutes_since_last_ping": None}
        moving["processing"] = [{**p, "age_minutes": None} for p in status["processing"]]
        return moving

    assert steady(reported) == steady(document)


@pytest.mark.parametrize("command", [["queue-status", "--json"], ["priority-report"]])
def test_a_reader_that_stops_reading_is_no_error(database_url, sql, command):
    """`handler.py queue-status --json | head -1`: the reader goes away before the output
    is written. The command says nothing on stderr and exits as a shell expects of a
    SIGPIPE (141), not with `error: Broken pipe` (exit 1)."""
    insert_app(sql, "com.example.app")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the command writes a byte
    try:
        done = subprocess.run(
            [sys.executable, str(handler.HERE / "handler.py"), *command],
            env={**os.environ, "DATABASE_URL": database_url},
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (128 + signal.SIGPIPE, "")
