"""A refetch's outcomes, in one vocabulary (queued, waiting for a lease, lease broken,
and skipped for an app that changed under it): the dry run predicts what --apply does,
the CLI's lines and totals and the report function's answer say the same, and an app
deleted or changed by another connection between the selection and the apply gets a
documented outcome (two connections, the interleaving forced by a row lock, generated
many times), never a traceback or a refetch of an app the selection no longer means."""

from __future__ import annotations

import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import handler
from helpers import (
    ARRANGED_STATES,
    TEST_OPERATOR,
    LambdaContext,
    app_row,
    arrange,
    call_cli,
    connect,
)

PER_EXAMPLE = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
STATES = list(ARRANGED_STATES)


def empty(sql) -> None:
    sql.run("DELETE FROM app_analyses")
    sql.run("DELETE FROM apps")  # not TRUNCATE: that changes the catalogs


# Each way of selecting: (app_ids named, failed, include_non_retryable, limit).
MODES = {
    "named": (["race.x", "race.y"], False, False, None),
    "failed, limit": ([], True, False, 10),
    "failed, walk": ([], True, False, None),
    "every failure, walk": ([], True, True, None),
    "analysed, limit": ([], False, False, 10),
    "analysed, walk": ([], False, False, None),
}


def refetch(mode: str, apply: bool, force: bool) -> tuple[list[dict], handler.RefetchProgress]:
    app_ids, failed, include_non_retryable, limit = MODES[mode]
    rows: list[dict] = []
    request = handler.RefetchRequest(
        app_ids=tuple(app_ids),
        failed=failed,
        include_non_retryable=include_non_retryable,
        limit=limit,
        apply=apply,
        force=force,
    )
    progress = handler.refetch_in_batches(
        handler.api_connection(),
        request,
        lambda batch, _: rows.extend(batch),
        TEST_OPERATOR,
        policy=handler.settings().policy,
    )
    return rows, progress


# --- the dry run predicts --apply -------------------------------------------------------


@PER_EXAMPLE
@given(
    states=st.lists(st.sampled_from(STATES), min_size=1, max_size=8),
    mode=st.sampled_from(sorted(MODES)),
    force=st.booleans(),
)
def test_the_dry_run_says_what_apply_does(database_url, sql, states, mode, force):
    """Whatever the apps' states, the selection and --force, the dry run lists each app
    with the outcome --apply then gives it, and counts the same; nothing is written."""
    empty(sql)
    names = ["race.x", "race.y"] + [f"race.{n}" for n in range(len(states))]
    for appid, state in zip(names, states, strict=False):
        arrange(sql, appid, state)
    before = sql.run("SELECT * FROM apps ORDER BY appid")
    predicted, dry = refetch(mode, apply=False, force=force)
    assert sql.run("SELECT * FROM apps ORDER BY appid") == before
    done, applied = refetch(mode, apply=True, force=force)
    assert done == predicted
    assert applied.outcomes == dry.outcomes and applied.queued_now == dry.queued_now
    assert applied.outcomes["skipped"] == 0  # nothing changed in between
    for row in done:
        after = app_row(sql, row["appid"])
        if row["outcome"] == "waiting":
            assert after["status"] == "processing"
        else:
            assert after["status"] == "queued"


def cli(url: str, *args: str):
    return call_cli(*args, env={**os.environ, "DATABASE_URL": url})


@pytest.mark.parametrize("force", [False, True])
def test_the_cli_and_the_report_say_one_outcome(database_url, sql, force):
    """An app under a live lease: the dry run, --apply, and the report function's
    queue-refetch (dry and applied) all say it waits (or, with --force, that its lease
    is broken), and `Queued N` / `queuedNow` count only apps queued now."""
    arrange(sql, "race.leased", "live lease")
    arrange(sql, "race.done", "analysed")
    flags = ["--force"] if force else []
    named = ["--appid=race.leased", "--appid=race.done"]
    dry = cli(database_url, "queue-refetch", *named, *flags)
    assert dry.returncode == 0, dry.stderr
    waiting = handler.REFETCH_OUTCOMES["waiting"]
    broken = handler.REFETCH_OUTCOMES["lease_broken"]
    leased_line = f"  race.leased (processing): {broken if force else waiting}"
    assert leased_line in dry.stdout.splitlines()
    assert "  race.done (analysed): queued" in dry.stdout.splitlines()
    event = {"command": "queue-refetch", "appIds": ["race.leased", "race.done"], "force": force}
    reported = handler.report(event, LambdaContext())
    if force:
        assert dry.stdout.splitlines()[-2:] == [
            "Would queue 2 apps for refetch (dry run; add --apply).",
            "1 of them would have their lease broken (--force).",
        ]
        counts = {"queued": 1, "lease_broken": 1}
    else:
        assert dry.stdout.splitlines()[-2:] == [
            "Would queue 1 apps for refetch (dry run; add --apply).",
            "1 apps would wait for their leases to end (see above).",
        ]
        counts = {"queued": 1, "waiting": 1}
    outcomes = [{"outcome": o, "apps": counts.get(o, 0)} for o in handler.REFETCH_OUTCOMES]
    assert (reported["queuedNow"], reported["outcomes"]) == (2 if force else 1, outcomes)
    assert {app["appId"]: app["outcome"] for app in reported["apps"]} == {
        "race.leased": "lease_broken" if force else "waiting",
        "race.done": "queued",
    }

    done = cli(database_url, "queue-refetch", *named, "--apply", *flags)
    assert done.returncode == 0, done.stderr
    assert leased_line in done.stdout.splitlines()
    if force:
        assert done.stdout.splitlines()[-2:] == [
            "Queued 2 apps for refetch.",
            "1 of them had their lease broken (--force): their holders' claim tokens are refused.",
        ]
    else:
        assert done.stdout.splitlines()[-2:] == [
            "Queued 1 apps for refetch.",
            "1 apps wait for their leases to end (see above).",
        ]
    again = handler.report({**event, "apply": True}, LambdaContext())
    # Applied again: a waiting app still waits; a broken lease's app is queued by now.
    if force:
        assert [app["outcome"] for app in again["apps"]] == ["queued", "queued"]
    else:
        assert {app["appId"]: app["outcome"] for app in again["apps"]} == {
            "race.leased": "waiting",
            "race.done": "queued",
        }
        assert again["queuedNow"] == 1


# --- changed under it: two connections -------------------------------------------------

MUTATIONS = {
    "deleted": [
        "DELETE FROM app_analyses WHERE appid = 'race.x'",
        "DELETE FROM apps WHERE appid = 'race.x'",
    ],
    "analysed": [
        "UPDATE apps SET status = 'analysed', analysis = '{\"success\": true, \"new\": 1}',"
        " analysisversion = 4, analysed = now(), failure_reason = NULL,"
        " failure_retryable = NULL, processing_started = NULL, analysis_claim_token = NULL"
        " WHERE appid = 'race.x'"
    ],
    "failed": [
        "UPDATE apps SET status = 'failed', failure_reason = 'analysis_failed',"
        " failure_retryable = true, analysed = now(), processing_started = NULL,"
        " analysis_claim_token = NULL WHERE appid = 'race.x'"
    ],
    "failed for good": [
        "UPDATE apps SET status = 'failed', failure_reason = 'paid_app',"
        " failure_retryable = false, analysed = now(), processing_started = NULL,"
        " analysis_claim_token = NULL WHERE appid = 'race.x'"
    ],
    "claimed": [
        "UPDATE apps SET status = 'processing', processing_started = now(),"
        " analysis_claim_token = gen_random_uuid() WHERE appid = 'race.x'"
    ],
    "queued": [
        "UPDATE apps SET status = 'queued', processing_started = NULL,"
        " analysis_claim_token = NULL WHERE appid = 'race.x'"
    ],
    "untouched": [],
}
MUTATED_STATUS = {
    "analysed": "analysed",
    "failed": "failed",
    "failed for good": "failed",
    "claimed": "processing",
    "queued": "queued",
}


def selected_by(mode: str, status: str, retryable: bool | None) -> bool:
    """Whether the row, as the mutation left it, is one the selection means."""
    app_ids, failed, include_non_retryable, _ = MODES[mode]
    if app_ids:
        return True
    if failed:
        return status == "failed" and (bool(retryable) or include_non_retryable)
    return status == "analysed"


def expected_outcome(mode: str, mutation: str, initial: str, force: bool) -> str:
    if mutation == "deleted":
        return "skipped"
    status = MUTATED_STATUS.get(mutation)
    retryable = {"failed": True, "failed for good": False}.get(mutation)
    if status is None:  # untouched: as arranged
        status = {"live lease": "processing", "expired lease": "processing"}.get(
            initial, initial.split()[0]
        )
        retryable = initial == "failed"
    if not selected_by(mode, status, retryable):
        return "skipped"
    if status == "processing" and force:
        return "lease_broken"
    live = mutation == "claimed" or (mutation == "untouched" and initial == "live lease")
    return "waiting" if status == "processing" and live else "queued"


def refetch_while_another_connection_changes_the_row(url: str, sql, mode, force, statements):
    """The pair, interleaved: another connection locks race.x; the refetch (on the
    service's connection, in a thread) reads its selection and blocks on that lock in
    its apply; the other connection changes (or deletes) race.x and commits; the refetch
    goes on. The lock makes the order certain, whatever the machine's speed."""
    other = connect(url)
    outcome: dict = {}
    try:
        other.run("BEGIN")
        other.run("SELECT 1 FROM apps WHERE appid = 'race.x' FOR UPDATE")

        def run() -> None:
            try:
                outcome["rows"], outcome["progress"] = refetch(mode, apply=True, force=force)
            except BaseException as error:  # raised in the main thread
                outcome["error"] = error

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 60  # a hang, not a speed: the lock is waited for
        while thread.is_alive() and time.monotonic() < deadline:
            ((waiting,),) = sql.run(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND application_name = :name",
                name=handler.SERVICE_NAME,
            )
            if waiting:
                break
            time.sleep(0.01)
        assert thread.is_alive(), "the refetch did not wait for the row another connection holds"
        for statement in statements:
            other.run(statement)
        other.run("COMMIT")
        thread.join(60)
        assert not thread.is_alive()
    finally:
        other.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["rows"], outcome["progress"]


@PER_EXAMPLE
@given(
    mode=st.sampled_from(sorted(MODES)),
    mutation=st.sampled_from(sorted(MUTATIONS)),
    initial=st.sampled_from(STATES),
    force=st.booleans(),
)
def test_an_app_changed_between_selection_and_apply_gets_a_documented_outcome(
    database_url, sql, mode, mutation, initial, force
):
    """Another connection deletes race.x, or changes its state, after the refetch read
    its selection and before it applied it. The refetch finishes; race.x's outcome is
    what the rule gives the row as it now is, reported with the status the apply found
    (skipped when it is gone or no longer what the selection means: left as it is, and
    reported as selected); race.y, selected beside it, is refetched as usual."""
    app_ids, failed, _, _ = MODES[mode]
    if not app_ids:  # selected by state: race.x is in the selection to begin with
        initial = "failed" if failed else "analysed"
    empty(sql)
    arrange(sql, "race.x", initial, reviews=5)
    arrange(sql, "race.y", "failed" if failed else "analysed", reviews=1)
    rows, progress = refetch_while_another_connection_changes_the_row(
        database_url, sql, mode, force, MUTATIONS[mutation]
    )
    by_app = {row["appid"]: row for row in rows}
    assert set(by_app) == {"race.x", "race.y"}
    expected = expected_outcome(mode, mutation, initial, force)
    assert by_app["race.x"]["outcome"] == expected, (mode, mutation, initial)
    assert by_app["race.y"]["outcome"] == "queued"
    assert sum(progress.outcomes.values()) == progress.selected == 2
    after = app_row(sql, "race.x")
    if mutation == "deleted":
        assert after is None
        return
    ((requested,),) = sql.run("SELECT refetch_requested FROM apps WHERE appid = 'race.x'")
    if expected == "skipped":
        assert after["status"] == MUTATED_STATUS[mutation] and not requested
    elif expected == "waiting":
        assert after["status"] == "processing" and requested
    else:
        assert after["status"] == "queued"
    if mutation in MUTATED_STATUS and expected != "skipped":
        assert by_app["race.x"]["status"] == MUTATED_STATUS[mutation]  # as the apply found it
