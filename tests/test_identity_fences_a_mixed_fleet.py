"""A fleet of named analysers and hosts on the shared password, mixed: random
interleavings of claims, results with and without claim tokens, late results from hosts
whose lease was taken over, lease expiry and refetches, against the real database
through the ASGI app. A pure-Python model of the identity rules (docs/analysers.md,
"Identity on leases and results") predicts every answer and every row; the property it
stands for: a stale analyser's tokenless result never ends another's claim or replaces
its result, and a claim token works for every credential."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
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
from kit import ADMIN, ANALYSER, configure_service, examples, time_passes

import handler
from helpers import refetch_apps
from queue_model import App, judged, next_claim, streak_after

pytestmark = pytest.mark.slow  # a stateful model: minutes

NAMED = ("pi-1", "pi-2", "pi-3")
SHARED = ("shared-a", "shared-b")  # two hosts on the shared password
HOSTS = NAMED + SHARED


class FleetModel(RuleBasedStateMachine):
    client = None
    sql = None
    url = None
    monkeypatch = None

    @initialize()
    def start(self):
        for table in ("app_analyses", "apps", "analyser_heartbeats", "analysers"):
            self.sql.run(f"DELETE FROM {table}")
        self.policy = handler.QueuePolicy()
        configure_service(self.monkeypatch, self.url)
        self.headers = {host: ANALYSER for host in SHARED}
        for name in NAMED:
            answer = self.client.post("/analysers", json={"name": name}, headers=ADMIN)
            assert answer.status_code == 201
            self.headers[name] = {"Authorization": f"Bearer {answer.json()['token']}"}
        self.apps: dict[str, App] = {}
        self.leases: dict[str, tuple[str, str]] = {}  # host -> (appid, claim token)
        for number, reviews in enumerate((5, 3, 1, 0)):
            appid = f"fleet.app{number}"
            answer = self.client.post(
                "/apps", json={"appId": appid, "details": {"reviews": str(reviews)}}, headers=ADMIN
            )
            assert answer.status_code == 201
            added = self.sql.run("SELECT added FROM apps WHERE appid = :a", a=appid)[0][0]
            self.apps[appid] = App(appid, reviews, added)

    def now(self) -> datetime:
        return self.sql.run("SELECT now()")[0][0]

    def times(self, appid: str) -> tuple:
        return tuple(
            self.sql.run("SELECT analysed, processing_started FROM apps WHERE appid = :a", a=appid)[
                0
            ]
        )

    @staticmethod
    def named(host: str) -> str | None:
        return host if host in NAMED else None

    # --- rules ----------------------------------------------------------------------

    @rule(host=st.sampled_from(HOSTS))
    def claim(self, host):
        time_passes()
        now = self.now()
        chosen = next_claim(self.apps.values(), self.policy, now)  # a due retry last
        answer = self.client.get("/queue", headers=self.headers[host])
        assert answer.status_code == 200
        assert answer.text == (chosen.appid if chosen else "")
        self.backed_off(now)
        if chosen is None:
            return
        app = self.apps[answer.text]
        app.attempts = app.attempts + 1 if app.status == "processing" else 1
        app.status, app.token = "processing", answer.headers["x-analysis-claim-token"]
        app.holder = self.named(host)
        _, app.started = self.times(app.appid)
        self.leases[host] = (app.appid, app.token)  # a host remembers its last lease only

    def backed_off(self, now: datetime) -> None:
        """The promoter, which the claim ran first: leases that expired max_lease_attempts
        times in a row became lease_expired failures (docs/queue.md, "Backing off")."""
        lease_ago = now - timedelta(minutes=self.policy.processing_timeout_minutes)
        for app in self.apps.values():
            expired = app.status == "processing" and app.started < lease_ago
            if expired and app.attempts >= self.policy.max_lease_attempts:
                app.streak = streak_after(app, "server", self.policy.analysis_version)
                app.status, app.reason, app.retryable = "failed", "lease_expired", True
                app.version, app.result = self.policy.analysis_version, ("server",)
                app.token, app.holder, app.started, app.attempts = None, None, None, 0
                app.result_claim, app.result_verified = None, False
                app.analysed_by = None  # the server's result, no analyser's
                app.analysed, _ = self.times(app.appid)

    def send(self, host: str, appid: str, token: str | None, success: bool) -> None:
        """The queue's result rules, then identity (queue_model.judged): a claim token
        decides when sent; without one, a named host's result needs its own claim, a
        shared-password one needs no named claim."""
        app = self.apps[appid]
        key = ("success" if success else "retry", host)
        version = self.policy.analysis_version
        judgement = judged(app, key, version, token, self.named(host), version)
        want = 409 if judgement[0] == "refuse" else 200
        headers = dict(self.headers[host])
        if token is not None:
            headers["X-Analysis-Claim-Token"] = token
        query = f"appId={appid}&analysisVersion={self.policy.analysis_version}"
        if success:
            answer = self.client.post(
                f"/uploadAnalysis?{query}", json={"success": True, "by": host}, headers=headers
            )
        else:
            answer = self.client.post(
                f"/reportAnalysisFailure?{query}",
                content=f"usb error on {host}".encode(),
                headers={**headers, "Content-Type": "text/plain"},
            )
        assert answer.status_code == want, (host, app, token, answer.text)
        if judgement[0] != "store":
            return
        app.streak = streak_after(app, key[0], version)  # failures in a row
        app.result, app.result_claim, app.result_verified = key, judgement[1], judgement[2]
        app.attempts = 0
        app.status = "analysed" if success else "failed"
        app.version = self.policy.analysis_version
        app.reason, app.retryable = (None, None) if success else ("analysis_failed", True)
        app.token, app.holder, app.started = None, None, None
        app.analysed_by = self.named(host)
        app.analysed, _ = self.times(appid)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), with_token=st.booleans(), success=st.booleans())
    def result_for_the_last_lease(self, data, with_token, success):
        """A host sends the result of the last app it was handed: the deployed loop (no
        claim token) or the newer one; its lease may have been taken over since."""
        host = data.draw(st.sampled_from(sorted(self.leases)))
        appid, token = self.leases.pop(host)
        app = self.apps[appid]
        if host in SHARED and not with_token and app.token != token and app.holder is None:
            # A shared host's late tokenless result on a lease no named analyser holds is
            # the queue's rules (its edges), not identity's: this model leaves it out.
            return
        self.send(host, appid, token if with_token else None, success)

    @rule(host=st.sampled_from(NAMED), data=st.data(), success=st.booleans())
    def named_tokenless_result_for_any_app(self, host, data, success):
        """A named analyser (stale, confused, or stolen and replaying) sends a tokenless
        result for any app: taken only if that app's lease is its own claim."""
        self.send(host, data.draw(st.sampled_from(sorted(self.apps))), None, success)

    @rule(host=st.sampled_from(SHARED), data=st.data())
    def shared_tokenless_result_on_a_named_lease(self, host, data):
        named = sorted(a for a, app in self.apps.items() if app.holder is not None)
        if named:
            self.send(host, data.draw(st.sampled_from(named)), None, True)

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
        _, self.apps[appid].started = self.times(appid)

    @rule(data=st.data())
    def refetch(self, data):
        appid = data.draw(st.sampled_from(sorted(self.apps)))
        # --force: this model's operator breaks leases; refetches that wait for a live
        # lease are tests/test_queue_follows_its_rules.py's.
        refetch_apps(handler.api_connection(), [appid], True, self.policy, force=True)
        app = self.apps[appid]
        app.status, app.started, app.reason, app.retryable = "queued", None, None, None
        app.token, app.holder, app.attempts, app.streak = None, None, 0, 0

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def rows_match_the_model(self):
        if not hasattr(self, "apps"):
            return
        columns = ("appid", "status", "failure_reason", "token", "holder", "analysed_by", "streak")
        rows = [
            dict(zip(columns, row, strict=True))
            for row in self.sql.run(
                "SELECT appid, status, failure_reason, CAST(analysis_claim_token AS text),"
                " CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token"
                " THEN claimed_by END, analysed_by, failure_streak FROM apps"
            )
        ]
        assert {row["appid"] for row in rows} == set(self.apps)
        for row in rows:
            app = self.apps[row["appid"]]
            assert (
                row["status"],
                row["failure_reason"],
                row["token"],
                row["holder"],
                row["analysed_by"],
                row["streak"],
            ) == (app.status, app.reason, app.token, app.holder, app.analysed_by, app.streak), app

    @invariant()
    def each_analysers_view_matches(self):
        if not hasattr(self, "apps"):
            return
        listed = self.client.get("/analysers", headers=ADMIN).json()["analysers"]
        holding = {row["name"]: (row["holding"] or {}).get("appId") for row in listed}
        for name in NAMED:
            held = sorted((a.started, a.appid) for a in self.apps.values() if a.holder == name)
            assert holding[name] == (held[-1][1] if held else None), name


def test_a_mixed_fleet_is_fenced_by_identity(client, sql, database_url, monkeypatch):
    FleetModel.client, FleetModel.sql = client, sql
    FleetModel.url, FleetModel.monkeypatch = database_url, monkeypatch
    run_state_machine_as_test(
        FleetModel,
        settings=settings(
            max_examples=examples(60),  # 60 at ci, 12 at dev
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            derandomize=True,
        ),
    )
