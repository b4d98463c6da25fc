"""The queue's rules as a small pure-Python model of an app, which the model tests
(tests/test_queue_follows_its_rules.py, and the mixed fleet's,
tests/test_identity_fences_a_mixed_fleet.py) predict every answer and every row by.

`App` is an app as the model sees it; `candidate` says whether a claim may hand it out
(docs/queue.md, "Candidates"), `due_retry` whether it is a due retry (the lowest tier,
docs/queue.md, "Retries"), `next_claim` which app GET /queue hands out, `streak_after`
the failures in a row a stored result leaves, `verdict` what a result does to it (the result rules,
docs/queue.md, "Results: what is stored, what is refused"), and `judged` that verdict
held to the sender's identity (docs/analysers.md). Not a test module: the test files
import it.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import handler
from helpers import lease_expired, retry_time

# The status columns each kind of stored result says.
RESULT_STATES = {
    "success": ("analysed", None, None),
    "retry": ("failed", "analysis_failed", True),
    "final": ("failed", "app_not_found", False),
    "server": ("failed", "lease_expired", True),
}


@dataclasses.dataclass
class App:
    """An app as the models see it. (The mixed fleet's model leaves epoch and the
    hand-out counts as they start: they are the queue model's checks.)"""

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
    holder: str | None = None  # the named analyser whose claim the lease is
    analysed_by: str | None = None  # the named analyser that stored the result
    streak: int = 0  # failures in a row of the stored result at its version
    held: bool = False  # an operator's hold (held_at)
    epoch: int = 0  # claims and refetches so far
    handouts_since_time: int = 0
    handouts_since_result: int = 0

    def row(self) -> dict:
        """As helpers.is_candidate reads a row."""
        return {
            "status": self.status,
            "processing_started": self.started,
            "failure_retryable": self.retryable,
            "analysisversion": self.version,
            "analysed": self.analysed,
            "lease_attempts": self.attempts,
            "failure_streak": self.streak,
            "held_at": True if self.held else None,  # only whether it is set counts
        }


def candidate(app: App, policy: handler.QueuePolicy, now: datetime) -> bool:
    """handler.CANDIDATE: the rule's upper tiers. A held app is none, by any rule."""
    if app.held:
        return False
    lease_ago = now - timedelta(minutes=policy.processing_timeout_minutes)
    if app.status == "queued":
        return True
    if app.status == "processing":
        expired = lease_expired(app.started, policy.processing_timeout_minutes, now)
        return expired and app.attempts < policy.max_lease_attempts
    if app.status == "failed" and not app.retryable:
        return False
    version = app.version or 0
    outdated = version < policy.analysis_version and app.analysed < lease_ago
    # A newer version than the current one is never stale: only a refusal could answer it.
    stale = version <= policy.analysis_version and app.analysed < now - timedelta(
        days=policy.stale_days
    )
    return outdated or stale


def due_retry(app: App, policy: handler.QueuePolicy, now: datetime) -> bool:
    """handler.RETRY_DUE: a retryable failure at the current version, not held, whose
    retry has come (RETRY_BACKOFF's streak-th step after it; none past the last step, nor
    with RETRY_BACKOFF=off)."""
    if app.held or app.status != "failed" or not app.retryable:
        return False
    if (app.version or 0) != policy.analysis_version:
        return False
    due = retry_time(app.streak, app.analysed, policy)
    return due is not None and due <= now


def claim_order(apps) -> list:
    return sorted(apps, key=lambda a: (-a.reviews, a.added, a.appid))


def next_claim(apps, policy: handler.QueuePolicy, now: datetime) -> App | None:
    """The app GET /queue hands out: the first candidate in claim order; only when there
    is none, the first due retry in claim order (the lowest tier). None: an empty answer.
    (The promoter, which each claim runs first, has flagged every due retry.)"""
    ready = claim_order(a for a in apps if candidate(a, policy, now))
    if ready:
        return ready[0]
    retries = claim_order(a for a in apps if due_retry(a, policy, now))
    return retries[0] if retries else None


def claimable_by_name(app: App, policy: handler.QueuePolicy, now: datetime) -> bool:
    """GET /queue?appId= hands the app out: a candidate, or a due retry (flagged or not)."""
    return candidate(app, policy, now) or due_retry(app, policy, now)


def streak_after(app: App, kind: str, version: int) -> int:
    """The failures in a row a result of `kind` at `version` leaves when it is stored:
    0 for a success; for a failure (the back-off's lease_expired one included) one more
    than the stored result's when that is a failure at the same version, else 1."""
    if kind == "success":
        return 0
    stored_failure = app.result is not None and app.result[0] != "success"
    return app.streak + 1 if stored_failure and (app.version or 0) == version else 1


def verdict(app: App, key: tuple, version: int, token: str | None, current: int) -> tuple:
    """The model's statement of the result rules: ("store", claim, verified), ("stored",),
    ("refuse",), or ("refuse", lease) for the open claim's holder's result refused as older
    than the stored one: the lease is "answered" (lease attempts back to 0; it runs out as
    leases do), or "ended" at once when the stored version is above the current one."""
    success = key[0] == "success"
    finished = app.status in ("analysed", "failed")
    # The states a result's first delivery leaves: finished, or queued again for the
    # refetch that waited for it (refetch_requested stays set until the next claim).
    left_by_a_result = finished or (app.status == "queued" and app.refetch_requested)
    same = app.result == key and app.version == version
    if same and left_by_a_result:
        return ("stored",)
    # The back-off's lease_expired failure is no analysis: never newer than a result.
    newer = app.result is not None and app.result[0] != "server" and app.version is not None
    newer = newer and app.version > version
    held = app.status == "processing"
    holders_refusal = ("refuse", "ended" if newer and app.version > current else "answered")
    if token is not None:
        if held and token == app.token:
            return holders_refusal if newer else ("store", app.token, True)
        if token == app.result_claim:
            if same:
                return ("stored",)
            stored_success = app.result is not None and app.result[0] == "success"
            replaceable = app.status != "processing" and not app.result_verified
            if replaceable and (success or not stored_success):
                return ("refuse",) if newer else ("store", app.result_claim, True)
        return ("refuse",)
    if newer:
        return holders_refusal if held else ("refuse",)
    if held:
        return ("store", app.token, False)
    # Queued by its result for the refetch that waited: as the finished app it was.
    queued_by_its_result = app.status == "queued" and app.refetch_requested
    if app.status == "queued" and not queued_by_its_result:
        return ("store", None, False)
    stored_failure = app.result is not None and app.result[0] != "success"
    if success and (app.status == "failed" or (queued_by_its_result and stored_failure)):
        return ("store", app.result_claim, False)
    return ("refuse",)


def judged(
    app, key: tuple, version: int, token: str | None, sender: str | None, current: int
) -> tuple:
    """verdict, then identity (docs/analysers.md): without a token, a named analyser's
    result (`sender`: its name; None for the shared password) counts only on its own
    claim, a shared-password one only while no named analyser holds the app. A result
    identity refuses changes nothing, a lease included."""
    judgement = verdict(app, key, version, token, current)
    if token is not None or judgement[0] == "stored" or judgement == ("refuse",):
        return judgement
    if judgement == ("refuse", "ended") and sender is None:
        # A tokenless shared-password result cannot show it is the holder's, so it does
        # not end the lease (the holder's token keeps working): nothing changes.
        return ("refuse",)
    leased = app.status == "processing"
    if sender is not None:
        allowed = leased and app.holder == sender
    else:
        allowed = not (leased and app.holder is not None)
    return judgement if allowed else ("refuse",)
