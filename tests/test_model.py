"""A model of the queue: random interleavings of every operation, checked step by step.

Hypothesis drives adds, claims, uploads (with and without claim tokens), failure reports,
late uploads from analysers whose lease was taken over, lease expiry and ageing (the
clock moved by rewriting the timestamps), refetches and version bumps, across several
analysers, against the real database through the ASGI app. A small pure-Python model of
the queue's rules (docs/queue.md) predicts every answer and every row. The only
things the model reads back from the database are clock readings (the times a row was
claimed or stored).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

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
    token: str | None = None


def candidate(app: App, policy: handler.QueuePolicy, now: datetime) -> bool:
    if app.status == "queued":
        return True
    if app.status == "processing":
        return app.started < now - timedelta(minutes=policy.processing_timeout_minutes)
    if app.status == "failed" and not app.retryable:
        return False
    return (app.version or 0) < policy.analysis_version or app.analysed < now - timedelta(
        days=policy.stale_days
    )


class QueueModel(RuleBasedStateMachine):
    client = None
    sql = None
    url = None
    monkeypatch = None

    @initialize()
    def start(self):
        for table in ("app_analyses", "apps", "analyser_heartbeats"):
            self.sql.run(f"DELETE FROM {table}")
        self.policy = handler.QueuePolicy()
        configure_service(self.monkeypatch, self.url)
        self.apps: dict[str, App] = {}
        self.holding: dict[str, tuple[str, str]] = {}  # analyser -> (appid, token)
        self.superseded: dict[str, tuple[str, str]] = {}  # analyser -> an expired claim
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

    # --- rules ----------------------------------------------------------------------

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

    @rule(analyser=st.sampled_from(ANALYSERS))
    def claim(self, analyser):
        time_passes()  # the clock may have moved since the last promotion
        now = self.now()
        ready = [a for a in self.apps.values() if candidate(a, self.policy, now)]
        ready.sort(key=lambda a: (-a.reviews, a.added, a.appid))
        answer = self.client.get("/queue", headers=ANALYSER)
        assert answer.status_code == 200
        assert answer.text == (ready[0].appid if ready else "")
        if not ready:
            return
        app = self.apps[answer.text]
        token = answer.headers["x-analysis-claim-token"]
        for other, (held, old_token) in list(self.holding.items()):
            if held == app.appid:  # its lease had expired: that analyser is now late
                self.superseded[other] = (held, old_token)
                del self.holding[other]
        app.status, app.token = "processing", token
        _, _, app.started = self.read_times(app.appid)
        self.holding.pop(analyser, None)
        self.holding[analyser] = (app.appid, token)

    def _stored(self, app: App, status: str, reason=None, retryable=None):
        app.status, app.version, app.reason, app.retryable = (
            status,
            self.policy.analysis_version,
            reason,
            retryable,
        )
        app.started, app.token = None, None
        _, app.analysed, _ = self.read_times(app.appid)
        self.history.add((app.appid, app.analysed))

    @precondition(lambda self: self.holding)
    @rule(data=st.data(), use_token=st.booleans())
    def upload(self, data, use_token):
        analyser = data.draw(st.sampled_from(sorted(self.holding)))
        appid, token = self.holding.pop(analyser)
        headers = {**ANALYSER, "X-Analysis-Claim-Token": token} if use_token else ANALYSER
        answer = self.client.post(
            f"/uploadAnalysis?appId={appid}&analysisVersion={self.policy.analysis_version}",
            json={"success": True, "by": analyser},
            headers=headers,
        )
        assert answer.status_code == 200
        assert answer.json()["rowCount"] == 1
        self._stored(self.apps[appid], "analysed")

    @precondition(lambda self: self.holding)
    @rule(data=st.data(), retryable=st.booleans())
    def report_failure(self, data, retryable):
        analyser = data.draw(st.sampled_from(sorted(self.holding)))
        appid, token = self.holding.pop(analyser)
        log = b"usb disconnected" if retryable else b"error: app not found"
        answer = self.client.post(
            f"/reportAnalysisFailure?appId={appid}&analysisVersion={self.policy.analysis_version}",
            content=log,
            headers={**ANALYSER, "X-Analysis-Claim-Token": token, "Content-Type": "text/plain"},
        )
        assert answer.status_code == 200
        reason = "analysis_failed" if retryable else "app_not_found"
        self._stored(self.apps[appid], "failed", reason, retryable)

    @precondition(lambda self: self.superseded)
    @rule(data=st.data())
    def late_upload_is_fenced(self, data):
        analyser = data.draw(st.sampled_from(sorted(self.superseded)))
        appid, token = self.superseded.pop(analyser)
        answer = self.client.post(
            f"/uploadAnalysis?appId={appid}&analysisVersion={self.policy.analysis_version}",
            json={"success": True, "late": True},
            headers={**ANALYSER, "X-Analysis-Claim-Token": token},
        )
        assert answer.status_code == 409

    @precondition(lambda self: any(a.status == "processing" for a in self.apps.values()))
    @rule(data=st.data())
    def lease_expires(self, data):
        appid = data.draw(
            st.sampled_from(sorted(a.appid for a in self.apps.values() if a.status == "processing"))
        )
        self.sql.run(
            "UPDATE apps SET processing_started = processing_started - make_interval(mins => :m)"
            " WHERE appid = :a",
            m=self.policy.processing_timeout_minutes + 1,
            a=appid,
        )
        _, _, self.apps[appid].started = self.read_times(appid)

    @precondition(lambda self: any(a.analysed for a in self.apps.values()))
    @rule(data=st.data())
    def analysis_ages(self, data):
        appid = data.draw(
            st.sampled_from(sorted(a.appid for a in self.apps.values() if a.analysed))
        )
        self.sql.run(
            "UPDATE apps SET analysed = analysed - make_interval(days => :d) WHERE appid = :a",
            d=self.policy.stale_days + 1,
            a=appid,
        )
        _, self.apps[appid].analysed, _ = self.read_times(appid)

    @precondition(lambda self: self.apps)
    @rule(data=st.data())
    def refetch(self, data):
        appid = data.draw(st.sampled_from(sorted(self.apps)))
        selected = handler.queue_refetch(
            handler.database(), [appid.upper()], False, False, None, True
        )
        assert selected == [{"appid": appid, "status": self.apps[appid].status}]
        app = self.apps[appid]
        if app.analysed is not None:
            self.history.add((appid, app.analysed))
        app.status, app.started, app.reason, app.retryable, app.token = (
            "queued",
            None,
            None,
            None,
            None,
        )
        for analyser, (held, token) in list(self.holding.items()):
            if held == appid:  # that analyser's claim is gone; its token is now stale
                self.superseded[analyser] = (held, token)
                del self.holding[analyser]

    @rule()
    def version_bump(self):
        version = self.policy.analysis_version + 1
        self.policy = dataclasses.replace(self.policy, analysis_version=version)
        configure_service(self.monkeypatch, self.url, CURRENT_ANALYSIS_VERSION=str(version))

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def rows_match_the_model(self):
        if not hasattr(self, "apps"):
            return
        rows = self.sql.run(
            "SELECT appid, status, analysisversion, failure_reason, failure_retryable,"
            " processing_started, CAST(analysis_claim_token AS text) FROM apps"
        )
        assert {r[0] for r in rows} == set(self.apps), "an app was lost or invented"
        for appid, status, version, reason, retryable, started, token in rows:
            app = self.apps[appid]
            assert (status, version, reason, retryable) == (
                app.status,
                app.version,
                app.reason,
                app.retryable,
            ), appid
            assert (status == "processing") == (started is not None), "processing <=> a lease"
            assert token == app.token

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
