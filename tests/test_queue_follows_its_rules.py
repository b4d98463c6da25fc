"""A model of the queue: random interleavings of every operation, checked step by step.

Hypothesis drives adds, claims (the next app, and exact-app mode's named claim), uploads
and failure reports with and without claim tokens and at an outdated, the current or a
newer analysisVersion, from holders and from analysers whose lease was taken over, replies
lost after COMMIT (the service retries: a result's, and a promoter batch's during a claim)
and results sent again (the analyser retries), an operator's refetch that waits for a
lease followed by that lease's result and the same again (or the holder's own with its
token), leases that expire again and again (a hanging analyser), a stored analysis of a
version above the current one met by analysers of the current version (refused results,
back-off), ageing, retryable failures retried with back-off (failures in a row counted;
each retry RETRY_BACKOFF's next step after its failure, in the lowest tier, only when no
other app is a candidate; the fleet draining the queue; RETRY_BACKOFF drawn as the
default, a short one or off, and changed while the service runs), operators holding and
releasing apps, operators' refetches with and without --force, and
CURRENT_ANALYSIS_VERSION moving up and down (each move a new process), across several
analysers, one of them with its own credential (docs/analysers.md) and the others on the
shared password, against the real database through the ASGI app. A small pure-Python
model of the queue's rules (docs/queue.md, tests/queue_model.py) predicts every answer
and every row; the clock is moved by rewriting the timestamps, and the only things read
back are clock readings.

A second test, test_failing_apps_never_starve_new_ones, runs a fleet where a third of
the apps fail every time, new apps arriving while their retries fall due, each claim
checked against the oracle (helpers.oracle_tiers).

Beside the model's predictions, the promises are checked as invariants of their own:
- no app is handed out while another analyser holds a live lease on it;
- every 2xx result is the stored one, or was replaced legitimately: by a later claim's
  result, or within its claim by a success (over a failure) or by the claim token's holder
  (over a result that came without the token);
- every 409 changed nothing (the row and the history are as they were), but for the lease
  its holder's result, refused as older than the stored one, answered or ended (the
  history as it was);
- no app is handed out twice without time passing for it, an operator's refetch or a
  version bump in between, and never more than max_lease_attempts times without a result;
- no due retry is handed out while another app is a candidate, and after each claim's
  promotion every due retry carries the promoter's flag.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from datetime import datetime, timedelta

import pg8000.native
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kit import ADMIN, ANALYSER, configure_service, examples, time_passes

import handler
from helpers import lease_expired, oracle_tiers, refetch_apps, retry_time
from queue_model import (
    RESULT_STATES,
    App,
    candidate,
    claimable_by_name,
    due_retry,
    judged,
    next_claim,
    streak_after,
    verdict,
)

pytestmark = pytest.mark.slow  # a stateful model: minutes

ANALYSERS = ("pi-1", "pi-2", "pi-3")
NAMED = ("pi-3",)  # with a credential of its own; the others send the shared password
ROW = (
    "SELECT appid, status, analysisversion, analysed, processing_started, failure_reason,"
    " failure_retryable, CAST(analysis AS text), CAST(analysis_claim_token AS text),"
    " CAST(result_claim_token AS text), result_claim_verified, lease_attempts,"
    " refetch_requested,"
    " CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token"
    " THEN claimed_by END, analysed_by, failure_streak, held_at IS NOT NULL"
    " FROM apps ORDER BY appid"
)
# RETRY_BACKOFF as each run of the model draws it: the default, a short one, and off.
BACKOFFS = ((3600, 21600, 86400), (600, 5400), ())


@dataclasses.dataclass(frozen=True)
class Ack:
    """A result answered 2xx."""

    key: tuple
    epoch: int
    success: bool
    verified: bool


class CommitReplyLost:
    """Session.execute that, once armed with n, runs the n-th COMMIT from then on and then
    loses the connection before its reply is read, as a network cut after the COMMIT left
    would: the service tries the transaction again on a new connection."""

    def __init__(self, monkeypatch):
        self.countdown = 0
        original = handler.Session.execute

        def execute(session, sql):
            original(session, sql)
            if sql == "COMMIT" and self.countdown:
                self.countdown -= 1
                if self.countdown == 0:
                    session.connection.close()
                    raise pg8000.native.InterfaceError("network error: the reply was lost")

        monkeypatch.setattr(handler.Session, "execute", execute)


class QueueModel(RuleBasedStateMachine):
    client = None
    sql = None
    url = None
    monkeypatch = None
    fault = None

    headers = None  # each analyser's credential, made once per test

    @initialize(backoff=st.sampled_from(BACKOFFS))
    def start(self, backoff):
        for table in ("app_analyses", "apps", "analyser_heartbeats"):
            self.sql.run(f"DELETE FROM {table}")
        self.policy = handler.QueuePolicy(retry_backoff=backoff)
        self.configure()
        if QueueModel.headers is None:
            QueueModel.headers = {analyser: ANALYSER for analyser in ANALYSERS}
            for name in NAMED:
                answer = self.client.post("/analysers", json={"name": name}, headers=ADMIN)
                assert answer.status_code == 201
                QueueModel.headers[name] = {"Authorization": f"Bearer {answer.json()['token']}"}
        self.apps: dict[str, App] = {}
        self.holding: dict[str, tuple[str, str]] = {}  # analyser -> (appid, token)
        self.superseded: dict[str, tuple[str, str]] = {}  # analyser -> a claim taken over
        self.acks: dict[str, list[Ack]] = {}
        self.sent: list[tuple] = []  # requests answered 2xx, to send again
        self.history: set[tuple[str, datetime]] = set()
        self.history_rows: list = []
        self.counter = 0

    def configure(self) -> None:
        """A new process of the service, with the model's policy."""
        configure_service(
            self.monkeypatch,
            self.url,
            CURRENT_ANALYSIS_VERSION=str(self.policy.analysis_version),
            RETRY_BACKOFF=self.policy.retry_backoff_text,
        )

    def now(self) -> datetime:
        return self.sql.run("SELECT now()")[0][0]

    def read_times(self, appid: str) -> tuple:
        return tuple(
            self.sql.run(
                "SELECT added, analysed, processing_started FROM apps WHERE appid = :a", a=appid
            )[0]
        )

    def snapshot(self) -> tuple:
        history = self.sql.run("SELECT id, appid, analysed FROM app_analyses ORDER BY id")
        return self.sql.run(ROW), history

    def time_passes_for(self, app: App) -> None:
        app.handouts_since_time = 0

    @staticmethod
    def named(analyser: str) -> str | None:
        return analyser if analyser in NAMED else None

    # --- adding and claiming --------------------------------------------------------

    @rule(reviews=st.integers(0, 5))
    def add_app(self, reviews):
        self.counter += 1
        appid = f"app.{self.counter:03d}"
        answer = self.client.post(
            "/apps", json={"appId": appid, "details": {"reviews": str(reviews)}}, headers=ADMIN
        )
        assert answer.status_code == 201
        added, _, _ = self.read_times(appid)
        self.apps[appid] = App(appid, reviews, added)

    def _promote(self, now: datetime) -> list[App]:
        """The promoter's lease rescuer, which every claim runs first: a lease that expired
        max_lease_attempts times in a row is queued for a refetch that waited for it, else
        gets the server's lease_expired failure as its holder's result (one more failure
        in a row), judged by the result rules (so refused when a newer version is stored:
        the lease ends). A held app's expired lease, however many leases it had, is queued
        for a refetch that waited for it, else goes back to its stored result: no failure
        is recorded. Returns the apps whose failure was stored, whose times are read once
        the claim is done."""
        failed = []
        for app in self.apps.values():
            expired = app.status == "processing" and lease_expired(
                app.started, self.policy.processing_timeout_minutes, now
            )
            at_limit = expired and app.attempts >= self.policy.max_lease_attempts
            if (at_limit or (expired and app.held)) and app.refetch_requested:
                # The operator's refetch wins.
                app.status, app.started, app.token, app.holder = "queued", None, None, None
                app.attempts, app.refetch_requested = 0, False
                app.handouts_since_result = app.handouts_since_time = 0
                app.streak = 0
                app.epoch += 1
                continue
            if expired and app.held:
                self._lease_ended(app)
                continue
            if not at_limit:
                continue
            self.counter += 1
            key = ("server", self.counter)
            version = self.policy.analysis_version
            if verdict(app, key, version, app.token, version)[0] != "store":
                self._lease_ended(app)
                continue
            app.streak = streak_after(app, "server", version)
            app.version, app.result = self.policy.analysis_version, key
            app.analysed = now  # about: read back once the claim is done (_promoted)
            # The open claim's result, without its token: the holder's own may replace it.
            app.result_claim, app.result_verified = app.token, False
            app.started, app.token, app.attempts, app.refetch_requested = None, None, 0, False
            app.status, app.reason, app.retryable = RESULT_STATES["server"]
            app.holder = app.analysed_by = None
            app.handouts_since_result = 0
            failed.append(app)
        return failed

    def _promoted(self, failed: list[App]) -> None:
        for app in failed:
            _, app.analysed, _ = self.read_times(app.appid)
            self.history.add((app.appid, app.analysed))
            # A stand-in for the rescued claims' results, for the acknowledged-results
            # invariant: a later claim's outcome replaces earlier results.
            self.acks.setdefault(app.appid, []).append(Ack(app.result, app.epoch, False, True))

    def _lease_ended(self, app: App) -> None:
        """The lease ends without its result (refused as older than a stored result of a
        version above the current one, or held by an operator): the app is as its stored
        result says (queued when it has none; a failure at least the first in a row, its
        count kept), or queued for a refetch that waited (no failures in a row then)."""
        if app.refetch_requested:
            app.status, app.reason, app.retryable = "queued", None, None
            app.streak = 0
            app.epoch += 1
        elif app.result is None:
            app.status, app.reason, app.retryable = "queued", None, None
        else:
            app.status, app.reason, app.retryable = RESULT_STATES[app.result[0]]
            if app.status == "failed":  # a failed app is at least one failure in a row
                app.streak = max(app.streak, 1)
        app.started, app.token, app.attempts, app.refetch_requested = None, None, 0, False
        app.holder = None
        app.handouts_since_result = 0

    def _handed_out(self, analyser: str, app: App, token: str, now: datetime) -> None:
        lease_ago = now - timedelta(minutes=self.policy.processing_timeout_minutes)
        for other, (held, held_token) in list(self.holding.items()):
            if held == app.appid:
                live = app.status == "processing" and app.token == held_token
                assert not (live and app.started >= lease_ago), (
                    f"{app.appid} handed out while {other} holds a live lease on it"
                )
                self.superseded[other] = self.holding.pop(other)
        app.handouts_since_time += 1
        app.handouts_since_result += 1
        assert app.handouts_since_time == 1, f"{app.appid} handed out again, no time passed"
        assert app.handouts_since_result <= self.policy.max_lease_attempts, (
            f"{app.appid} handed out {app.handouts_since_result} times without a result"
        )
        app.attempts = app.attempts + 1 if app.status == "processing" else 1
        app.status, app.token, app.refetch_requested = "processing", token, False
        app.holder = self.named(analyser)
        app.epoch += 1
        _, _, app.started = self.read_times(app.appid)
        self.holding.pop(analyser, None)
        self.superseded.pop(analyser, None)
        self.holding[analyser] = (app.appid, token)

    @rule(
        analyser=st.sampled_from(ANALYSERS),
        lose_commit=st.sampled_from((0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3)),
    )
    def claim(self, analyser, lose_commit=0):
        """The next app. Sometimes the promotion the claim runs first (the promoter's
        batches, each committed) loses the reply to its n-th COMMIT (`lose_commit`): the
        service runs that batch again on a new connection and finds its own work done (a
        lease_expired failure is not written twice, nor a lease ended twice)."""
        self._claim_next(analyser, lose_commit)

    def _claim_next(self, analyser: str, lose_commit: int = 0) -> App | None:
        """GET /queue, as the model predicts it; the app handed out (None: none)."""
        time_passes()  # the clock may have moved since the last promotion
        now = self.now()
        failed = self._promote(now)
        chosen = next_claim(self.apps.values(), self.policy, now)
        if chosen is not None and not candidate(chosen, self.policy, now):
            # The lowest tier: a due retry only when no other app is a candidate.
            assert not any(candidate(a, self.policy, now) for a in self.apps.values())
        self.fault.countdown = lose_commit
        answer = self.client.get("/queue", headers=self.headers[analyser])
        self.fault.countdown = 0
        assert answer.status_code == 200
        assert answer.text == (chosen.appid if chosen else "")
        self._promoted(failed)
        self._due_retries_flagged(now, answer.text)
        if chosen:
            token = answer.headers["x-analysis-claim-token"]
            self._handed_out(analyser, self.apps[answer.text], token, now)
        return chosen

    @rule(analyser=st.sampled_from(ANALYSERS), data=st.data())
    def analysers_drain_the_queue(self, analyser, data):
        """The fleet works until the queue is empty, each app answered at once with its
        claim's token: a success or a retryable failure (drawn), so the failing apps wait
        for their retries, which come only once nothing else is a candidate."""
        for _ in range(len(self.apps) + 2):
            app = self._claim_next(analyser)
            if app is None:
                return
            appid, token = self.holding.pop(analyser)
            kind = data.draw(st.sampled_from(("success", "retry", "retry")))
            self.counter += 1
            self._send(analyser, appid, (kind, self.counter), self.policy.analysis_version, token)

    def _due_retries_flagged(self, now: datetime, handed_out: str) -> None:
        """The promotion the claim ran first flagged every due retry (retry_due), so the
        claim's lowest tier finds it; the claim cleared the flag of the app it handed out."""
        flagged = {appid for (appid,) in self.sql.run("SELECT appid FROM apps WHERE retry_due")}
        due = {a.appid for a in self.apps.values() if due_retry(a, self.policy, now)}
        assert due - {handed_out} <= flagged, "a due retry the promoter did not flag"
        assert handed_out not in flagged, "a claim left the retry flag on its app"

    @rule(analyser=st.sampled_from(ANALYSERS))
    def claim_and_hang(self, analyser):
        """A hanging analyser: it claims, and its lease runs out with no result."""
        self.claim(analyser)
        if analyser in self.holding:
            appid, _ = self.holding[analyser]
            self._expire_lease(appid)

    @precondition(lambda self: self.apps)
    @rule(analyser=st.sampled_from(ANALYSERS), data=st.data())
    def claim_named(self, analyser, data):
        """Exact-app mode: GET /queue?appId= claims the app only if it is a candidate."""
        self._claim_app(analyser, self.apps[data.draw(st.sampled_from(sorted(self.apps)))])

    def _claim_app(self, analyser: str, app: App) -> None:
        time_passes()
        now = self.now()
        failed = self._promote(now)
        ready = claimable_by_name(app, self.policy, now)  # a due retry too, in any tier
        answer = self.client.get(
            f"/queue?appId={app.appid.upper()}", headers=self.headers[analyser]
        )
        assert answer.status_code == 200
        self._promoted(failed)
        self._due_retries_flagged(now, answer.text)
        if ready:
            assert answer.text == app.appid
            self._handed_out(analyser, app, answer.headers["x-analysis-claim-token"], now)
        else:
            assert answer.text == ""

    # --- results --------------------------------------------------------------------

    def _stored(self, app: App, key: tuple, version: int) -> None:
        app.version, app.result = version, key
        app.started, app.token, app.attempts, app.refetch_requested = None, None, 0, False
        app.holder = None
        _, app.analysed, _ = self.read_times(app.appid)
        self.history.add((app.appid, app.analysed))

    def _send(self, analyser, appid, key, version, token, lost_reply=False):
        app = self.apps[appid]
        expected = judged(
            app, key, version, token, self.named(analyser), self.policy.analysis_version
        )
        claim_epoch = app.epoch
        before = self.snapshot()
        headers = dict(self.headers.get(analyser, ANALYSER))
        if token is not None:
            headers["X-Analysis-Claim-Token"] = token
        self.fault.countdown = 1 if lost_reply else 0
        if key[0] == "success":
            answer = self.client.post(
                f"/uploadAnalysis?appId={appid}&analysisVersion={version}",
                json={"success": True, "marker": key[1]},
                headers=headers,
            )
        else:
            headers["Content-Type"] = "text/plain"
            log = f"{'usb disconnected' if key[0] == 'retry' else 'app not found'} #{key[1]}"
            answer = self.client.post(
                f"/reportAnalysisFailure?appId={appid}&analysisVersion={version}",
                content=log.encode(),
                headers=headers,
            )
        self.fault.countdown = 0
        if expected[0] == "refuse":
            assert answer.status_code == 409, (expected, answer.text)
            if len(expected) == 2:
                # The holder's answer, refused: its lease is answered or ended, and
                # nothing is stored.
                assert self.snapshot()[1] == before[1], "a refused result entered history"
                if expected[1] == "ended":
                    self._lease_ended(app)
                else:
                    app.attempts, app.handouts_since_result = 0, 0
                return None
            assert self.snapshot() == before, "a 409 changed something"
            return None
        assert answer.status_code == 200, (expected, answer.text)
        if expected[0] == "stored":
            assert answer.json()["rows"][0]["analysed"] == app.analysed.isoformat()
            assert self.snapshot() == before, "a result stored already was written again"
            return answer
        _, claim, verified = expected
        was_processing, refetch = app.status == "processing", app.refetch_requested
        was_queued = app.status == "queued"
        streak = streak_after(app, key[0], version)
        self._stored(app, key, version)
        app.status, app.reason, app.retryable = RESULT_STATES[key[0]]
        app.result_claim, app.result_verified = claim, verified
        app.analysed_by = self.named(analyser)
        app.handouts_since_result = 0
        app.streak = streak
        if (was_processing and refetch) or (was_queued and (claim is not None or refetch)):
            app.status, app.reason, app.retryable = "queued", None, None
            app.refetch_requested = True  # done by this result: until the next claim
            app.streak = 0  # the refetch's
            app.epoch += was_processing
        self.acks.setdefault(appid, []).append(
            Ack(key, claim_epoch, key[0] == "success", token is not None)
        )
        self.sent.append((analyser, appid, key, version, token, answer.json()))
        assert answer.json()["rows"][0]["analysed"] == app.analysed.isoformat()
        return answer

    def _send_again(self, analyser, appid, key, version, token, first, lost_reply=False):
        """The same result sent again: answered as the first time when it is the stored
        one in a state its first delivery left."""
        app = self.apps[appid]
        expected = judged(
            app, key, version, token, self.named(analyser), self.policy.analysis_version
        )
        answer = self._send(analyser, appid, key, version, token, lost_reply)
        if expected[0] == "stored":
            # As the first time; only `analysed` may differ, where the model moved the clock
            # by rewriting it (it is checked against the row in _send).
            def without_time(body):
                return [{**row, "analysed": None} for row in body["rows"]]

            assert without_time(answer.json()) == without_time(first), "a retry answered anew"

    @precondition(lambda self: self.holding or self.superseded)
    @rule(
        data=st.data(),
        kind=st.sampled_from(("success", "retry", "final")),
        use_token=st.booleans(),
        offset=st.sampled_from((-1, 0, 1)),
        lost_reply=st.booleans(),
        then_claim=st.booleans(),
    )
    def result(self, data, kind, use_token, offset, lost_reply, then_claim):
        """A result from an analyser holding a claim, or from one whose claim was taken
        over (late), at an outdated, the current or a newer version (an analyser upgraded
        before the setting); maybe its COMMIT's reply is lost, and the service tries
        again; maybe the analyser's loop claims again at once."""
        claims = {**self.superseded, **self.holding}
        analyser = data.draw(st.sampled_from(sorted(claims)))
        appid, token = claims[analyser]
        version = self.policy.analysis_version + offset
        self.counter += 1
        self._send(
            analyser, appid, (kind, self.counter), version, token if use_token else None, lost_reply
        )
        if analyser in self.holding and self.holding[analyser][0] == appid:
            del self.holding[analyser]  # an analyser sends one result per claim
        if then_claim:
            self.claim(analyser)

    @precondition(lambda self: self.sent)
    @rule(data=st.data(), lost_reply=st.booleans())
    def result_sent_again(self, data, lost_reply):
        """The analyser did not see the answer and sends the same result again."""
        analyser, appid, key, version, token, first = data.draw(st.sampled_from(self.sent))
        self._send_again(analyser, appid, key, version, token, first, lost_reply)

    @precondition(lambda self: self.holding)
    @rule(
        data=st.data(),
        kind=st.sampled_from(("success", "retry", "final")),
        use_token=st.booleans(),
        offset=st.sampled_from((-1, 0, 1)),
        lost_replies=st.sampled_from(((False, False), (True, False), (False, True))),
        then=st.sampled_from(
            ("the same again", "the holder's own with its token", "a late one without a token")
        ),
    )
    def refetch_waits_then_results(self, data, kind, use_token, offset, lost_replies, then):
        """An operator's refetch of an app an analyser holds (it waits for that lease, or
        queues the app if the lease expired), then that analyser's result, then either
        the same result again (a reply lost after COMMIT: the service's retry, or the
        analyser's), answered as the first time with the app still queued; or another
        result with the claim's token, which replaces a result stored without it; or a
        late result without a token from an analyser whose lease was taken over, which
        must not undo the refetch."""
        analyser = data.draw(st.sampled_from(sorted(self.holding)))
        appid, claim_token = self.holding[analyser]
        self._refetch(appid, force=False)
        version = self.policy.analysis_version + offset
        token = claim_token if use_token else None
        self.counter += 1
        key = (kind, self.counter)
        first = self._send(analyser, appid, key, version, token, lost_replies[0])
        self.holding.pop(analyser, None)
        if first is None:
            return
        if then == "the same again":
            self._send_again(analyser, appid, key, version, token, first.json(), lost_replies[1])
            return
        self.counter += 1
        if then == "a late one without a token":
            self._send("stale", appid, ("success", self.counter), version, None, lost_replies[1])
            return
        self._send(analyser, appid, (kind, self.counter), version, claim_token, lost_replies[1])

    def _newer_analysis_claimed(self, data, analyser: str, stale: bool) -> App | None:
        """An app whose stored analysis is of a version above the current one (a result
        of a newer analyser, or the setting moved down since): maybe past the staleness
        window, where it is still no candidate; then refetched, and claimed by an analyser
        of the current version (None: a live lease, which the refetch waits for)."""
        newer = sorted(a.appid for a in self.apps.values() if self._newer_analysis(a))
        app = self.apps[data.draw(st.sampled_from(newer))]
        if stale and app.status != "processing":
            self._age(app.appid, (self.policy.stale_days + 1) * 24 * 60)
            self._claim_app(analyser, app)  # no candidate: an empty answer
        self._refetch(app.appid, force=False)
        if app.status != "queued":
            return None
        self._claim_app(analyser, app)
        return app

    def _newer_analysis(self, app: App) -> bool:
        return bool(app.result) and (app.version or 0) > self.policy.analysis_version

    @precondition(lambda self: any(self._newer_analysis(a) for a in self.apps.values()))
    @rule(
        data=st.data(),
        analyser=st.sampled_from(ANALYSERS),
        stale=st.booleans(),
        with_token=st.booleans(),
    )
    def newer_analysis_meets_an_older_result(self, data, analyser, stale, with_token):
        """_newer_analysis_claimed, then the analyser's result, refused: its lease ends and
        the app is as its stored analysis says."""
        app = self._newer_analysis_claimed(data, analyser, stale)
        if app is None:
            return
        self.counter += 1
        token = app.token if with_token else None
        key = ("success", self.counter)
        self._send(analyser, app.appid, key, self.policy.analysis_version, token)
        self.holding.pop(analyser, None)

    @precondition(lambda self: any(self._newer_analysis(a) for a in self.apps.values()))
    @rule(data=st.data(), analyser=st.sampled_from(ANALYSERS), stale=st.booleans())
    def newer_analysis_meets_a_hanging_analyser(self, data, analyser, stale):
        """_newer_analysis_claimed, then the analyser hangs, and the app is claimed again as
        each lease expires until it has expired max_lease_attempts times: the back-off's
        lease_expired failure, refused too, gives the app back its stored analysis."""
        app = self._newer_analysis_claimed(data, analyser, stale)
        if app is None:
            return
        while app.status == "processing" and app.attempts < self.policy.max_lease_attempts:
            self._expire_lease(app.appid)
            self._claim_app(analyser, app)
        self._expire_lease(app.appid)
        self.claim(analyser)  # its promotion backs the app off

    @precondition(lambda self: self.apps)
    @rule(data=st.data(), kind=st.sampled_from(("success", "retry")))
    def exact_app_result(self, data, kind):
        """An exact-app host's tokenless result for an app it was told to process."""
        appid = data.draw(st.sampled_from(sorted(self.apps)))
        self.counter += 1
        self._send("exact-app", appid, (kind, self.counter), self.policy.analysis_version, None)

    @precondition(lambda self: any(a.status == "processing" for a in self.apps.values()))
    @rule(
        data=st.data(),
        kind=st.sampled_from(("success", "retry")),
        sender=st.sampled_from(("stale", *NAMED)),
    )
    def stale_tokenless_result(self, data, kind, sender):
        """A tokenless result for an app another analyser holds now (its sender's lease was
        taken over): it must not make the holder's token stop working."""
        processing = sorted(a.appid for a in self.apps.values() if a.status == "processing")
        appid = data.draw(st.sampled_from(processing))
        self.counter += 1
        self._send(sender, appid, (kind, self.counter), self.policy.analysis_version, None)

    @precondition(lambda self: any((a.version or 0) > 1 for a in self.apps.values()))
    @rule(data=st.data(), use_token=st.booleans())
    def older_version_result(self, data, use_token):
        """A result of an older analysisVersion than the one stored (an old analyser)."""
        app = self.apps[
            data.draw(st.sampled_from(sorted(a.appid for a in self.apps.values() if a.version)))
        ]
        self.counter += 1
        token = app.token if use_token else None
        self._send("old", app.appid, ("success", self.counter), app.version - 1, token)

    # --- time, operators, policy ------------------------------------------------------

    @precondition(lambda self: any(a.status == "processing" for a in self.apps.values()))
    @rule(data=st.data())
    def lease_expires(self, data):
        """A hanging analyser: its lease runs out with no result."""
        appid = data.draw(
            st.sampled_from(sorted(a.appid for a in self.apps.values() if a.status == "processing"))
        )
        self._expire_lease(appid)

    def _expire_lease(self, appid: str) -> None:
        self.sql.run(
            "UPDATE apps SET processing_started = processing_started - make_interval(mins => :m)"
            " WHERE appid = :a",
            m=self.policy.processing_timeout_minutes + 1,
            a=appid,
        )
        _, _, self.apps[appid].started = self.read_times(appid)
        self.time_passes_for(self.apps[appid])

    @precondition(lambda self: any(a.analysed for a in self.apps.values()))
    @rule(data=st.data(), stale=st.booleans())
    def analysis_ages(self, data, stale):
        """An analysis gets a lease older, or past the staleness window."""
        appid = data.draw(
            st.sampled_from(sorted(a.appid for a in self.apps.values() if a.analysed))
        )
        minutes = (
            (self.policy.stale_days + 1) * 24 * 60
            if stale
            else self.policy.processing_timeout_minutes + 1
        )
        self._age(appid, minutes)

    def _age(self, appid: str, minutes: float) -> None:
        self.sql.run(
            "UPDATE apps SET analysed = analysed"
            " - make_interval(secs => CAST(:m AS double precision) * 60)"
            " WHERE appid = :a",
            m=minutes,
            a=appid,
        )
        _, self.apps[appid].analysed, _ = self.read_times(appid)
        self.time_passes_for(self.apps[appid])

    @precondition(lambda self: self.apps)
    @rule(data=st.data(), force=st.booleans())
    def refetch(self, data, force):
        self._refetch(data.draw(st.sampled_from(sorted(self.apps))), force)

    @precondition(lambda self: self.holding)
    @rule(data=st.data(), force=st.booleans(), then_claim=st.booleans())
    def refetch_while_held(self, data, force, then_claim):
        """The exact-app host's workflow on an app another analyser works on: a refetch,
        then (maybe) a claim at once."""
        appid, _ = self.holding[data.draw(st.sampled_from(sorted(self.holding)))]
        self._refetch(appid, force)
        if then_claim:
            self.claim(data.draw(st.sampled_from(ANALYSERS)))

    def _refetch(self, appid: str, force: bool) -> None:
        app = self.apps[appid]
        now = self.now()
        live = app.status == "processing" and not lease_expired(
            app.started, self.policy.processing_timeout_minutes, now
        )
        selected = refetch_apps(handler.api_connection(), [appid.upper()], True, self.policy, force)
        outcome = "waiting" if live and not force else "queued"
        if force and app.status == "processing":
            outcome = "lease_broken"
        assert selected == [{"appid": appid, "status": app.status, "outcome": outcome}]
        if app.analysed is not None and app.result is not None:
            self.history.add((appid, app.analysed))
        app.handouts_since_time = 0
        if outcome == "waiting":
            app.refetch_requested = True
            return
        app.status, app.started, app.reason, app.retryable, app.token = (
            "queued",
            None,
            None,
            None,
            None,
        )
        app.attempts, app.refetch_requested, app.handouts_since_result = 0, False, 0
        app.holder = None
        app.result_verified = True
        app.streak = 0
        app.epoch += 1
        for analyser, (held, _) in list(self.holding.items()):
            if held == appid:  # its claim is broken (fenced) or had expired
                self.superseded[analyser] = self.holding.pop(analyser)

    @precondition(lambda self: any(a.result for a in self.apps.values()))
    @rule(up=st.booleans())
    def setting_moves(self, up):
        """CURRENT_ANALYSIS_VERSION moves up (a version bump) or down (rolled back, or a
        fleet upgraded before the setting): stored analyses of a version above the
        current one. Each move is a new process, as a deploy of the new setting is."""
        version = self.policy.analysis_version + (1 if up else -1)
        if version < 2:  # an outdated analyser still sends version - 1 >= 1
            return
        self.policy = dataclasses.replace(self.policy, analysis_version=version)
        self.configure()
        for app in self.apps.values():
            self.time_passes_for(app)

    @rule(backoff=st.sampled_from(BACKOFFS))
    def backoff_changes(self, backoff):
        """RETRY_BACKOFF changes (a new process): the promoter clears the retry flags the
        old setting set and flags again what the new one backs."""
        self.policy = dataclasses.replace(self.policy, retry_backoff=backoff)
        self.configure()
        for app in self.apps.values():
            self.time_passes_for(app)

    @precondition(lambda self: self.apps)
    @rule(data=st.data(), held=st.booleans())
    def operator_holds(self, data, held):
        """An operator holds an app (held_at: no candidate by any rule, no retry) or
        releases it; a lease it had runs on."""
        appid = data.draw(st.sampled_from(sorted(self.apps)))
        self.sql.run(
            "UPDATE apps SET held_at = CASE WHEN :held THEN now() END WHERE appid = :a",
            held=held,
            a=appid,
        )
        self.apps[appid].held = held

    def _retry_waits(self, app: App) -> bool:
        return app.status == "failed" and app.retryable and self._retry_at(app) is not None

    def _retry_at(self, app: App) -> datetime | None:
        return retry_time(app.streak, app.analysed, self.policy)

    @precondition(lambda self: any(self._retry_waits(a) for a in self.apps.values()))
    @rule()
    def every_retry_falls_due(self):
        """Every retryable failure ages to a minute past its retry's time."""
        now = self.now()
        for app in list(self.apps.values()):
            if self._retry_waits(app) and self._retry_at(app) > now - timedelta(minutes=1):
                shift = self._retry_at(app) - now + timedelta(minutes=1)
                self._age(app.appid, shift / timedelta(minutes=1))

    @precondition(lambda self: any(self._retry_waits(a) for a in self.apps.values()))
    @rule(
        data=st.data(),
        early=st.booleans(),
        then_claim=st.sampled_from((None, None, *ANALYSERS)),
    )
    def retry_falls_due(self, data, early, then_claim):
        """A retryable failure ages to a minute past its retry's time (RETRY_BACKOFF's
        streak-th step after it), or to ten minutes before it; maybe an exact-app host
        then claims it by name (a due retry is handed out so in any tier)."""
        appid = data.draw(
            st.sampled_from(sorted(a.appid for a in self.apps.values() if self._retry_waits(a)))
        )
        ahead = self._retry_at(self.apps[appid]) - self.now()
        shift = ahead - timedelta(minutes=10) if early else ahead + timedelta(minutes=1)
        if shift > timedelta(0):
            self._age(appid, shift / timedelta(minutes=1))
        if then_claim is not None:
            self._claim_app(then_claim, self.apps[appid])

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def rows_match_the_model(self):
        if not hasattr(self, "apps"):
            return
        rows = self.sql.run(ROW)
        assert {r[0] for r in rows} == set(self.apps), "an app was lost or invented"
        for row in rows:
            (
                appid,
                status,
                version,
                _,
                started,
                reason,
                retryable,
                _,
                token,
                result_claim,
                verified,
                attempts,
                refetch,
                holder,
                analysed_by,
                streak,
                held,
            ) = row
            app = self.apps[appid]
            assert (status, version, reason, retryable) == (
                app.status,
                app.version,
                app.reason,
                app.retryable,
            ), appid
            assert (status == "processing") == (started is not None), "processing <=> a lease"
            assert (token, result_claim, verified) == (
                app.token,
                app.result_claim,
                app.result_verified,
            ), appid
            assert (attempts, refetch) == (app.attempts, app.refetch_requested), appid
            assert (holder, analysed_by) == (app.holder, app.analysed_by), appid
            assert (streak, held) == (app.streak, app.held), appid

    @invariant()
    def acknowledged_results_stand(self):
        if not hasattr(self, "apps"):
            return
        for appid, acks in self.acks.items():
            stored = self.apps[appid].result
            for index, ack in enumerate(acks):
                later = acks[index + 1 :]
                assert ack.key == stored or any(
                    b.epoch > ack.epoch
                    or (b.epoch == ack.epoch and b.success and not ack.success)
                    or (b.epoch == ack.epoch and b.verified and not ack.verified)
                    for b in later
                ), f"{appid}: the acknowledged {ack} was replaced by a stale result"

    @invariant()
    def history_only_grows(self):
        if not hasattr(self, "apps"):
            return
        rows = self.sql.run("SELECT id, appid, analysed, analysis FROM app_analyses ORDER BY id")
        assert rows[: len(self.history_rows)] == self.history_rows, "history changed"
        assert {(r[1], r[2]) for r in rows} == self.history
        self.history_rows = rows


def test_queue_model(client, sql, database_url, monkeypatch):
    QueueModel.client, QueueModel.sql = client, sql
    QueueModel.url, QueueModel.monkeypatch = database_url, monkeypatch
    QueueModel.fault = CommitReplyLost(monkeypatch)
    QueueModel.headers = None  # this test's database has no analysers yet
    run_state_machine_as_test(
        QueueModel,
        settings=settings(
            max_examples=examples(100),  # 100 at ci, 20 at dev
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            derandomize=True,
        ),
    )


# --- starvation: a fleet where a third of the apps always fail -------------------------


def answer_claim(client, appid: str, token: str, fails: bool) -> None:
    """The claim's result, with its token: a retryable failure (a USB error), or a
    success."""
    headers = {**ANALYSER, "X-Analysis-Claim-Token": token}
    if fails:
        answer = client.post(
            f"/reportAnalysisFailure?appId={appid}&analysisVersion=4",
            content=b"usb disconnected",
            headers={**headers, "Content-Type": "text/plain"},
        )
    else:
        answer = client.post(
            f"/uploadAnalysis?appId={appid}&analysisVersion=4",
            json={"success": True},
            headers=headers,
        )
    assert answer.status_code == 200, answer.text


@settings(
    max_examples=examples(20),  # 20 at ci, 4 at dev
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
@given(
    backoff=st.sampled_from(BACKOFFS),
    waves=st.lists(
        st.tuples(
            st.sampled_from((0, 30, 90, 400, 1500)),  # minutes passing before the wave
            st.lists(st.integers(0, 5), min_size=1, max_size=6),  # its apps' reviews
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_failing_apps_never_starve_new_ones(client, sql, monkeypatch, backoff, waves):
    """A fleet where a third of the apps fail (retryably) every time, while new apps
    arrive in waves and time passes: the analysers claim until the queue is empty and
    answer each claim at once. No claim hands out a due retry while another app is a
    candidate (a new app arriving while retries are due is handed out first), the due
    retries come in claim order once nothing else is, each failing app is retried once
    per step of RETRY_BACKOFF and then no more (its failures in a row one more than the
    steps), and every other app is analysed exactly once."""
    for table in ("app_analyses", "apps"):
        sql.run(f"DELETE FROM {table}")
    policy = handler.QueuePolicy(retry_backoff=backoff)
    configure_service(
        monkeypatch, handler.settings().database_url, RETRY_BACKOFF=policy.retry_backoff_text
    )
    failing: set[str] = set()
    handed_out: Counter[str] = Counter()

    def drain() -> None:
        while True:
            candidates, retries = oracle_tiers(sql, policy)  # the claim's promotion flags all
            time_passes()
            answer = client.get("/queue", headers=ANALYSER)
            assert answer.status_code == 200
            if candidates:
                assert answer.text == candidates[0], "a retry or another app before a candidate"
            else:
                assert answer.text == (retries[0] if retries else ""), "retries in claim order"
            if not answer.text:
                return
            handed_out[answer.text] += 1
            token = answer.headers["x-analysis-claim-token"]
            answer_claim(client, answer.text, token, answer.text in failing)

    def time_passes_for_all(seconds: float) -> None:
        sql.run(
            "UPDATE apps SET analysed = analysed"
            " - make_interval(secs => CAST(:s AS double precision))",
            s=seconds,
        )

    added = 0
    for minutes, reviews in waves:
        time_passes_for_all(minutes * 60)
        for popularity in reviews:
            added += 1
            appid = f"fleet.app{added:02d}"
            answer = client.post(
                "/apps",
                json={"appId": appid, "details": {"reviews": str(popularity)}},
                headers=ADMIN,
            )
            assert answer.status_code == 201
            if added % 3 == 0:
                failing.add(appid)
        drain()
    # Then each failing app's every retry falls due in turn, until none is left.
    for _ in range(len(backoff) + 1):
        time_passes_for_all(max(backoff, default=0) + 60)
        drain()
    rows = {r[0]: r[1:] for r in sql.run("SELECT appid, status, failure_streak FROM apps")}
    assert len(rows) == added
    for appid, (status, streak) in rows.items():
        if appid in failing:
            spent = len(backoff) + 1
            assert (status, streak, handed_out[appid]) == ("failed", spent, spent), appid
        else:
            assert (status, streak, handed_out[appid]) == ("analysed", 0, 1), appid
