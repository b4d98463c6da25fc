"""A model of the queue: random interleavings of every operation, checked step by step.

Hypothesis drives adds, claims (the next app, and exact-app mode's named claim), uploads
and failure reports with and without claim tokens and at the current or an outdated
analysisVersion, from holders and from analysers whose lease was taken over, replies lost
after COMMIT (the service retries) and results sent again (the analyser retries), leases
that expire again and again (a hanging analyser), ageing, operators' refetches with and
without --force, and version bumps, across several analysers, against the real database
through the ASGI app. A small pure-Python model of the queue's rules (docs/queue.md)
predicts every answer and every row; the clock is moved by rewriting the timestamps, and
the only things read back are clock readings.

Beside the model's predictions, the promises are checked as invariants of their own:
- no app is handed out while another analyser holds a live lease on it;
- every 2xx result is the stored one, or was replaced legitimately: by a later claim's
  result, or within its claim by a success (over a failure) or by the claim token's holder
  (over a result that came without the token);
- every 409 changed nothing (the row and the history are as they were);
- no app is handed out twice without time passing for it, an operator's refetch or a
  version bump in between, and never more than max_lease_attempts times without a result.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import pg8000.native
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kit import ADMIN, ANALYSER, configure_service, time_passes

import handler

ANALYSERS = ("pi-1", "pi-2", "pi-3")
ROW = (
    "SELECT appid, status, analysisversion, analysed, processing_started, failure_reason,"
    " failure_retryable, CAST(analysis AS text), CAST(analysis_claim_token AS text),"
    " CAST(result_claim_token AS text), result_claim_verified, lease_attempts,"
    " refetch_requested FROM apps ORDER BY appid"
)


@dataclasses.dataclass
class App:
    appid: str
    reviews: int
    added: datetime
    status: str = "queued"
    version: int | None = None
    analysed: datetime | None = None
    started: datetime | None = None
    reason: str | None = None
    retryable: bool | None = None
    token: str | None = None  # the open claim's
    result: tuple | None = None  # the stored result: (kind, marker)
    result_claim: str | None = None
    result_verified: bool = False
    attempts: int = 0
    refetch_requested: bool = False
    epoch: int = 0  # claims and refetches so far
    handouts_since_time: int = 0
    handouts_since_result: int = 0


@dataclasses.dataclass(frozen=True)
class Ack:
    """A result answered 2xx."""

    key: tuple
    epoch: int
    success: bool
    verified: bool


def candidate(app: App, policy: handler.QueuePolicy, now: datetime) -> bool:
    lease_ago = now - timedelta(minutes=policy.processing_timeout_minutes)
    if app.status == "queued":
        return True
    if app.status == "processing":
        return app.started < lease_ago and app.attempts < policy.max_lease_attempts
    if app.status == "failed" and not app.retryable:
        return False
    outdated = (app.version or 0) < policy.analysis_version and app.analysed < lease_ago
    return outdated or app.analysed < now - timedelta(days=policy.stale_days)


def verdict(app: App, key: tuple, version: int, token: str | None) -> tuple:
    """The model's statement of the result rules: ("store", claim, verified), ("stored",)
    or ("refuse",)."""
    success = key[0] == "success"
    finished = app.status in ("analysed", "failed")
    same = app.result == key and app.version == version
    if same and finished:
        return ("stored",)
    newer = app.result is not None and app.version is not None and app.version > version
    if token is not None:
        if app.status == "processing" and token == app.token:
            return ("refuse",) if newer else ("store", app.token, True)
        if token == app.result_claim:
            if same:
                return ("stored",)
            stored_success = app.result is not None and app.result[0] == "success"
            replaceable = app.status != "processing" and not app.result_verified
            if replaceable and (success or not stored_success):
                return ("refuse",) if newer else ("store", app.result_claim, True)
        return ("refuse",)
    if newer:
        return ("refuse",)
    if app.status == "processing":
        return ("store", app.token, False)
    if app.status == "queued":
        return ("store", None, False)
    if app.status == "failed" and success:
        return ("store", app.result_claim, False)
    return ("refuse",)


class CommitReplyLost:
    """Session.execute that, once armed, runs COMMIT and then loses the connection before
    its reply is read, as a network cut after the COMMIT left would."""

    def __init__(self, monkeypatch):
        self.armed = False
        original = handler.Session.execute

        def execute(session, sql):
            original(session, sql)
            if sql == "COMMIT" and self.armed:
                self.armed = False
                session.connection.close()
                raise pg8000.native.InterfaceError("network error: the reply was lost")

        monkeypatch.setattr(handler.Session, "execute", execute)


class QueueModel(RuleBasedStateMachine):
    client = None
    sql = None
    url = None
    monkeypatch = None
    fault = None

    @initialize()
    def start(self):
        for table in ("app_analyses", "apps", "analyser_heartbeats"):
            self.sql.run(f"DELETE FROM {table}")
        self.policy = handler.QueuePolicy()
        configure_service(self.monkeypatch, self.url)
        self.apps: dict[str, App] = {}
        self.holding: dict[str, tuple[str, str]] = {}  # analyser -> (appid, token)
        self.superseded: dict[str, tuple[str, str]] = {}  # analyser -> a claim taken over
        self.acks: dict[str, list[Ack]] = {}
        self.sent: list[tuple] = []  # requests answered 2xx, to send again
        self.history: set[tuple[str, datetime]] = set()
        self.history_rows: list = []
        self.counter = 0

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

    def _promoted(self, now: datetime) -> None:
        """The promoter's lease rescuer, which every claim runs first: leases that expired
        max_lease_attempts times in a row become lease_expired failures."""
        lease_ago = now - timedelta(minutes=self.policy.processing_timeout_minutes)
        for app in self.apps.values():
            at_limit = (
                app.status == "processing"
                and app.started < lease_ago
                and app.attempts >= self.policy.max_lease_attempts
            )
            if at_limit and app.refetch_requested:  # the operator's refetch wins
                app.status, app.started, app.token = "queued", None, None
                app.attempts, app.refetch_requested = 0, False
                app.handouts_since_result = app.handouts_since_time = 0
                app.epoch += 1
                continue
            if at_limit:
                self.counter += 1
                self._stored(app, ("server", self.counter), self.policy.analysis_version)
                app.status, app.reason, app.retryable = "failed", "lease_expired", True
                app.result_claim, app.result_verified = None, False
                app.handouts_since_result = 0
                # A stand-in for the rescued claims' results, for the acknowledged-results
                # invariant: a later claim's outcome replaces earlier results.
                self.acks.setdefault(app.appid, []).append(Ack(app.result, app.epoch, False, True))

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
        app.epoch += 1
        _, _, app.started = self.read_times(app.appid)
        self.holding.pop(analyser, None)
        self.superseded.pop(analyser, None)
        self.holding[analyser] = (app.appid, token)

    @rule(analyser=st.sampled_from(ANALYSERS))
    def claim(self, analyser):
        time_passes()  # the clock may have moved since the last promotion
        now = self.now()
        ready = [a for a in self.apps.values() if candidate(a, self.policy, now)]
        ready.sort(key=lambda a: (-a.reviews, a.added, a.appid))
        answer = self.client.get("/queue", headers=ANALYSER)
        assert answer.status_code == 200
        assert answer.text == (ready[0].appid if ready else "")
        self._promoted(now)
        if ready:
            token = answer.headers["x-analysis-claim-token"]
            self._handed_out(analyser, self.apps[answer.text], token, now)

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
        app = self.apps[data.draw(st.sampled_from(sorted(self.apps)))]
        time_passes()
        now = self.now()
        ready = candidate(app, self.policy, now)
        answer = self.client.get(f"/queue?appId={app.appid.upper()}", headers=ANALYSER)
        assert answer.status_code == 200
        self._promoted(now)
        if ready:
            assert answer.text == app.appid
            self._handed_out(analyser, app, answer.headers["x-analysis-claim-token"], now)
        else:
            assert answer.text == ""

    # --- results --------------------------------------------------------------------

    def _stored(self, app: App, key: tuple, version: int) -> None:
        app.version, app.result = version, key
        app.started, app.token, app.attempts, app.refetch_requested = None, None, 0, False
        _, app.analysed, _ = self.read_times(app.appid)
        self.history.add((app.appid, app.analysed))

    def _send(self, analyser, appid, key, version, token, lost_reply=False):
        app = self.apps[appid]
        expected = verdict(app, key, version, token)
        claim_epoch = app.epoch
        before = self.snapshot()
        headers = dict(ANALYSER)
        if token is not None:
            headers["X-Analysis-Claim-Token"] = token
        self.fault.armed = lost_reply
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
        self.fault.armed = False
        if expected[0] == "refuse":
            assert answer.status_code == 409, (expected, answer.text)
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
        self._stored(app, key, version)
        if key[0] == "success":
            app.status, app.reason, app.retryable = "analysed", None, None
        elif key[0] == "retry":
            app.status, app.reason, app.retryable = "failed", "analysis_failed", True
        else:
            app.status, app.reason, app.retryable = "failed", "app_not_found", False
        app.result_claim, app.result_verified = claim, verified
        app.handouts_since_result = 0
        if (was_processing and refetch) or (was_queued and claim is not None):
            app.status, app.reason, app.retryable = "queued", None, None
            app.epoch += was_processing
        self.acks.setdefault(appid, []).append(
            Ack(key, claim_epoch, key[0] == "success", token is not None)
        )
        self.sent.append((analyser, appid, key, version, token, answer.json()))
        assert answer.json()["rows"][0]["analysed"] == app.analysed.isoformat()
        return answer

    @precondition(lambda self: self.holding or self.superseded)
    @rule(
        data=st.data(),
        kind=st.sampled_from(("success", "retry", "final")),
        use_token=st.booleans(),
        outdated=st.booleans(),
        lost_reply=st.booleans(),
    )
    def result(self, data, kind, use_token, outdated, lost_reply):
        """A result from an analyser holding a claim, or from one whose claim was taken
        over (late), at the current version or an outdated one; maybe its COMMIT's reply is
        lost, and the service tries again."""
        claims = {**self.superseded, **self.holding}
        analyser = data.draw(st.sampled_from(sorted(claims)))
        appid, token = claims[analyser]
        version = self.policy.analysis_version - (1 if outdated else 0)
        self.counter += 1
        self._send(
            analyser, appid, (kind, self.counter), version, token if use_token else None, lost_reply
        )
        if analyser in self.holding and self.holding[analyser][0] == appid:
            del self.holding[analyser]  # an analyser sends one result per claim

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def result_sent_again(self, data):
        """The analyser did not see the answer and sends the same result again."""
        analyser, appid, key, version, token, first = data.draw(st.sampled_from(self.sent))
        app = self.apps[appid]
        expected = verdict(app, key, version, token)
        answer = self._send(analyser, appid, key, version, token)
        if expected[0] == "stored":
            # As the first time; only `analysed` may differ, where the model moved the clock
            # by rewriting it (it is checked against the row in _send).
            def without_time(body):
                return [{**row, "analysed": None} for row in body["rows"]]

            assert without_time(answer.json()) == without_time(first), "a retry answered anew"

    @precondition(lambda self: self.apps)
    @rule(data=st.data(), kind=st.sampled_from(("success", "retry")))
    def exact_app_result(self, data, kind):
        """An exact-app host's tokenless result for an app it was told to process."""
        appid = data.draw(st.sampled_from(sorted(self.apps)))
        self.counter += 1
        self._send("exact-app", appid, (kind, self.counter), self.policy.analysis_version, None)

    @precondition(lambda self: any(a.status == "processing" for a in self.apps.values()))
    @rule(data=st.data(), kind=st.sampled_from(("success", "retry")))
    def stale_tokenless_result(self, data, kind):
        """A tokenless result for an app another analyser holds now (its sender's lease was
        taken over): it must not make the holder's token stop working."""
        processing = sorted(a.appid for a in self.apps.values() if a.status == "processing")
        appid = data.draw(st.sampled_from(processing))
        self.counter += 1
        self._send("stale", appid, (kind, self.counter), self.policy.analysis_version, None)

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
        self.sql.run(
            "UPDATE apps SET analysed = analysed - make_interval(mins => :m) WHERE appid = :a",
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
        live = app.status == "processing" and app.started >= now - timedelta(
            minutes=self.policy.processing_timeout_minutes
        )
        selected = handler.queue_refetch(
            handler.api_connection(), [appid.upper()], False, False, None, True, self.policy, force
        )
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
        app.result_verified = True
        app.epoch += 1
        for analyser, (held, _) in list(self.holding.items()):
            if held == appid:  # its claim is broken (fenced) or had expired
                self.superseded[analyser] = self.holding.pop(analyser)

    @rule()
    def version_bump(self):
        version = self.policy.analysis_version + 1
        self.policy = dataclasses.replace(self.policy, analysis_version=version)
        configure_service(self.monkeypatch, self.url, CURRENT_ANALYSIS_VERSION=str(version))
        for app in self.apps.values():
            self.time_passes_for(app)

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
    run_state_machine_as_test(
        QueueModel,
        settings=settings(
            max_examples=100,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            derandomize=True,
        ),
    )
