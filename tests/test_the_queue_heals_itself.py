"""A queue that heals itself (docs/operations.md, "Pausing and holding"; docs/monitoring.md,
"A broken analyser"), against the real PostgreSQL: pauses and holds committed while claims
run (threads; what is checked is which claim began after which commit, never a time),
the undo of a broken analyser's failures (queue-refetch --failed-by NAME --since T), a
broken analyser told apart from a fleet's bad hour, the operator's whole scenario through
the HTTP routes and the CLI, and the parity of the operators' three ways in (the web
view's actions, the CLI, the report function)."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime, timedelta

import kit
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN, ANALYSER, configure_service

import handler
from helpers import (
    TEST_OPERATOR,
    LambdaContext,
    call_cli,
    database_at,
    days_ago,
    insert_app,
    load_event,
    output_records,
)

TOKEN_HEADER = handler.CLAIM_TOKEN_HEADER
VERSION = 4  # CURRENT_ANALYSIS_VERSION as the tests configure it (the default)


# --- the analysers' side ---------------------------------------------------------------


def add_analyser(client, name: str) -> dict[str, str]:
    """A named analyser added through the admin API; its Authorization header."""
    added = client.post("/analysers", json={"name": name}, headers=ADMIN)
    assert added.status_code == 201, added.text
    return {"Authorization": f"Bearer {added.json()['token']}"}


def claim(client, headers: dict[str, str], app_id: str | None = None) -> tuple[str, str | None]:
    """GET /queue: (the bundle ID, "" for none; the claim token)."""
    answer = client.get("/queue", headers=headers, params={"appId": app_id} if app_id else None)
    assert answer.status_code == 200, answer.text
    return answer.text, answer.headers.get(TOKEN_HEADER)


def upload(client, headers: dict[str, str], app_id: str, token: str | None):
    """POST /uploadAnalysis: a successful analysis of app_id at the current version."""
    return client.post(
        f"/uploadAnalysis?appId={app_id}&analysisVersion={VERSION}",
        json={"success": True, "bundleID": app_id, "trackers": {}},
        headers={**headers, **({TOKEN_HEADER: token} if token else {})},
    )


def fail(client, headers: dict[str, str], app_id: str, token: str | None, log: str = "usb gone"):
    """POST /reportAnalysisFailure: a failure log (retryable unless the log says
    otherwise: "app not found" is app_not_found, which is not)."""
    return client.post(
        f"/reportAnalysisFailure?appId={app_id}&analysisVersion={VERSION}",
        content=log.encode(),
        headers={
            **headers,
            "Content-Type": "text/plain",
            **({TOKEN_HEADER: token} if token else {}),
        },
    )


def cli(*args: str) -> tuple[int, str, str]:
    """The CLI in this process, on the service's database (exit code, stdout, stderr)."""
    done = call_cli(*args, env=dict(os.environ))
    return done.returncode, done.stdout, done.stderr


def columns(sql, app_id: str, *names: str) -> tuple:
    """The app's columns `names`, as stored."""
    (row,) = sql.run(f"SELECT {', '.join(names)} FROM apps WHERE appid = :appid", appid=app_id)
    return tuple(row)


def actions(sql, action: str) -> list[list]:
    """The operator_actions rows of `action`: (actor, app_id, analyser, outcome)."""
    return sql.run(
        "SELECT actor, app_id, analyser, outcome FROM operator_actions WHERE action = :action"
        " ORDER BY at, id",
        action=action,
    )


# --- claims on threads of their own ----------------------------------------------------


class Claimers:
    """Claimers on threads of their own, each with its own connection (a process of the
    service each), claiming through handler.claim_next_app until told to stop (or the
    queue is empty for them after `stop` is set). Each claim is recorded with what was
    committed when it began: `began_after` says whether the event `mark` was set before
    the claim started (its statement's snapshot is taken after that), and `seen` is a
    copy of the `watched` set then."""

    def __init__(self, url: str, analysers: list[str | None], policy: handler.QueuePolicy):
        self.url, self.analysers, self.policy = url, analysers, policy
        self.mark = threading.Event()
        self.stop = threading.Event()
        self.watched: set[str] = set()
        self.lock = threading.Lock()
        self.claims: list[dict] = []
        self.progress = threading.Semaphore(0)
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self.run, args=(name,), daemon=True) for name in analysers
        ]

    def run(self, analyser: str | None) -> None:
        db = database_at(self.url)
        try:
            empty_after_stop = 0
            while empty_after_stop < 2:
                stopping = self.stop.is_set()
                with self.lock:
                    began_after, seen = self.mark.is_set(), set(self.watched)
                got = handler.claim_next_app(db, self.policy, analyser=analyser)
                with self.lock:
                    self.claims.append(
                        {
                            "analyser": analyser,
                            "began_after": began_after,
                            "seen": seen,
                            "app": got[0] if got else None,
                        }
                    )
                self.progress.release()
                if stopping:
                    empty_after_stop += 1
        except BaseException as error:  # asserted by the test
            self.errors.append(error)
        finally:
            db.discard()

    def __enter__(self) -> Claimers:
        for thread in self.threads:
            thread.start()
        return self

    def wait_for(self, claims: int) -> None:
        """Until `claims` more claims ended (counted, not timed; a hang fails)."""
        for _ in range(claims):
            assert self.progress.acquire(timeout=120), "the claimers stopped making progress"

    def wait_until(self, done, most: int = 5000) -> None:
        """Until done(claims so far) holds, checked after each claim that ends; at most
        `most` claims (counted, not timed), or it fails."""
        for _ in range(most):
            with self.lock:
                if done(list(self.claims)):
                    return
            self.wait_for(1)
        raise AssertionError(f"not done after {most} claims")

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads), "a claimer hangs"
        assert not self.errors, self.errors


def many_apps(sql, count: int, prefix: str = "heal.app") -> list[str]:
    """`count` queued apps, the first the most popular; their bundle IDs in claim order."""
    ids = [f"{prefix}{index:03d}" for index in range(count)]
    for index, app_id in enumerate(ids):
        insert_app(sql, app_id, reviews=str(10_000 - index))
    return ids


# --- pauses against claims -------------------------------------------------------------


def test_no_claim_that_began_after_a_queue_pause_hands_out_an_app(database_url, sql):
    """Claimers (two named analysers and two shared-password hosts) claim while the queue
    is paused: every claim that began after the pause committed answers empty, though apps
    are left; after queue-resume the claims hand them out again."""
    policy = handler.settings().policy
    for name in ("pi-a", "pi-b"):
        sql.run(
            "INSERT INTO analysers (name, token_hash) VALUES (:name, :hash)",
            name=name,
            hash=handler.token_hash(f"aqa_{name}"),
        )
    rounds = 3
    many_apps(sql, 100 * rounds)
    operator_db = database_at(database_url)
    try:
        for _ in range(rounds):
            with Claimers(database_url, ["pi-a", "pi-b", None, None], policy) as claimers:
                claimers.wait_for(6)  # some claims before the pause
                paused = handler.pause_queue(operator_db, TEST_OPERATOR, True, "race")
                assert paused["outcome"] == "paused"
                claimers.mark.set()  # after the commit: a claim that starts now sees it
                claimers.wait_for(12)  # claims after it
            after = [c for c in claimers.claims if c["began_after"]]
            assert len(after) >= 8
            assert [c for c in after if c["app"] is not None] == []
            handed = [c["app"] for c in claimers.claims if c["app"] is not None]
            assert len(handed) == len(set(handed))  # no app handed out twice
            ((queued,),) = sql.run("SELECT count(*) FROM apps WHERE status = 'queued'")
            assert queued > 0  # the empty answers were the pause's, not an empty queue
            resumed = handler.pause_queue(operator_db, TEST_OPERATOR, False)
            assert resumed["outcome"] == "resumed"
            assert handler.claim_next_app(operator_db, policy) is not None
    finally:
        operator_db.discard()
    assert [row[3] for row in actions(sql, "pause queue")] == ["race"] * rounds
    assert len(actions(sql, "resume queue")) == rounds


def test_no_claim_that_began_after_an_analysers_pause_hands_it_an_app(database_url, sql):
    """pi-a is paused while it and pi-b claim: no claim of pi-a's that began after the
    pause committed gets an app; pi-b's go on getting them; after resume pi-a gets one."""
    policy = handler.settings().policy
    for name in ("pi-a", "pi-b"):
        sql.run(
            "INSERT INTO analysers (name, token_hash) VALUES (:name, :hash)",
            name=name,
            hash=handler.token_hash(f"aqa_{name}"),
        )
    many_apps(sql, 150)
    operator_db = database_at(database_url)
    try:
        with Claimers(database_url, ["pi-a", "pi-a", "pi-b"], policy) as claimers:
            claimers.wait_for(6)
            done = handler.pause_analyser(operator_db, TEST_OPERATOR, "pi-a", True)
            assert done["outcome"] == "paused"
            claimers.mark.set()

            def each_claimed_after(claims) -> bool:
                after = [c for c in claims if c["began_after"]]
                return len([c for c in after if c["analyser"] == "pi-a"]) >= 4 and any(
                    c["analyser"] == "pi-b" and c["app"] for c in after
                )

            claimers.wait_until(each_claimed_after)
        after = [c for c in claimers.claims if c["began_after"]]
        assert [c for c in after if c["analyser"] == "pi-a" and c["app"] is not None] == []
        assert [c for c in after if c["analyser"] == "pi-b" and c["app"] is not None]
        handler.pause_analyser(operator_db, TEST_OPERATOR, "pi-a", False)
        assert handler.claim_next_app(operator_db, policy, analyser="pi-a") is not None
    finally:
        operator_db.discard()
    ((paused, resumed),) = sql.run(
        "SELECT count(*) FILTER (WHERE action = 'pause analyser'),"
        " count(*) FILTER (WHERE action = 'resume analyser') FROM operator_actions"
        " WHERE analyser = 'pi-a'"
    )
    assert (paused, resumed) == (1, 1)


def test_a_paused_analyser_keeps_its_lease_its_pings_and_its_result(client, sql):
    """While paused, pi-a's GET /queue answers 200 and empty (exact-app mode too), its
    /ping counts, the lease it holds stays its own (the promoter leaves it, the analysers
    list shows it) and its result with that lease's token is stored as its own; resumed,
    it is handed apps again. Another analyser is not paused with it."""
    insert_app(sql, "heal.first", reviews="30")
    insert_app(sql, "heal.second", reviews="20")
    insert_app(sql, "heal.third", reviews="10")
    pi_a, pi_b = add_analyser(client, "pi-a"), add_analyser(client, "pi-b")
    app_id, token = claim(client, pi_a)
    assert app_id == "heal.first"
    paused = client.post("/analysers/pi-a/pause", headers=ADMIN)
    assert (paused.status_code, paused.json()["outcome"]) == (200, "paused")
    assert claim(client, pi_a) == ("", None)
    assert claim(client, pi_a, "heal.second") == ("", None)
    sql.run("UPDATE analysers SET last_seen = NULL WHERE name = 'pi-a'")
    assert client.get("/ping", headers=pi_a).status_code == 200
    ((seen,),) = sql.run("SELECT last_seen FROM analysers WHERE name = 'pi-a'")
    assert seen is not None
    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    (listed,) = [a for a in client.get("/analysers", headers=ADMIN).json()["analysers"]
                 if a["name"] == "pi-a"]  # fmt: skip
    assert listed["holding"]["appId"] == "heal.first"
    assert listed["paused"]["by"].startswith("admin token")
    assert columns(sql, "heal.first", "status", "claimed_by", "claimed_with") == (
        "processing",
        "pi-a",
        columns(sql, "heal.first", "analysis_claim_token")[0],
    )
    # Another analyser is handed apps meanwhile.
    assert claim(client, pi_b)[0] == "heal.second"
    stored = upload(client, pi_a, "heal.first", token)
    assert stored.status_code == 200, stored.text
    assert columns(sql, "heal.first", "status", "analysed_by") == ("analysed", "pi-a")
    resumed = client.post("/analysers/pi-a/resume", headers=ADMIN)
    assert (resumed.status_code, resumed.json()["outcome"]) == (200, "resumed")
    assert claim(client, pi_a)[0] == "heal.third"
    # Pausing twice, resuming twice: nothing changes, nothing more is recorded.
    assert client.post("/analysers/pi-a/resume", headers=ADMIN).json()["outcome"] == "unchanged"
    assert [row[2] for row in actions(sql, "pause analyser")] == ["pi-a"]
    assert [row[2] for row in actions(sql, "resume analyser")] == ["pi-a"]


# --- holds against claims --------------------------------------------------------------


def test_no_claim_hands_out_an_app_after_its_hold_committed(database_url, sql):
    """Claimers claim while an operator holds apps one by one: no claim that began after a
    hold committed hands out that app, and no app held before any claim took it is ever
    handed out (a claim that took it first leaves the hold waiting for its lease);
    released, the held apps are handed out again."""
    policy = handler.settings().policy
    apps = many_apps(sql, 150)
    # Held from the back of the queue while the claimers take it from the front: they
    # meet, so some holds come first and some claims do.
    to_hold = apps[:20:-2]
    outcomes: dict[str, str] = {}
    operator_db = database_at(database_url)
    try:
        with Claimers(database_url, ["pi-a", None, None], policy) as claimers:
            claimers.wait_for(4)
            for app_id in to_hold:
                held = handler.hold_app(operator_db, TEST_OPERATOR, app_id, "race", False)
                outcomes[app_id] = held["outcome"]
                with claimers.lock:
                    claimers.watched.add(app_id)
            claimers.wait_for(10)
        after_hold = [c for c in claimers.claims if c["app"] in c["seen"]]
        assert after_hold == []
        handed = [c["app"] for c in claimers.claims if c["app"] is not None]
        assert len(handed) == len(set(handed))
        held_first = {app_id for app_id, outcome in outcomes.items() if outcome == "held"}
        assert held_first and set(handed) & held_first == set()
        assert set(outcomes.values()) <= {"held", "waiting"}
        for app_id, outcome in outcomes.items():
            status = "queued" if outcome == "held" else "processing"
            assert columns(sql, app_id, "status") == (status,), app_id
        for app_id in held_first:
            assert handler.release_app(operator_db, TEST_OPERATOR, app_id)["outcome"] == "released"
        released = set()
        while got := handler.claim_next_app(operator_db, policy):
            released.add(got[0])
        assert held_first <= released
    finally:
        operator_db.discard()
    assert len(actions(sql, "hold app")) == len(to_hold)
    assert len(actions(sql, "release app")) == len(held_first)


def test_a_forced_hold_ends_a_live_lease_and_its_token_is_refused(client, sql):
    """queue-hold --force on a leased app: the lease ends now, the app is back at its
    stored result (an analysis; none: queued), its holder's result with that lease's token
    is refused (409) and changes nothing, and the app is not handed out until released."""
    old = {"success": True, "bundleID": "heal.stale", "trackers": {"old": 1}}
    insert_app(sql, "heal.stale", status="analysed", version=VERSION, analysed=days_ago(200),
               analysis=old, reviews="20")  # fmt: skip
    insert_app(sql, "heal.new", reviews="10")
    pi_a = add_analyser(client, "pi-a")
    first, first_token = claim(client, pi_a)
    second, second_token = claim(client, ANALYSER)
    assert (first, second) == ("heal.stale", "heal.new")
    for app_id in (first, second):
        code, out, err = cli("queue-hold", app_id, "--force", "--reason", "bad build")
        assert (code, out) == (0, f"{app_id}: {handler.HOLD_OUTCOMES['lease_broken']}\n"), err
    assert columns(sql, first, "status", "analysis", "analysis_claim_token", "held_by") == (
        "analysed",
        old,
        None,
        handler.who(handler.cli_operator()),
    )
    assert columns(sql, second, "status", "analysis", "analysis_claim_token") == (
        "queued",
        None,
        None,
    )
    before = [columns(sql, app_id, "status", "analysis", "analysed") for app_id in (first, second)]
    assert upload(client, pi_a, first, first_token).status_code == 409
    assert upload(client, ANALYSER, second, second_token).status_code == 409
    assert fail(client, ANALYSER, second, second_token).status_code == 409
    assert [columns(sql, a, "status", "analysis", "analysed") for a in (first, second)] == before
    assert claim(client, pi_a) == ("", None)
    assert claim(client, ANALYSER, second) == ("", None)
    assert [row[3] for row in actions(sql, "hold app")] == ["lease_broken", "lease_broken"]
    code, out, _ = cli("queue-release", second)
    assert (code, out) == (0, f"{second}: released: the queue's rule decides again\n")
    assert claim(client, ANALYSER)[0] == second


def test_a_hold_without_force_lets_the_lease_run_to_its_result(client, sql):
    """A hold on a leased app waits for the lease: the holder's result is stored as any
    (its own), and from then on the app is not handed out by any rule, stale or not,
    until released."""
    insert_app(sql, "heal.leased", reviews="10")
    pi_a = add_analyser(client, "pi-a")
    app_id, token = claim(client, pi_a)
    held = client.post(f"/apps/{app_id}/hold", json={"reason": "check it"}, headers=ADMIN)
    assert (held.status_code, held.json()["outcome"]) == (200, "waiting")
    why = client.get(f"/apps/{app_id}", headers=ADMIN).json()["why"]
    assert (why["candidate"], why["held"], why["hold"]["reason"]) == (False, "hold", "check it")
    assert "its live lease runs to its end" in why["why"]
    stored = upload(client, pi_a, app_id, token)
    assert stored.status_code == 200, stored.text
    assert columns(sql, app_id, "status", "analysed_by") == ("analysed", "pi-a")
    assert columns(sql, app_id, "held_at")[0] is not None
    sql.run(
        "UPDATE apps SET analysed = now() - interval '400 days' WHERE appid = :appid",
        appid=app_id,
    )  # stale: a candidate, were it not held
    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    assert claim(client, pi_a) == ("", None)
    assert claim(client, ANALYSER, app_id) == ("", None)
    released = client.post(f"/apps/{app_id}/release", headers=ADMIN)
    assert released.json() == {"appId": app_id, "outcome": "released"}
    assert claim(client, pi_a)[0] == app_id


def test_an_expired_held_lease_goes_back_to_its_stored_result(client, sql):
    """A held app's lease that expires without a result: the promoter returns it to its
    stored result (an analysis; none: queued), records no lease_expired failure and no
    history, and the app stays held."""
    old = {"success": True, "bundleID": "heal.analysed", "trackers": {}}
    insert_app(sql, "heal.analysed", status="analysed", version=VERSION,
               analysed=days_ago(200), analysis=old, reviews="20")  # fmt: skip
    insert_app(sql, "heal.queued", reviews="10")
    leased = [claim(client, ANALYSER)[0], claim(client, ANALYSER)[0]]
    assert leased == ["heal.analysed", "heal.queued"]
    for app_id in leased:
        held = client.post(f"/apps/{app_id}/hold", headers=ADMIN)
        assert held.json()["outcome"] == "waiting"
    ((history_before,),) = sql.run("SELECT count(*) FROM app_analyses")
    sql.run("UPDATE apps SET processing_started = now() - interval '200 minutes'")
    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    assert columns(
        sql, "heal.analysed", "status", "analysis", "failure_reason", "processing_started"
    ) == ("analysed", old, None, None)
    assert columns(
        sql, "heal.queued", "status", "analysis", "failure_reason", "processing_started"
    ) == ("queued", None, None, None)
    assert sql.run("SELECT count(*) FROM app_analyses") == [[history_before]]
    assert sql.run("SELECT count(*) FROM apps WHERE held_at IS NULL") == [[0]]
    assert claim(client, ANALYSER) == ("", None)


def test_the_website_shows_the_same_before_during_and_after_a_hold(client, sql):
    """The public GET /apps/{appId} (the website's read) answers the same for an app
    before it is held, while held and once released: its state and result; only the
    operators' answer (the admin token) says it is held."""
    insert_app(sql, "heal.analysed", status="analysed", version=VERSION, reviews="5",
               analysed=days_ago(3))  # fmt: skip
    insert_app(sql, "heal.failed", status="failed", version=VERSION, retryable=True,
               analysed=days_ago(1), reviews="7")  # fmt: skip
    insert_app(sql, "heal.final", status="failed", version=VERSION, retryable=False,
               reason="app_not_found", analysed=days_ago(1))  # fmt: skip
    insert_app(sql, "heal.queued", reviews="3")
    insert_app(sql, "heal.ahead", reviews="9")
    apps = ["heal.analysed", "heal.failed", "heal.final", "heal.queued"]

    def public() -> list:
        answers = [client.get(f"/apps/{app_id}") for app_id in apps]
        assert {answer.status_code for answer in answers} == {200}
        return [answer.json() for answer in answers]

    def held() -> list:
        return [client.get(f"/apps/{a}", headers=ADMIN).json()["why"]["held"] for a in apps]

    before = public()
    assert "hold" not in held()
    for app_id in apps:
        assert client.post(f"/apps/{app_id}/hold", headers=ADMIN).json()["outcome"] == "held"
    assert public() == before
    assert held() == ["hold"] * len(apps)
    for app_id in apps:
        assert client.post(f"/apps/{app_id}/release", headers=ADMIN).status_code == 200
    assert public() == before
    assert "hold" not in held()


# Every way an app is a candidate (docs/queue.md, "The rule"), or a due retry.
CANDIDATE_STATES = {
    "queued": {"status": "queued"},
    "expired lease": {"status": "processing", "processing_started": "200 minutes"},
    "stale analysis": {"status": "analysed", "version": VERSION, "analysed": "200 days"},
    "outdated version": {"status": "analysed", "version": VERSION - 1, "analysed": "1 day"},
    "retryable failure, stale": {
        "status": "failed",
        "version": VERSION,
        "retryable": True,
        "analysed": "200 days",
    },
    "retryable failure, outdated": {
        "status": "failed",
        "version": VERSION - 1,
        "retryable": True,
        "analysed": "1 day",
    },
    "due retry": {"status": "failed", "version": VERSION, "retryable": True, "analysed": "1 day"},
}


@pytest.mark.parametrize("state", CANDIDATE_STATES)
def test_a_held_app_is_no_candidate_by_any_rule(client, sql, state):
    """An app that would be handed out (in each way there is), held: GET /queue answers
    empty, the next app and the named one alike, before the promoter flags it and after;
    released, it is handed out. (Fails while a held stale or outdated-version analysis, or
    such a retryable failure, is handed out by GET /queue's version and stale heads,
    which do not read held_at.)"""
    arranged = dict(CANDIDATE_STATES[state])
    ago = {
        key: datetime.now(UTC) - parse_ago(arranged.pop(key))
        for key in ("analysed", "processing_started")
        if key in arranged
    }
    insert_app(sql, "heal.held", reviews="10", **arranged, **ago)
    assert client.get("/apps/heal.held", headers=ADMIN).json()["why"]["candidate"] is True
    assert client.post("/apps/heal.held/hold", headers=ADMIN).status_code == 200
    for flagged in (False, True):
        if flagged:
            handler.promote_due_apps(
                handler.api_connection(), handler.settings().policy, force=True
            )
        assert claim(client, ANALYSER) == ("", None), (state, flagged)
        assert claim(client, ANALYSER, "heal.held") == ("", None), (state, flagged)
    assert client.post("/apps/heal.held/release", headers=ADMIN).status_code == 200
    kit.time_passes()  # the promoter's next pass flags a due retry again (the hold cleared it)
    assert claim(client, ANALYSER)[0] == "heal.held"


def parse_ago(text: str) -> timedelta:
    """ "200 minutes", "1 day", "200 days": that long."""
    number, unit = text.split()
    return timedelta(**{unit if unit.endswith("s") else unit + "s": int(number)})


# --- undoing a broken analyser's failures ----------------------------------------------


def failed_by(sql, app_id: str, analyser: str | None, ago: timedelta, **row) -> None:
    """A failure stored by `analyser` (None: the shared password; a named one is added
    if it is not there) `ago`."""
    if analyser is not None:  # a named analyser's failure: the analyser exists
        sql.run(
            "INSERT INTO analysers (name, token_hash)"
            " VALUES (CAST(:name AS text), sha256(convert_to(CAST(:name AS text), 'UTF8')))"
            " ON CONFLICT DO NOTHING",
            name=analyser,
        )
    insert_app(sql, app_id, status="failed", version=VERSION, analysed=datetime.now(UTC) - ago,
               **row)  # fmt: skip
    sql.run("UPDATE apps SET analysed_by = :who WHERE appid = :appid", who=analyser, appid=app_id)
    if analyser is not None:
        sql.run(
            "INSERT INTO analysers (name, token_hash) VALUES (:name, :hash) ON CONFLICT DO NOTHING",
            name=analyser,
            hash=handler.token_hash(f"aqa_{analyser}"),
        )


def arrange_failures(sql) -> tuple[list[str], datetime]:
    """Failures of pi-broken since T (retryable and not), before T, pi-good's since T,
    the shared password's since T, and pi-broken's analysis since T; (the apps
    `--failed-by pi-broken --since T` selects; T)."""
    ((since,),) = sql.run("SELECT now() - interval '1 hour'")
    failed_by(sql, "undo.retryable", "pi-broken", timedelta(minutes=10), retryable=True,
              reviews="50")  # fmt: skip
    failed_by(sql, "undo.final", "pi-broken", timedelta(minutes=20), retryable=False,
              reason="app_not_found", reviews="40")  # fmt: skip
    failed_by(sql, "undo.paid", "pi-broken", timedelta(minutes=30), retryable=False,
              reason="paid_app", reviews="30")  # fmt: skip
    failed_by(sql, "keep.before", "pi-broken", timedelta(hours=3), retryable=True)
    failed_by(sql, "keep.good", "pi-good", timedelta(minutes=10), retryable=True)
    failed_by(sql, "keep.shared", None, timedelta(minutes=10), retryable=False,
              reason="app_not_found")  # fmt: skip
    insert_app(sql, "keep.analysed", status="analysed", version=VERSION,
               analysed=datetime.now(UTC) - timedelta(minutes=5))  # fmt: skip
    sql.run("UPDATE apps SET analysed_by = 'pi-broken' WHERE appid = 'keep.analysed'")
    return ["undo.retryable", "undo.final", "undo.paid"], since


def test_refetch_failed_by_selects_that_analysers_failures_since_t(database_url, sql):
    """queue-refetch --failed-by pi-broken --since T: a dry run lists pi-broken's failures
    stored since T, retryable or not, and nothing else (not its older ones, not another
    analyser's or the shared password's, not its analyses); --apply queues them, each
    recorded, and leaves the rest as they were. The report function's queue-refetch
    (failedBy, since) selects the same."""
    selected, since = arrange_failures(sql)
    keep = ["keep.before", "keep.good", "keep.shared", "keep.analysed"]
    kept = {app_id: columns(sql, app_id, "status", "analysis", "analysed") for app_id in keep}
    args = ("queue-refetch", "--failed-by", "pi-broken", "--since", since.isoformat())
    code, out, err = cli(*args)
    assert code == 0, err
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(selected)  # a walk: in bundle-ID order
    assert f"Would queue {len(selected)} apps for refetch" in out
    assert sql.run("SELECT count(*) FROM operator_actions") == [[0]]
    report = handler.report(
        {"command": "queue-refetch", "failedBy": "pi-broken", "since": since.isoformat()},
        LambdaContext(),
    )
    assert sorted(app["appId"] for app in report["apps"]) == sorted(selected)
    assert (report["applied"], report["queuedNow"]) == (False, len(selected))
    code, out, err = cli(*args, "--apply", "--yes")
    assert code == 0, err
    assert f"Queued {len(selected)} apps for refetch." in out
    for app_id in selected:
        assert columns(sql, app_id, "status", "failure_reason", "failure_streak") == (
            "queued",
            None,
            0,
        )
    assert {app_id: columns(sql, app_id, "status", "analysis", "analysed") for app_id in keep} == (
        kept
    )
    assert sorted(row[1] for row in actions(sql, "refetch")) == sorted(selected)
    # Again: nothing is left to undo.
    code, out, _ = cli(*args, "--apply", "--yes")
    assert (code, "Queued 0 apps for refetch." in out) == (0, True)


def test_refetch_failed_by_without_since_takes_every_failure_of_that_analyser(database_url, sql):
    """Without --since: every failure pi-broken stored, whenever; --since alone is refused."""
    selected, _ = arrange_failures(sql)
    code, out, err = cli("queue-refetch", "--failed-by", "pi-broken")
    assert code == 0, err
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted([*selected, "keep.before"])
    code, out, err = cli("queue-refetch", "--failed", "--since", "1h")
    assert (code, out) == (2, "")
    assert "--since goes with --failed-by" in err
    code, _, err = cli("queue-refetch", "--failed-by", "pi-broken", "--since", "yesterday")
    assert code == 2 and "--since is a time such as" in err


def test_refetch_failed_by_undoes_a_failure_whatever_the_analyser_called_it(database_url, sql):
    """A broken analyser's failure is undone whatever reason it gave, invalid_bundle_id
    included (its bundle ID is a valid one: the analyser said otherwise). (Fails while
    the refetch's failed rows leave every invalid_bundle_id failure out.)"""
    failed_by(sql, "undo.called.invalid", "pi-broken", timedelta(minutes=5), retryable=False,
              reason="invalid_bundle_id")  # fmt: skip
    code, _, err = cli("queue-refetch", "--failed-by", "pi-broken", "--apply", "--yes")
    assert code == 0, err
    assert columns(sql, "undo.called.invalid", "status") == ("queued",)


def test_a_bulk_refetch_failed_by_asks_about_failed_apps(database_url, sql):
    """Off a terminal, --apply without --yes refuses in one line that says what it would
    have done: re-queue the failures of that analyser, not every analysed app. (Fails while
    the question names analysed apps.)"""
    arrange_failures(sql)
    code, out, err = cli("queue-refetch", "--failed-by", "pi-broken", "--apply")
    assert (code, out) == (2, "")
    assert "failed app" in err and "analysed app" not in err, err
    assert "pi-broken" in err, err


def test_refetch_failed_by_in_batches_each_recorded(database_url, sql):
    """The undo walks the table in batches, each committed with its own record."""
    selected = []
    for index in range(7):
        app_id = f"undo.batch{index}"
        failed_by(sql, app_id, "pi-broken", timedelta(minutes=5), retryable=index % 2 == 0)
        selected.append(app_id)
    for index in range(5):
        failed_by(sql, f"keep.batch{index}", "pi-good", timedelta(minutes=5), retryable=True)
    request = handler.RefetchRequest.checked(
        handler.REFETCH_EVENT_NAMES, failed_by="pi-broken", since="1h", apply=True
    )
    batches: list[list[str]] = []
    progress = handler.refetch_in_batches(
        handler.api_connection(),
        request,
        lambda rows, _: batches.append([row["appid"] for row in rows]),
        TEST_OPERATOR,
        batch_size=3,
        policy=handler.settings().policy,
    )
    assert progress.complete and progress.selected == len(selected)
    assert progress.outcomes["queued"] == len(selected)
    assert sorted(app_id for batch in batches for app_id in batch) == selected
    assert progress.batches == len(batches) >= 4  # 12 rows, 3 a window
    acts = sql.run(
        "SELECT act, array_agg(app_id ORDER BY app_id) FROM operator_actions"
        " WHERE action = 'refetch' GROUP BY act"
    )
    assert sorted(sorted(apps) for _, apps in acts) == sorted(sorted(b) for b in batches if b)


def test_refetch_failed_by_races_claims(database_url, sql):
    """The undo applies in small batches while claimers claim: the broken analyser's
    retryable failures are due retries the claimers may take first. Every app it failed
    ends queued (the undo) or leased (a claim); the undo skips those a claim took before
    it came to them; a failure that no rule hands out (not retryable) is handed out only
    once the undo queued it; no app is handed out twice, and the other analyser's failures
    are left alone."""
    policy = handler.settings().policy
    broken, final = [], []
    for index in range(60):
        app_id = f"undo.race{index:02d}"
        retryable = index % 3 != 0
        failed_by(sql, app_id, "pi-broken", timedelta(hours=2), retryable=retryable,
                  reason=None if retryable else "app_not_found", reviews=str(index))  # fmt: skip
        broken.append(app_id)
        if not retryable:
            final.append(app_id)
    for index in range(10):
        failed_by(sql, f"keep.race{index}", "pi-good", timedelta(hours=2), retryable=False,
                  reason="app_not_found")  # fmt: skip
    handler.promote_due_apps(handler.api_connection(), policy, force=True)  # flags the retries
    request = handler.RefetchRequest.checked(
        handler.REFETCH_EVENT_NAMES, failed_by="pi-broken", since="3h", apply=True
    )
    outcomes: dict[str, str] = {}
    operator_db = database_at(database_url)
    try:
        with Claimers(database_url, [None, "pi-good"], policy) as claimers:
            claimers.wait_for(3)

            def record(rows, _):
                for row in rows:
                    outcomes[row["appid"]] = row["outcome"]

            progress = handler.refetch_in_batches(
                operator_db, request, record, TEST_OPERATOR, batch_size=5, policy=policy
            )
            claimers.wait_for(10)
    finally:
        operator_db.discard()
    assert progress.complete
    handed = [c["app"] for c in claimers.claims if c["app"] is not None]
    assert len(handed) == len(set(handed))
    assert set(handed) <= set(broken)
    assert {app_id for app_id in handed if app_id in final} <= {
        app_id for app_id, outcome in outcomes.items() if outcome == "queued"
    }
    assert set(outcomes.values()) <= {"queued", "skipped"}
    for app_id in broken:
        (status,) = columns(sql, app_id, "status")
        assert status == ("processing" if app_id in handed else "queued"), app_id
    for app_id, outcome in outcomes.items():
        if outcome == "skipped":
            assert app_id in handed and app_id not in final
    assert sql.run("SELECT count(*) FROM apps WHERE appid LIKE 'keep.%' AND status = 'failed'") == [
        [10]
    ]


# --- a broken analyser -----------------------------------------------------------------

BROKEN_AFTER = 3  # BROKEN_ANALYSER_FAILURES in these tests


@pytest.fixture
def broken_after(database_url, monkeypatch):
    """The service with BROKEN_ANALYSER_FAILURES=3 (PAUSE_BROKEN_ANALYSERS as the test
    sets it: configure(pause=True))."""

    def configure(pause: bool = False) -> None:
        configure_service(
            monkeypatch,
            database_url,
            BROKEN_ANALYSER_FAILURES=str(BROKEN_AFTER),
            PAUSE_BROKEN_ANALYSERS="true" if pause else "false",
        )

    configure()
    return configure


def one_failure(client, headers: dict[str, str]) -> str:
    """The analyser claims the next app and reports it failed (a retryable failure)."""
    app_id, token = claim(client, headers)
    assert app_id, "the analyser was handed no app"
    answer = fail(client, headers, app_id, token)
    assert answer.status_code == 200, answer.text
    return app_id


def one_success(client, headers: dict[str, str]) -> str:
    app_id, token = claim(client, headers)
    assert app_id, "the analyser was handed no app"
    answer = upload(client, headers, app_id, token)
    assert answer.status_code == 200, answer.text
    return app_id


def listed(client, name: str) -> dict:
    (found,) = [
        a for a in client.get("/analysers", headers=ADMIN).json()["analysers"] if a["name"] == name
    ]
    return found


def report_metrics(capsys) -> dict[str, float]:
    """The scheduled report's metrics (its EMF document), name -> value, and the paused
    analysers its log record counts (PausedAnalysers: no metric of its own since the
    report publishes only REPORT_METRICS)."""
    capsys.readouterr()
    handler.report(load_event("schedule.json"), LambdaContext())
    logs, emf = output_records(capsys.readouterr())
    (document,) = emf
    names = [m["Name"] for m in document["_aws"]["CloudWatchMetrics"][0]["Metrics"]]
    assert set(names) <= set(handler.REPORT_METRICS)
    values = {name: document[name][0] if isinstance(document[name], list) else document[name]
              for name in names}  # fmt: skip
    (status,) = [r["queue_status"] for r in logs if r.get("message") == "queue status"]
    return {**values, "PausedAnalysers": status["paused_analysers"]}


def test_a_named_analyser_failing_while_another_succeeds_is_flagged(
    client, sql, broken_after, capsys
):
    """pi-bad fails every app while pi-good succeeds: it is flagged broken by its third
    failure in a row (BROKEN_ANALYSER_FAILURES=3), not before, in GET /analysers, the
    analysers list, queue-status --json and the report's metrics (BrokenAnalysers, and
    FailureRatioLastHour: 3 of 4 results failed); it is not paused (PAUSE_BROKEN_ANALYSERS
    is off), and a success ends its flag."""
    many_apps(sql, 20)
    pi_bad, pi_good = add_analyser(client, "pi-bad"), add_analyser(client, "pi-good")
    one_failure(client, pi_bad)
    one_success(client, pi_good)
    for failures in range(2, BROKEN_AFTER + 1):
        assert listed(client, "pi-bad")["broken"] is False
        one_failure(client, pi_bad)
        assert listed(client, "pi-bad")["consecutiveFailures"] == failures
    bad = listed(client, "pi-bad")
    assert (bad["broken"], bad["consecutiveFailures"], bad["paused"]) == (True, BROKEN_AFTER, None)
    assert bad["failingSince"] is not None
    assert listed(client, "pi-good")["broken"] is False
    code, out, err = cli("queue-status", "--json")
    assert code == 0, err
    status = json.loads(out)
    assert (status["broken_analysers"], status["paused_analysers"]) == (1, 0)
    assert status["failure_ratio_1h"] == 0.75
    assert {a["name"]: a["broken"] for a in status["analysers"]} == {
        "pi-bad": True,
        "pi-good": False,
    }
    code, out, err = cli("analysers", "list")
    assert code == 0, err
    assert f"BROKEN: {BROKEN_AFTER} failures in a row since" in out
    metrics = report_metrics(capsys)
    assert (metrics["BrokenAnalysers"], metrics["PausedAnalysers"]) == (1, 0)
    assert metrics["FailureRatioLastHour"] == 0.75
    # Not paused: it is handed apps still; one success ends the flag.
    one_success(client, pi_bad)
    bad = listed(client, "pi-bad")
    assert (bad["broken"], bad["consecutiveFailures"]) == (False, 0)
    assert actions(sql, "pause analyser") == []


def test_queue_status_text_names_a_broken_analyser(client, sql, broken_after):
    """queue-status (text) names the broken analyser and its failures in a row. (Fails
    while the text reads a key the document does not have: failures_in_a_row.)"""
    many_apps(sql, 10)
    pi_bad, pi_good = add_analyser(client, "pi-bad"), add_analyser(client, "pi-good")
    one_failure(client, pi_bad)
    one_success(client, pi_good)
    for _ in range(BROKEN_AFTER - 1):
        one_failure(client, pi_bad)
    code, out, err = cli("queue-status")
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.strip().startswith("pi-bad")]
    assert f"BROKEN: {BROKEN_AFTER} failures in a row" in line
    assert "broken (failing while others succeed)" in out


def test_pause_broken_analysers_pauses_it_by_the_failure_that_flags_it(
    client, sql, broken_after, capsys
):
    """With PAUSE_BROKEN_ANALYSERS=true: failures in a row while nobody else succeeds are
    no sign of a broken analyser (the apps may be bad), and nothing is paused; once
    pi-good succeeds, pi-bad reads as broken, and its next failure pauses it, in that
    failure's transaction, with one operator_actions row by the service. Its GET /queue
    then answers empty; resumed by an operator, it is handed apps again, its count
    started afresh."""
    broken_after(pause=True)
    many_apps(sql, 20)
    pi_bad, pi_good = add_analyser(client, "pi-bad"), add_analyser(client, "pi-good")
    for _ in range(BROKEN_AFTER):
        one_failure(client, pi_bad)
    assert (listed(client, "pi-bad")["broken"], listed(client, "pi-bad")["paused"]) == (False, None)
    one_success(client, pi_good)
    assert (listed(client, "pi-bad")["broken"], listed(client, "pi-bad")["paused"]) == (True, None)
    assert actions(sql, "pause analyser") == []
    one_failure(client, pi_bad)
    bad = listed(client, "pi-bad")
    assert bad["broken"] is True and bad["paused"]["by"] == handler.BROKEN_PAUSE_ACTOR
    ((actor, app_id, analyser, outcome),) = actions(sql, "pause analyser")
    assert (actor, app_id, analyser) == (handler.BROKEN_PAUSE_ACTOR, None, "pi-bad")
    assert f"{BROKEN_AFTER + 1} failures in a row" in outcome
    assert claim(client, pi_bad) == ("", None)
    assert claim(client, pi_good)[0]  # the queue itself is not paused
    metrics = report_metrics(capsys)
    assert (metrics["BrokenAnalysers"], metrics["PausedAnalysers"]) == (1, 1)
    code, out, err = cli("analysers", "resume", "pi-bad")
    assert (code, out) == (0, "Analyser pi-bad resumed: it is handed apps again.\n"), err
    bad = listed(client, "pi-bad")
    assert (bad["broken"], bad["consecutiveFailures"]) == (False, 0)
    one_failure(client, pi_bad)  # handed an app again; one failure is no streak
    assert listed(client, "pi-bad")["paused"] is None


def test_the_first_failure_that_shows_it_broken_pauses_it(client, sql, broken_after):
    """With PAUSE_BROKEN_ANALYSERS=true and another analyser succeeding first, the
    BROKEN_ANALYSER_FAILURES-th failure in a row pauses the analyser: not one before."""
    broken_after(pause=True)
    many_apps(sql, 20)
    pi_bad, pi_good = add_analyser(client, "pi-bad"), add_analyser(client, "pi-good")
    one_failure(client, pi_bad)
    one_success(client, pi_good)
    for _ in range(BROKEN_AFTER - 2):
        one_failure(client, pi_bad)
        assert listed(client, "pi-bad")["paused"] is None
    one_failure(client, pi_bad)
    assert listed(client, "pi-bad")["paused"]["by"] == handler.BROKEN_PAUSE_ACTOR
    assert claim(client, pi_bad) == ("", None)
    assert len(actions(sql, "pause analyser")) == 1


def test_shared_password_failures_move_the_ratio_only(client, sql, broken_after, capsys):
    """Hosts on the shared password cannot be told apart: their failures in a row move
    the fleet's failure ratio (5 of 6 results failed), never a named analyser's flag or a
    pause."""
    broken_after(pause=True)
    many_apps(sql, 20)
    pi_good = add_analyser(client, "pi-good")
    one_failure(client, ANALYSER)
    one_success(client, pi_good)
    for _ in range(4):
        one_failure(client, ANALYSER)
    metrics = report_metrics(capsys)
    assert (metrics["BrokenAnalysers"], metrics["PausedAnalysers"]) == (0, 0)
    assert metrics["FailureRatioLastHour"] == round(5 / 6, 3)
    code, out, err = cli("queue-status", "--json")
    assert code == 0, err
    status = json.loads(out)
    assert (status["broken_analysers"], status["failure_ratio_1h"]) == (0, round(5 / 6, 3))
    assert listed(client, "pi-good")["broken"] is False
    assert actions(sql, "pause analyser") == []
    assert claim(client, ANALYSER)[0]


# --- the operator's scenario, end to end -----------------------------------------------


def test_the_operators_scenario_end_to_end(client, sql, broken_after):
    """Issue 36's scenario through the HTTP routes and the CLI, the web view off: a named
    analyser fails everything it is handed while another succeeds; queue-status --json
    flags it by its BROKEN_ANALYSER_FAILURES-th result; the operator pauses it (CLI), asks
    why an app it failed waits, refetches what it failed since it began (queue-refetch
    --failed-by --since --apply), and once the healthy analyser has taken the queue, no
    app it failed is left failed. Resumed, it is counted afresh."""
    assert client.get("/admin/api/status", headers=ADMIN).status_code == 404  # web view off
    apps = many_apps(sql, 12)
    pi_broken, pi_good = add_analyser(client, "pi-broken"), add_analyser(client, "pi-good")
    ((since,),) = sql.run("SELECT now()")
    failed: list[str] = []
    flags = []
    for result in range(1, BROKEN_AFTER + 1):
        app_id, token = claim(client, pi_broken)
        log = "ERROR: app not found" if result % 2 == 0 else "usb: device gone"
        assert fail(client, pi_broken, app_id, token, log).status_code == 200
        failed.append(app_id)
        if result == 1:
            one_success(client, pi_good)
        code, out, err = cli("queue-status", "--json")
        assert code == 0, err
        flags.append(json.loads(out)["broken_analysers"])
    assert flags == [0] * (BROKEN_AFTER - 1) + [1]
    # The operator stops it.
    code, out, err = cli("analysers", "pause", "pi-broken")
    assert code == 0, err
    assert out.startswith("Analyser pi-broken paused")
    assert claim(client, pi_broken) == ("", None)
    code, out, err = cli("why", failed[1], "--json")
    assert code == 0, err
    assert json.loads(out)["candidate"] is False
    # ... and undoes what it did.
    code, out, err = cli("queue-refetch", "--failed-by", "pi-broken", "--since", since.isoformat())
    assert code == 0, err
    listed_apps = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert sorted(listed_apps) == sorted(failed)
    code, out, err = cli(
        "queue-refetch",
        "--failed-by",
        "pi-broken",
        "--since",
        since.isoformat(),
        "--apply",
        "--yes",
    )
    assert code == 0, err
    assert f"Queued {len(failed)} apps for refetch." in out
    # The healthy analyser takes the queue; the paused one is handed nothing.
    taken = []
    while True:
        assert claim(client, pi_broken) == ("", None)
        app_id, token = claim(client, pi_good)
        if not app_id:
            break
        assert upload(client, pi_good, app_id, token).status_code == 200
        taken.append(app_id)
    assert set(failed) <= set(taken)
    assert sql.run("SELECT appid FROM apps WHERE status <> 'analysed'") == []
    for app_id in failed:
        assert columns(sql, app_id, "status", "analysed_by") == ("analysed", "pi-good")
    assert len(apps) == len(taken) + 1  # and pi-good's first
    code, out, err = cli("queue-status", "--json")
    status = json.loads(out)
    assert (status["broken_analysers"], status["paused_analysers"]) == (1, 1)
    assert status["counts"]["failed"] == 0
    code, out, err = cli("analysers", "resume", "pi-broken")
    assert code == 0, err
    code, out, err = cli("queue-status", "--json")
    assert (json.loads(out)["broken_analysers"], json.loads(out)["paused_analysers"]) == (0, 0)
    recorded = [row[0] for row in sql.run("SELECT action FROM operator_actions ORDER BY at, id")]
    assert recorded == ["add analyser", "add analyser", "pause analyser"] + ["refetch"] * len(
        failed
    ) + ["resume analyser"]


# --- the operators' three ways in ------------------------------------------------------

# The web view's actions (handler.ADMIN_ROUTES' writes), each with the CLI command that
# does the same. A write that is the browser's own (its session) has none.
SESSION_ONLY = {("POST", "/admin/logout")}
WEB_ACTION_COMMANDS = {
    ("POST", "/admin/api/refetch"): ("queue-refetch",),
    ("POST", "/admin/api/apps/{appId}/hold"): ("queue-hold",),
    ("POST", "/admin/api/apps/{appId}/release"): ("queue-release",),
    ("POST", "/admin/api/queue/pause"): ("queue-pause",),
    ("POST", "/admin/api/queue/resume"): ("queue-resume",),
    ("POST", "/admin/api/analysers"): ("analysers", "add"),
    ("POST", "/admin/api/analysers/{name}/rotate"): ("analysers", "rotate"),
    ("POST", "/admin/api/analysers/{name}/revoke"): ("analysers", "revoke"),
    ("POST", "/admin/api/analysers/{name}/pause"): ("analysers", "pause"),
    ("POST", "/admin/api/analysers/{name}/resume"): ("analysers", "resume"),
}
# Commands that print a new token: the CLI's and the admin API's alone, never a log's.
PRINTS_A_TOKEN = {("analysers", "add"), ("analysers", "rotate")}


def cli_commands(parser, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every command of the CLI's table, subcommands by their path."""
    import argparse

    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return {path}
    return {
        found
        for group in groups
        for name, child in group.choices.items()
        for found in cli_commands(child, (*path, name))
    }


def web_actions_without_a_command(routes, commands: set[tuple[str, ...]]) -> list[str]:
    """The web view's actions that no CLI command does, by method and path."""
    missing = []
    for method, path, _, who in routes:
        if who != "action" or (method, path) in SESSION_ONLY:
            continue
        if WEB_ACTION_COMMANDS.get((method, path)) not in commands:
            missing.append(f"{method} {path}")
    return missing


def test_every_web_view_action_has_a_cli_command():
    """Each action the web view offers, the CLI offers too: an operator without a browser
    (or with the web view off, its default) can do everything."""
    commands = cli_commands(handler.cli_parser())
    assert web_actions_without_a_command(handler.ADMIN_ROUTES, commands) == []
    assert set(WEB_ACTION_COMMANDS.values()) <= commands


def test_a_new_web_view_action_without_a_command_fails_by_name():
    routes = (*handler.ADMIN_ROUTES, ("POST", "/admin/api/apps/{appId}/bless", None, "action"))
    commands = cli_commands(handler.cli_parser())
    assert web_actions_without_a_command(routes, commands) == ["POST /admin/api/apps/{appId}/bless"]


def test_the_report_function_takes_every_web_view_action_but_a_token_printing_one(database_url):
    """The report function (for an operator with only `aws lambda invoke`) takes each of
    the web view's actions under the CLI command's name (analysers-pause for `analysers
    pause`), except adding and rotating an analyser, which print a token. Each is invoked
    bare: it answers, or asks for its fields, but never calls the command unknown.
    (Fails while analysers-revoke is unknown to it.)"""
    unknown = []
    for command in sorted(set(WEB_ACTION_COMMANDS.values()) - PRINTS_A_TOKEN):
        name = "-".join(command)
        try:
            handler.report({"command": name}, LambdaContext())
        except handler.BadInput as refused:
            if "unknown command" in str(refused):
                unknown.append(name)
    assert unknown == []


# --- why: the CLI's and the web view's are one -----------------------------------------

AGES = {
    "10 minutes": timedelta(minutes=10),
    "3 hours": timedelta(hours=3),
    "2 days": timedelta(days=2),
    "200 days": timedelta(days=200),
}
APP_STATES = st.fixed_dictionaries(
    {
        "status": st.sampled_from(["queued", "processing", "analysed", "failed"]),
        "version": st.sampled_from([VERSION - 1, VERSION, VERSION + 1]),
        "analysed": st.sampled_from(sorted(AGES)),
        "started": st.sampled_from(["5 minutes", "200 minutes"]),
        "lease_attempts": st.integers(1, 4),
        "refetch_requested": st.booleans(),
        "retryable": st.booleans(),
        "streak": st.integers(0, 4),
        "held": st.booleans(),
        "queue_paused": st.booleans(),
        "analysed_by": st.sampled_from([None, "pi-a"]),
    }
)


@pytest.mark.parametrize("backoff", ["", "off", "30m,2h"])
def test_why_on_the_command_line_is_the_web_views_why(database_url, sql, monkeypatch, backoff):
    """For generated app states (every status, versions below, at and above the current
    one, ages on each side of the policy's lines, live and expired leases, retries by
    RETRY_BACKOFF, held or not, the queue paused or not): `why APPID --json` is the web
    view's app page's why with the app's state, and `why APPID` says the same in words."""
    configure_service(monkeypatch, database_url, ADMIN_WEB="read-only", RETRY_BACKOFF=backoff)
    from fastapi.testclient import TestClient

    with TestClient(handler.app, raise_server_exceptions=False) as client:

        @settings(
            max_examples=kit.examples(60),
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(APP_STATES)
        def check(state):
            arrange_why(sql, state)
            story = client.get("/admin/api/apps/Why.App", headers=ADMIN)
            assert story.status_code == 200, story.text
            story = story.json()
            code, out, err = cli("why", "why.app", "--json")
            assert code == 0, err
            document = json.loads(out)
            assert document == {
                "appId": "Why.App",
                "status": story["app"]["status"],
                "failureReason": story["failureReason"],
                "analysedBy": story["app"]["analysedBy"],
                "leaseAttempts": story["leaseAttempts"],
                **story["why"],
            }
            code, text, err = cli("why", "WHY.APP")
            assert code == 0, err
            assert text == why_in_words(document)

        check()


def arrange_why(sql, state: dict) -> None:
    """The one app Why.App in `state` (APP_STATES), alone in the queue."""
    sql.run("DELETE FROM apps")
    sql.run("UPDATE queue_pause SET paused_at = NULL, paused_by = NULL, reason = NULL")
    status = state["status"]
    row: dict = {"status": status, "held": state["held"]}
    if status in ("analysed", "failed"):
        row |= {
            "version": state["version"],
            "analysed": datetime.now(UTC) - AGES[state["analysed"]],
        }
    if status == "failed":
        row |= {"retryable": state["retryable"], "streak": state["streak"]}
        if not state["retryable"]:
            row["reason"] = "app_not_found"
    if status == "processing":
        row["processing_started"] = datetime.now(UTC) - parse_ago(state["started"])
    insert_app(sql, "Why.App", **row)
    if status in ("analysed", "failed"):
        sql.run("UPDATE apps SET analysed_by = :who", who=state["analysed_by"])
    if status == "processing":
        sql.run(
            "UPDATE apps SET lease_attempts = :attempts, refetch_requested = :refetch",
            attempts=state["lease_attempts"],
            refetch=state["refetch_requested"],
        )
    if state["queue_paused"]:
        sql.run("UPDATE queue_pause SET paused_at = now(), paused_by = 'tests'")


def why_in_words(why: dict) -> str:
    """What `why APPID` prints for the document `why APPID --json` prints (docs/cli.md)."""
    state = why["status"] + (f" ({why['failureReason']})" if why["failureReason"] else "")
    if why["analysedBy"]:
        state += f", its result stored by {why['analysedBy']}"
    lines = [f"{why['appId']}: {state}"]
    lines.append(("handed out: " if why["candidate"] else "not handed out: ") + why["why"])
    if why["from"]:
        lines.append(f"from: {why['from']}")
    if why.get("retry"):
        retry = why["retry"]
        lines.append(
            f"failures in a row: {retry['consecutiveFailures']};"
            f" next retry: {retry['nextRetry'] or 'none (past RETRY_BACKOFF)'}"
        )
    return "\n".join(lines) + "\n"
