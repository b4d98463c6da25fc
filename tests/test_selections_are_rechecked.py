"""A selection and its apply are one act (docs/queue.md, "Every act is one act"): every
route and command that applies a selection re-checks, on each selected row under its
lock, the condition the selection was made with, and leaves a row that no longer meets
it as it is ("skipped"): never a second hand-out of an app claimed in between, never a
refetch of an app analysed in between when failed ones were asked for.

Every function of handler.py that calls the apply (handler.refetch_in_batches) is found
in its source, and each must be a route's work, a command or an entry point this walk
knows how to send a selection (ENTRIES): one added later fails the walk until it is
taught. Each generated case arranges apps in every state, sends a selection through one
entry while another connection holds every app's row lock, changes the apps' states (or
deletes them) once the entry waits for those locks, and lets go; the outcome, each app's
row and the entry's own count of outcomes, must be what the selection's condition,
evaluated on the rows as they then are, gives.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN, ROOT, configure_service

import handler
from helpers import ARRANGED_STATES, LambdaContext, arrange, connect, gateway_event, lock_waiters

APPS = ("sel.a", "sel.b", "sel.c", "other.d", "other.e")
MUTATIONS = {
    "untouched": [],
    "deleted": ["DELETE FROM app_analyses WHERE appid = :a", "DELETE FROM apps WHERE appid = :a"],
    "claimed": [
        "UPDATE apps SET status = 'processing', processing_started = now(),"
        " analysis_claim_token = CAST(:t AS uuid), failure_reason = NULL,"
        " failure_retryable = NULL WHERE appid = :a"
    ],
    "analysed": [
        "UPDATE apps SET status = 'analysed', analysis = '{\"success\": true, \"new\": 1}',"
        " analysisversion = 4, analysed = now(), failure_reason = NULL,"
        " failure_retryable = NULL, processing_started = NULL, analysis_claim_token = NULL"
        " WHERE appid = :a"
    ],
    "failed otherwise": [
        "UPDATE apps SET status = 'failed', failure_reason = 'app_not_found',"
        " failure_retryable = false, analysed = now(), processing_started = NULL,"
        " analysis_claim_token = NULL WHERE appid = :a"
    ],
}
LEASE_MINUTES = 120  # PROCESSING_TIMEOUT_MINUTES's default: the live lease is 5 min old


ROW = (
    "SELECT appid, status, failure_reason, failure_retryable, refetch_requested,"
    " analysis_claim_token::text AS token, app_popularity(details) AS popularity, added,"
    " processing_started > now() - make_interval(mins => :minutes) AS live"
    " FROM apps ORDER BY appid"
)


def rows(sql) -> dict[str, dict[str, Any]]:
    columns = ["appid", "status", "reason", "retryable", "requested", "token", "pop", "added"]
    return {
        row[0]: dict(zip([*columns, "live"], row, strict=True))
        for row in sql.run(ROW, minutes=LEASE_MINUTES)
    }


# --- the selection's condition, in Python ----------------------------------------------


def matches(form: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a row meets the condition of the selection `form` (the fields of a
    handler.RefetchRequest)."""
    if form["app_ids"]:
        return row["appid"].lower() in {a.lower() for a in form["app_ids"]}
    if not row["appid"].lower().startswith(form["prefix"]):
        return False
    if not form["failed"]:
        return row["status"] == "analysed"
    return (
        row["status"] == "failed"
        and (row["retryable"] or form["include_non_retryable"])
        and row["reason"] != "invalid_bundle_id"
        and form["reason"] in (None, row["reason"])
    )


def expected(form: dict[str, Any], before: dict, after: dict) -> dict[str, str]:
    """Each app the selection read (on `before`, the rows as arranged), and its outcome
    on `after`, the rows as changed under it."""
    chosen = sorted(
        (row for row in before.values() if matches(form, row)),
        key=lambda row: (-row["pop"], row["added"], row["appid"]),
    )[: form["limit"]]
    outcomes = {}
    for row in chosen:
        now = after.get(row["appid"])
        if now is None or not matches(form, now):
            outcomes[row["appid"]] = "skipped"
        elif now["status"] == "processing" and form["force"]:
            outcomes[row["appid"]] = "lease_broken"
        elif now["status"] == "processing" and now["live"]:
            outcomes[row["appid"]] = "waiting"
        else:
            outcomes[row["appid"]] = "queued"
    return outcomes


# --- the entries: every way in to the apply ---------------------------------------------


def web(form: dict[str, Any]) -> Counter:
    """POST /admin/api/refetch: named apps, or a filter of failed ones (every failure)."""
    if form["app_ids"]:
        body = {"appIds": list(form["app_ids"]), "force": form["force"]}
    else:
        where = {"state": "failed", "reason": form["reason"], "q": form["prefix"]}
        body = {"filter": where, "force": form["force"]}
    headers = {**{k.lower(): v for k, v in ADMIN.items()}, "content-type": "application/json"}
    event = gateway_event("POST", "/admin/api/refetch", "", headers, json.dumps(body))
    answer = handler.api(event, LambdaContext("analysis-queue-ApiFunction"))
    assert answer["statusCode"] == 200, answer
    return Counter({k: v for k, v in json.loads(answer["body"])["outcomes"].items() if v})


def cli(form: dict[str, Any]) -> Counter:
    """`queue-refetch ... --apply --yes`, run as main() runs it; each app's line read."""
    args = ["queue-refetch", "--apply", "--yes", *(["--force"] if form["force"] else [])]
    for app_id in form["app_ids"]:
        args += ["--appid", app_id]
    if form["failed"]:
        args.append("--failed")
    if form["include_non_retryable"]:
        args.append("--include-non-retryable")
    if form["reason"]:
        args += ["--reason", form["reason"]]
    if form["prefix"]:
        args += ["--prefix", form["prefix"]]
    if form["limit"] is not None:
        args += ["--limit", str(form["limit"])]
    words = {text: outcome for outcome, text in handler.REFETCH_OUTCOMES.items()}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert handler.main(args) == 0
    said = [line.split("): ", 1)[1] for line in printed.getvalue().splitlines() if line[:2] == "  "]
    return Counter(words[text] for text in said)


def report(form: dict[str, Any]) -> Counter:
    """The report function's {"command": "queue-refetch", "apply": true, ...}."""
    names = handler.REFETCH_EVENT_NAMES
    event = {"command": "queue-refetch", "apply": True, "force": form["force"]}
    if form["app_ids"]:
        event[names["app_ids"]] = list(form["app_ids"])
    for field in ("failed", "include_non_retryable", "reason", "limit"):
        if form[field] not in (None, False):
            event[names[field]] = form[field]
    if form["prefix"]:
        event[names["prefix"]] = form["prefix"]
    answer = handler.report(event, LambdaContext("analysis-queue-ReportFunction"))
    return Counter(app["outcome"] for app in answer["apps"])


# Every caller of the apply, by the name of its function in handler.py, and how to send
# it a selection (what the entry can ask for).
ENTRIES = {"_api_refetch": web, "_cli_queue_refetch": cli, "report": report}


def callers_of_the_apply() -> set[str]:
    """The functions of handler.py whose body calls refetch_in_batches."""
    tree = ast.parse((ROOT / "handler.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.Call)
                    and isinstance(inner.func, ast.Name)
                    and inner.func.id == "refetch_in_batches"
                ):
                    found.add(node.name)
    return found


def test_the_walk_knows_every_caller_of_the_apply():
    assert callers_of_the_apply() == set(ENTRIES)


def forms(entry: str) -> st.SearchStrategy[dict[str, Any]]:
    named = st.fixed_dictionaries(
        {
            "app_ids": st.lists(st.sampled_from(APPS), min_size=1, unique=True).map(tuple),
            "failed": st.just(False),
            "include_non_retryable": st.just(False),
            "reason": st.none(),
            "prefix": st.just(""),
            "limit": st.none(),
        }
    )
    failed = st.fixed_dictionaries(
        {
            "app_ids": st.just(()),
            "failed": st.just(True),
            "include_non_retryable": st.just(True) if entry == "_api_refetch" else st.booleans(),
            "reason": st.sampled_from([None, "analysis_failed", "paid_app"]),
            "prefix": st.sampled_from(["", "sel.", "other"]),
            "limit": st.just(handler.BULK_REFETCH_LIMIT)
            if entry == "_api_refetch"
            else st.sampled_from([None, 1, 2]),
        }
    )
    analysed = st.fixed_dictionaries(
        {
            "app_ids": st.just(()),
            "failed": st.just(False),
            "include_non_retryable": st.just(False),
            "reason": st.none(),
            "prefix": st.sampled_from(["", "sel.", "other"]),
            "limit": st.sampled_from([None, 1, 2]),
        }
    )
    kinds = (
        st.one_of(named, failed) if entry == "_api_refetch" else st.one_of(named, failed, analysed)
    )
    return st.tuples(kinds, st.booleans()).map(lambda pair: {**pair[0], "force": pair[1]})


def apply_while_the_rows_change(url: str, send, form, mutations: dict[str, str]) -> Counter:
    """send(form) on this thread; another connection holds every app's row lock, and once
    the entry waits for one (or has ended without needing one) changes the apps and lets
    go. The lock makes the order certain, whatever the machine's speed."""
    holder, watcher = connect(url), connect(url)
    ended = threading.Event()
    problems: list[BaseException] = []

    def change_under_it() -> None:
        try:
            deadline = time.monotonic() + 60  # a hang, not a speed
            while not ended.is_set() and lock_waiters(watcher) == 0:
                assert time.monotonic() < deadline, "the entry neither waited nor ended"
                time.sleep(0.005)
            for appid, mutation in mutations.items():
                for statement in MUTATIONS[mutation]:
                    holder.run(statement, a=appid, t=token_of(appid))
            holder.run("COMMIT")
        except BaseException as error:  # raised on the test's thread
            problems.append(error)
            holder.run("ROLLBACK")

    try:
        holder.run("BEGIN")
        holder.run("SELECT 1 FROM apps FOR UPDATE")
        changer = threading.Thread(target=change_under_it, daemon=True)
        changer.start()
        try:
            counted = send(form)
        finally:
            ended.set()
            changer.join(60)
    finally:
        holder.close()
        watcher.close()
    if problems:
        raise problems[0]
    return counted


def token_of(appid: str) -> str:
    """The claim token the "claimed" change gives an app: known, so that a lease broken
    and handed out again would show."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, appid))


def changed(row: dict[str, Any], mutation: str) -> dict[str, Any] | None:
    """The row as a change leaves it (None: deleted)."""
    if mutation == "deleted":
        return None
    if mutation == "claimed":
        cleared = {"reason": None, "retryable": None, "live": True, "token": token_of(row["appid"])}
        return {**row, "status": "processing", **cleared}
    if mutation == "analysed":
        cleared = {"reason": None, "retryable": None, "live": None, "token": None}
        return {**row, "status": "analysed", **cleared}
    if mutation == "failed otherwise":
        return {
            **row,
            "status": "failed",
            "reason": "app_not_found",
            "retryable": False,
            "live": None,
            "token": None,
        }
    return row


def state(row: dict[str, Any]) -> tuple:
    return row["status"], row["reason"], row["retryable"], row["requested"], row["token"]


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_selection_changed_under_its_apply_gets_what_its_condition_says(
    entry, database_url, sql, monkeypatch
):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        states=st.lists(st.sampled_from(ARRANGED_STATES), min_size=len(APPS), max_size=len(APPS)),
        order=st.permutations(range(len(APPS))),
        mutations=st.lists(
            st.sampled_from(sorted(MUTATIONS)), min_size=len(APPS), max_size=len(APPS)
        ),
        form=forms(entry),
    )
    def case(states, order, mutations, form):
        sql.run("DELETE FROM app_analyses")
        sql.run("DELETE FROM apps")
        for appid, state_, reviews in zip(APPS, states, order, strict=True):
            arrange(sql, appid, state_, reviews)
        before = rows(sql)
        changes = dict(zip(APPS, mutations, strict=True))
        counted = apply_while_the_rows_change(database_url, ENTRIES[entry], form, changes)
        after = rows(sql)
        made = {a: changed(row, changes[a]) for a, row in before.items()}
        want = expected(form, before, {a: row for a, row in made.items() if row is not None})
        assert counted == Counter(want.values()), (form, changes)
        for appid in APPS:
            outcome, now, then = want.get(appid), after.get(appid), made[appid]
            if then is None:
                assert now is None
            elif outcome in ("queued", "lease_broken"):
                assert (now["status"], now["token"]) == ("queued", None), (appid, form)
            elif outcome == "waiting":
                assert (now["status"], now["requested"]) == ("processing", True), (appid, form)
                assert now["token"] == then["token"], (appid, form)  # the same lease
            else:  # skipped, or never selected: as the change left it
                assert state(now) == state(then), (appid, outcome, form, changes)

    case()


ODD_IDS = ("com.odd.trailing.", "com.odd space", "com.odd\nnewline", "", "..", "ünïcode.app")


@pytest.mark.private_database  # drops sql/003's CHECK to write old rows, then puts it back
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_an_old_rows_invalid_bundle_id_is_never_selected(entry, database_url, sql, monkeypatch):
    """Rows older than sql/003 keep bundle IDs its CHECK refuses (it is NOT VALID: it
    guards writes only), in any state and with any failure reason. No selection by state
    takes one: applied, it would fail its batch on the CHECK (a 500, nothing queued), and
    without the CHECK it would hand out a bundle ID no analyser can upload for."""
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    sql.run("ALTER TABLE apps DROP CONSTRAINT apps_appid_valid")
    for n, appid in enumerate(ODD_IDS):
        arrange(sql, appid, ("failed", "failed for good", "analysed")[n % 3], reviews=100 + n)
    sql.run("UPDATE apps SET failure_reason = 'app_not_found' WHERE status = 'failed'")
    sql.run(
        "ALTER TABLE apps ADD CONSTRAINT apps_appid_valid CHECK (length(appid) BETWEEN 1 AND 255"
        " AND appid ~ '^[A-Za-z0-9][A-Za-z0-9.-]*$' AND appid !~ '\\.$') NOT VALID"
    )
    arrange(sql, "com.valid.failed", "failed", reviews=1)
    arrange(sql, "com.valid.analysed", "analysed", reviews=1)
    before = rows(sql)
    selections = [{"failed": True, "include_non_retryable": True, "reason": None}]
    if entry != "_api_refetch":
        selections.append({"failed": False, "include_non_retryable": False, "reason": None})
    for selection in selections:
        form = {"app_ids": (), "prefix": "", "limit": None, "force": True, **selection}
        if entry == "_api_refetch":
            form["limit"] = handler.BULK_REFETCH_LIMIT
        assert ENTRIES[entry](form) == Counter({"queued": 1}), form
    after = rows(sql)
    for appid in ODD_IDS:
        assert state(after[appid]) == state(before[appid]), appid
    assert {after[a]["status"] for a in ("com.valid.failed",)} == {"queued"}


@pytest.mark.parametrize("flag", ["--failed", "--include-non-retryable", "--reason", "--prefix"])
def test_a_state_filter_beside_named_apps_is_refused(flag, database_url, sql, monkeypatch):
    """Named apps are the selection; a filter by state beside them would be ignored, so
    it is refused (exit 2, nothing changed), as the report function and the web view
    refuse it."""
    configure_service(monkeypatch, database_url)
    arrange(sql, "com.named.app", "analysed")
    before = rows(sql)
    extra = {"--reason": ["app_not_found"], "--prefix": ["com"]}.get(flag, [])
    args = ["queue-refetch", "--appid", "com.named.app", "--failed", flag, *extra, "--apply"]
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        assert handler.main(list(dict.fromkeys(args))) == 2
    assert "not with --appid" in printed.getvalue()
    event = {"command": "queue-refetch", "appIds": ["com.named.app"], "failed": True, "apply": True}
    with pytest.raises(handler.BadInput, match="not with appIds"):
        handler.report(event, LambdaContext("analysis-queue-ReportFunction"))
    assert rows(sql) == before


def post_refetch(body: dict[str, Any]) -> dict[str, Any]:
    headers = {**{k.lower(): v for k, v in ADMIN.items()}, "content-type": "application/json"}
    event = gateway_event("POST", "/admin/api/refetch", "", headers, json.dumps(body))
    answer = handler.api(event, LambdaContext("analysis-queue-ApiFunction"))
    assert answer["statusCode"] == 200, answer
    return json.loads(answer["body"])


@pytest.mark.parametrize(
    "body",
    [
        {"appIds": list(APPS), "force": True},
        {"filter": {"state": "failed", "reason": None, "q": "sel."}},
    ],
    ids=["named", "filter"],
)
def test_the_admin_apis_dry_run_says_what_the_apply_does_and_changes_nothing(
    body, database_url, sql, monkeypatch
):
    """POST /admin/api/refetch with "dryRun": true answers the outcomes the same request
    without it then has, and changes and records nothing (as queue-refetch without
    --apply)."""
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    for appid, state in zip(APPS, ARRANGED_STATES, strict=False):
        arrange(sql, appid, state)
    arrange(sql, "sel.f", "failed for good")
    before = sql.run("SELECT * FROM apps ORDER BY appid"), sql.run("TABLE operator_actions")

    dry = post_refetch({**body, "dryRun": True})
    assert (sql.run("SELECT * FROM apps ORDER BY appid"), sql.run("TABLE operator_actions")) == (
        before
    )
    applied = post_refetch(body)
    assert (dry["applied"], applied["applied"]) == (False, True)
    assert {k: v for k, v in dry.items() if k != "applied"} == {
        k: v for k, v in applied.items() if k != "applied"
    }
    assert applied["outcomes"]["queued"] >= 1  # the apply changed apps
    assert sql.run("TABLE operator_actions") != before[1]


@pytest.mark.parametrize("flag", ["force", "dryRun"])
@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_the_admin_apis_flags_are_booleans_or_refused(flag, value, database_url, sql, monkeypatch):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    arrange(sql, "sel.a", "failed")
    before = sql.run("SELECT * FROM apps")
    headers = {**{k.lower(): v for k, v in ADMIN.items()}, "content-type": "application/json"}
    body = json.dumps({"appIds": ["sel.a"], flag: value})
    event = gateway_event("POST", "/admin/api/refetch", "", headers, body)
    answer = handler.api(event, LambdaContext("analysis-queue-ApiFunction"))
    assert answer["statusCode"] == 400
    assert '"dryRun" true or false' in json.loads(answer["body"])["detail"]
    assert sql.run("SELECT * FROM apps") == before
