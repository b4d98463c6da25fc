"""The claim: each candidate class, the order, leases, concurrency, retries with
back-off, held apps, and the oracle.

The oracle is the queue's candidate rule (docs/queue.md) written out in Python
(helpers.oracle_order), evaluated on the rows themselves; whatever /queue hands out must
be the first candidate in its order, or, when there is none, the first due retry (the
lowest tier). Tests that move rows in time directly (instead of waiting) call
`time_passes()`, which is what the passing of PROMOTE_EVERY_SECONDS does in production.
"""

from __future__ import annotations

import random
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ANALYSER, configure_service, time_passes

import handler
from helpers import (
    OracleAtEachClaim,
    app_row,
    connect,
    database_at,
    days_ago,
    history,
    insert_app,
    minutes_ago,
    oracle_order,
    oracle_tiers,
    popularity,
    refetch_apps,
    run_together,
)

POLICY = handler.QueuePolicy()

# RETRY_BACKOFF among them: the default (1h,6h,24h), a short one, and off (the old rule).
SHORT_BACKOFF = (600, 7200)
POLICIES = [
    handler.QueuePolicy(),
    handler.QueuePolicy(analysis_version=5, stale_days=180, processing_timeout_minutes=120),
    handler.QueuePolicy(
        analysis_version=3,
        stale_days=60,
        processing_timeout_minutes=100,
        retry_backoff=SHORT_BACKOFF,
    ),
    handler.QueuePolicy(
        analysis_version=4, stale_days=365, processing_timeout_minutes=200, retry_backoff=()
    ),
    handler.QueuePolicy(retry_backoff=SHORT_BACKOFF),
    handler.QueuePolicy(retry_backoff=()),
]


def configure_policy(monkeypatch, policy: handler.QueuePolicy, **extra: str) -> None:
    """A new process of the service under `policy`."""
    configure_service(
        monkeypatch,
        handler.settings().database_url,
        CURRENT_ANALYSIS_VERSION=str(policy.analysis_version),
        STALE_ANALYSIS_DAYS=str(policy.stale_days),
        PROCESSING_TIMEOUT_MINUTES=str(policy.processing_timeout_minutes),
        RETRY_BACKOFF=policy.retry_backoff_text,
        **extra,
    )


def claim(client, appid=None):
    time_passes()
    path = "/queue" if appid is None else f"/queue?appId={appid}"
    answer = client.get(path, headers=ANALYSER)
    assert answer.status_code == 200
    return answer.text


# --- candidate classes --------------------------------------------------------------


def test_each_candidate_class(client, sql):
    insert_app(sql, "queued.app")
    insert_app(sql, "lease.expired", status="processing", processing_started=minutes_ago(121))
    insert_app(sql, "lease.live", status="processing", processing_started=minutes_ago(119))
    insert_app(sql, "analysed.oldversion", status="analysed", version=3, analysed=days_ago(1))
    insert_app(sql, "analysed.noversion", status="analysed", version=None, analysed=days_ago(1))
    insert_app(sql, "analysed.stale", status="analysed", version=4, analysed=days_ago(181))
    insert_app(sql, "analysed.fresh", status="analysed", version=4, analysed=days_ago(179))
    insert_app(sql, "analysed.newer", status="analysed", version=5, analysed=days_ago(1))
    insert_app(
        sql, "failed.retry.old", status="failed", retryable=True, version=3, analysed=days_ago(1)
    )
    insert_app(
        sql,
        "failed.retry.stale",
        status="failed",
        retryable=True,
        version=4,
        analysed=days_ago(200),
    )
    # A retryable failure at the current version: its first retry is an hour after it
    # (RETRY_BACKOFF's first step), in the lowest tier, whatever its popularity.
    insert_app(
        sql,
        "failed.retry.due",
        status="failed",
        retryable=True,
        version=4,
        analysed=days_ago(1),
        reviews="999999",
    )
    insert_app(
        sql,
        "failed.retry.waiting",
        status="failed",
        retryable=True,
        version=4,
        analysed=minutes_ago(50),
    )
    insert_app(  # its fourth failure in a row: past the last step, no retry
        sql,
        "failed.retry.spent",
        status="failed",
        retryable=True,
        version=4,
        analysed=days_ago(30),
        streak=4,
    )
    for appid in ("failed.final.old", "failed.final.flagged"):
        insert_app(sql, appid, status="failed", retryable=False, version=1, analysed=days_ago(900))
    # The retry gate holds whatever the promoter's flag says: a row flagged due (by a
    # promotion while it was retryable, or by another program) is judged by the rule.
    sql.run("UPDATE apps SET due = true WHERE appid = 'failed.final.flagged'")
    # Held by an operator: no candidate by any rule, however it would be one.
    insert_app(sql, "held.queued", held=True, reviews="999999")
    insert_app(sql, "held.stale", status="analysed", version=4, analysed=days_ago(400), held=True)
    insert_app(
        sql, "held.oldversion", status="analysed", version=3, analysed=days_ago(1), held=True
    )
    insert_app(
        sql,
        "held.retry",
        status="failed",
        retryable=True,
        version=4,
        analysed=days_ago(1),
        held=True,
    )
    handed_out = []
    while True:
        appid = claim(client)
        if not appid:
            break
        handed_out.append(appid)
    assert set(handed_out[:-1]) == {
        "queued.app",
        "lease.expired",
        "analysed.oldversion",
        "analysed.noversion",
        "analysed.stale",
        "failed.retry.old",
        "failed.retry.stale",
    }
    assert handed_out[-1] == "failed.retry.due"  # last: the lowest tier
    # Asked for by name (the exact app mode), no other app is a candidate either.
    others = sql.run(
        "SELECT appid FROM apps WHERE appid <> ALL(:handed_out) ORDER BY appid",
        handed_out=sorted(handed_out),
    )
    assert len(others) == 11
    for (appid,) in others:
        assert claim(client, appid) == "", appid


def test_popularity_then_age_then_bundle_id(client, sql):
    base = days_ago(10)
    insert_app(sql, "a.quiet", reviews="5", added=base)
    insert_app(sql, "b.junk", reviews="12k", added=base - timedelta(days=5))  # not digits: 0
    insert_app(sql, "c.loud", reviews="1000", added=base)
    insert_app(sql, "d.number", reviews=50, added=base)  # a JSON number counts too
    insert_app(sql, "e.huge", reviews="123456789012345678901234567890", added=base)
    insert_app(sql, "f.none", added=base - timedelta(days=1))
    insert_app(sql, "g.tie", reviews="5", added=base - timedelta(days=1))
    insert_app(sql, "h.tie", reviews="5", added=base - timedelta(days=1))
    order = [claim(client) for _ in range(8)]
    assert order == [
        "e.huge",
        "c.loud",
        "d.number",
        "g.tie",
        "h.tie",
        "a.quiet",
        "b.junk",
        "f.none",
    ]
    assert claim(client) == ""


def test_version_and_staleness_gate_on_retryable_failures(client, sql, monkeypatch):
    spent = len(POLICY.retry_backoff) + 1  # failed after its last retry too
    insert_app(
        sql,
        "failed.recent",
        status="failed",
        retryable=True,
        version=4,
        analysed=days_ago(3),
        streak=spent,
    )
    assert claim(client) == ""  # a persistently failing app is not retried in a loop
    configure_service(
        monkeypatch, client.app and handler.settings().database_url, CURRENT_ANALYSIS_VERSION="5"
    )
    assert claim(client) == "failed.recent"  # a new analyser version retries it


def test_staleness_window_follows_the_setting(client, sql, monkeypatch):
    insert_app(sql, "analysed.app", status="analysed", version=4, analysed=days_ago(40))
    assert claim(client) == ""
    configure_service(monkeypatch, handler.settings().database_url, STALE_ANALYSIS_DAYS="30")
    assert claim(client) == "analysed.app"


def test_longer_staleness_window_unflags_promoted_rows(client, sql, monkeypatch):
    url = handler.settings().database_url
    insert_app(sql, "analysed.app", status="analysed", version=4, analysed=days_ago(40))
    configure_service(monkeypatch, url, STALE_ANALYSIS_DAYS="30")
    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    assert app_row(sql, "analysed.app")["due"] is True
    configure_service(monkeypatch, url, STALE_ANALYSIS_DAYS="60")
    assert claim(client) == ""
    assert app_row(sql, "analysed.app")["due"] is False


def test_rows_flagged_ahead_of_time_are_not_handed_out_early(client, sql):
    almost = datetime.now(UTC) - timedelta(days=180) + timedelta(seconds=30)
    insert_app(sql, "almost.stale", status="analysed", version=4, analysed=almost)
    insert_app(
        sql,
        "almost.expired",
        status="processing",
        processing_started=minutes_ago(120) + timedelta(seconds=30),
    )
    assert claim(client) == ""
    assert app_row(sql, "almost.stale")["due"] is True  # within the promotion horizon


def test_lease_expiry_hands_the_app_out_again(client, sql):
    insert_app(sql, "com.example.app")
    assert claim(client) == "com.example.app"
    assert claim(client) == ""
    sql.run("UPDATE apps SET processing_started = now() - interval '121 minutes'")
    assert claim(client) == "com.example.app"
    assert app_row(sql, "com.example.app")["processing_started"] > minutes_ago(1)


def test_lease_timeout_follows_the_setting(client, sql, monkeypatch):
    insert_app(sql, "com.example.app", status="processing", processing_started=minutes_ago(30))
    assert claim(client) == ""
    configure_service(monkeypatch, handler.settings().database_url, PROCESSING_TIMEOUT_MINUTES="20")
    assert claim(client) == "com.example.app"


def test_the_lock_keeps_the_last_result_visible(client, sql):
    analysis = {"success": True, "trackers": {"Facebook SDK": "Meta"}}
    insert_app(
        sql,
        "com.example.app",
        status="analysed",
        version=3,
        analysed=days_ago(2),
        analysis=analysis,
    )
    assert claim(client) == "com.example.app"
    row = app_row(sql, "com.example.app")
    assert row["status"] == "processing"
    assert row["analysis"] == analysis
    assert row["analysisversion"] == 3
    view = client.get("/apps/com.example.app").json()
    assert view["status"] == "processing"
    assert view["analysis"] == analysis


def test_32_concurrent_claimers_never_share_an_app(database_url, sql):
    for n in range(200):
        insert_app(sql, f"app.{n:03d}", reviews=str(random.randint(0, 50)))
    for n in range(20):
        insert_app(sql, f"old.{n:03d}", status="analysed", version=2, analysed=days_ago(1))
    results: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(32)

    def analyser():
        db = database_at(database_url)
        start.wait()
        try:
            while True:
                claimed = handler.claim_next_app(db, POLICY)
                if claimed is None:
                    return
                with lock:
                    results.append(claimed[0])
        except BaseException as error:  # asserted in the test's own thread
            errors.append(error)
        finally:
            db.discard()

    run_together([analyser] * 32, timeout=60)
    assert errors == []
    assert len(results) == 220
    assert len(set(results)) == 220
    assert sql.run("SELECT count(*) FROM apps WHERE status = 'processing'") == [[220]]


# --- what a claim locks --------------------------------------------------------------


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    promoted=st.booleans(),
    policy=st.sampled_from(range(len(POLICIES))),
)
def test_a_claim_locks_no_row_that_cannot_win(database_url, sql, seed, promoted, policy):
    """A claim locks the first queued or flagged candidate (`head`) and, of the other
    sources (old versions, unflagged leases and stale analyses), only rows at least as
    popular as that head: a less popular one loses to it anyway, and each lock is a write.
    It locks no due retry while a candidate exists (the lowest tier is read only when no
    other candidate is), and then only the retry it hands out: the first one the
    promoter flagged. The claim runs in an open transaction, so its locks can be seen
    from another connection; every state is drawn, flagged by the promoter or not (and
    with retry flags the rule does not back), under each RETRY_BACKOFF."""
    sql.run("DELETE FROM apps")
    rng = random.Random(seed)
    random_state(sql, rng, size=rng.randint(5, 60))
    rule = POLICIES[policy]
    if promoted:
        promoter = database_at(database_url)
        handler.promote_due_apps(promoter, rule, force=True)
        promoter.discard()
    # The claim runs no promotion here: it hands out only the retries flagged already.
    candidates, retries = oracle_tiers(sql, rule, flagged_only=True)
    order = candidates + retries
    rows = {
        r[0]: r[1:] for r in sql.run("SELECT appid, details, status = 'queued' OR due FROM apps")
    }
    head = next((appid for appid in candidates if rows[appid][1]), None)  # queued or flagged
    claimer = connect(database_url)
    try:
        claimer.run("BEGIN")
        claimed = claimer.run(
            handler.CLAIM_NEXT_APP, token=uuid.uuid4(), analyser=None, **rule.sql_params()
        )
        free = {r[0] for r in sql.run("SELECT appid FROM apps FOR UPDATE SKIP LOCKED")}
    finally:
        claimer.run("ROLLBACK")
        claimer.close()
    locked = set(rows) - free
    assert [r[0] for r in claimed] == order[:1]
    assert locked <= set(order)  # only candidates
    if candidates:
        assert locked <= set(candidates)  # no retry while a candidate exists
    else:
        assert locked == set(retries[:1])
    if head is not None:
        bar = popularity(rows[head][0])
        less_popular = {a for a in locked - {head} if popularity(rows[a][0]) < bar}
        assert less_popular == set(), (head, bar, order[:5])


# --- the oracle property ------------------------------------------------------------


def random_state(sql, rng: random.Random, size: int) -> None:
    """A random mix of every state, with ages well clear of the cutoffs so that the few
    milliseconds between the oracle's now() and the claim's cannot matter: failures with
    0 to 4 failures in a row, some of them hours old (around RETRY_BACKOFF's steps, in
    POLICIES), a few apps held, and retry flags on a few rows whether the rule backs
    them or not (another program's, or a previous setting's)."""
    base = datetime.now(UTC) - timedelta(days=1000)
    for n in range(size):
        appid = f"app{n:03d}.{rng.choice(['x', 'y', 'z'])}"
        added = base + timedelta(days=rng.uniform(0, 900))
        reviews = rng.choice(
            [
                None,
                "0",
                "7",
                str(rng.randint(0, 10)),
                str(rng.randint(0, 10**6)),
                rng.randint(0, 100),
                "n/a",
                "12,000",
            ]
        )
        status = rng.choice(["queued", "processing", "analysed", "analysed", "failed"])
        kwargs = {"reviews": reviews, "added": added}
        if status == "processing":
            # None: a legacy lock without a start time (it counts as expired)
            minutes = rng.choice([None, 5, 60, 110, 130, 300, 5000])
            kwargs["processing_started"] = None if minutes is None else minutes_ago(minutes)
        if status in ("analysed", "failed"):
            # None and negative versions: legacy values the service never writes
            kwargs["version"] = rng.choice([None, -3, -1, 0, 1, 2, 3, 4, 4, 4, 5])
            kwargs["analysed"] = days_ago(rng.choice([1, 30, 100, 170, 190, 400]))
        if status == "failed":
            kwargs["retryable"] = rng.random() < 0.6
            kwargs["streak"] = rng.choice([0, 1, 1, 2, 3, 4])
            if rng.random() < 0.5:  # between the steps of RETRY_BACKOFF (POLICIES)
                kwargs["analysed"] = minutes_ago(60 * rng.choice([0.25, 0.5, 3, 12, 30]))
        kwargs["held"] = rng.random() < 0.1
        kwargs["retry_due"] = rng.random() < (0.3 if status == "failed" else 0.05)
        insert_app(sql, appid, status=status, **kwargs)


@pytest.mark.parametrize("seed", range(12))
def test_oracle_on_random_states(client, sql, monkeypatch, seed):
    rng = random.Random(seed)
    size = rng.randint(5, 60)
    random_state(sql, rng, size=size)
    # Several runs of the service, each with a policy drawn at random (a policy may change
    # between two runs), each claiming a few apps, or until nothing is left (the due
    # retries last), and checking every one. Each claim's promotion flags every due
    # retry, so the oracle read before it counts them all.
    for _ in range(3):
        policy = rng.choice(POLICIES)
        configure_policy(monkeypatch, policy)
        claims = rng.randint(1, 8) if rng.random() < 0.6 else size + 1
        for _ in range(claims):
            expected = oracle_order(sql, policy)
            got = claim(client)
            assert got == (expected[0] if expected else ""), (policy, expected[:3])
            if got and rng.random() < 0.3:  # sometimes the lease runs out
                sql.run(
                    "UPDATE apps SET processing_started = now() - interval '1 day'"
                    " WHERE appid = :appid",
                    appid=got,
                )


def test_rows_falling_due_while_the_service_runs_are_claimed_without_a_new_promotion(client, sql):
    """The promoter runs at most every 15 s; what falls due in between was flagged ahead
    (the horizon), so the next claim finds it on time."""
    soon = datetime.now(UTC) + timedelta(seconds=3)
    insert_app(sql, "stale.soon", status="analysed", version=4, analysed=soon - timedelta(days=180))
    insert_app(
        sql, "lease.soon", status="processing", processing_started=soon - timedelta(minutes=120)
    )
    assert claim(client) == ""  # promotes now, both flagged ahead of time
    # Four seconds pass: the rows' times move back by four seconds, which is the same to
    # the rule as the clock moving on, without the test waiting on the wall clock.
    sql.run(
        """UPDATE apps SET analysed = analysed - interval '4 seconds',
                          processing_started = processing_started - interval '4 seconds'"""
    )
    # No time_passes(): the promotion memo still says "just ran".
    got = {client.get("/queue", headers=ANALYSER).text for _ in range(2)}
    assert got == {"stale.soon", "lease.soon"}


def test_rows_due_that_the_promoter_has_not_flagged_are_claimed(client, sql):
    """Between two runs of the promoter, a row can be due without its flag: an expired
    lease or a stale analysis written by someone else (the old release, an operator). The
    claim reads the unflagged heads too (lease_heads, stale_heads), in claim order."""
    assert claim(client) == ""  # the promoter has just run; its memo says so
    insert_app(
        sql, "lease.unflagged", status="processing", reviews=5, processing_started=minutes_ago(300)
    )
    insert_app(
        sql, "stale.unflagged", status="analysed", version=4, reviews=9, analysed=days_ago(400)
    )
    insert_app(sql, "queued.less", reviews=1)
    flags = sql.run("SELECT appid, due FROM apps ORDER BY appid")
    assert flags == [["lease.unflagged", False], ["queued.less", False], ["stale.unflagged", False]]
    # No time_passes(): these claims run without a promotion.
    got = [client.get("/queue", headers=ANALYSER).text for _ in range(4)]
    assert got == ["stale.unflagged", "lease.unflagged", "queued.less", ""]
    assert sql.run("SELECT count(*) FROM apps WHERE due") == [[0]]


# Seconds past the staleness cutoff: on the cutoff's own day (UTC) unless the cutoff falls
# within that many seconds of midnight, hours past it maybe the day before.
@pytest.mark.parametrize("past_cutoff", [5, 600, 6 * 3600])
def test_a_stale_analysis_from_the_cutoffs_own_day_is_claimed_before_it_is_flagged(
    client, sql, past_cutoff
):
    """The claim reads unflagged stale analyses day by day (stale_days), each day up to
    the cutoff's, and on the cutoff's own day only the rows past it: one such row, written
    after the promoter's last run, is handed out in claim order, and its neighbour a
    minute short of the cutoff is not."""
    assert claim(client) == ""  # the promoter has just run; its memo says so
    for appid, seconds in (("stale.cutoff", past_cutoff), ("fresh.cutoff", -60)):
        sql.run(
            """INSERT INTO apps (appid, details, status, analysis, analysisversion, analysed)
               VALUES (:appid, '{"reviews": "50"}', 'analysed', '{"success": true}', 4,
                       now() - make_interval(days => 180, secs => :seconds))""",
            appid=appid,
            seconds=seconds,
        )
    insert_app(sql, "queued.less", reviews=1)
    # No time_passes(): these claims run without a promotion.
    got = [client.get("/queue", headers=ANALYSER).text for _ in range(3)]
    assert got == ["stale.cutoff", "queued.less", ""]
    assert sql.run("SELECT count(*) FROM apps WHERE due") == [[0]]


# --- promotion behind: after a policy change, flagging takes many requests ------------

UNFLAGGED_STALE = """
SELECT count(*) FROM apps
WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
  AND COALESCE(analysisversion, 0) <= :version
  AND COALESCE(analysed, '-infinity') < now() - make_interval(days => :days)
"""


def test_a_call_whose_budget_fits_one_batch_still_flags_stale_rows(database_url, sql, monkeypatch):
    """The first batch that does work always runs: an expired-leases batch that finds
    nothing does not use that up, or on a slow machine stale rows would never be flagged."""
    monkeypatch.setattr(handler, "PROMOTION_BATCH", 7)
    db = handler.api_connection()
    handler.promote_due_apps(db, POLICY, force=True)  # the policy is recorded: no clearing
    for n in range(20):
        insert_app(sql, f"stale{n:02d}.app", status="analysed", version=4, analysed=days_ago(400))
    for expected, left in ((7, 13), (7, 6), (6, 0)):
        promotion = handler.promote_due_apps(db, POLICY, budget_seconds=0, force=True)
        assert (promotion.leases, promotion.stale) == (0, expected)  # one batch, never none
        assert sql.run(
            UNFLAGGED_STALE, days=POLICY.stale_days, version=POLICY.analysis_version
        ) == [[left]]


def test_claims_follow_the_oracle_while_promotion_is_partial(client, sql, monkeypatch):
    """STALE_ANALYSIS_DAYS lowered over many analyses, then raised again: the promoter
    flags (then clears) a small batch per claim, and every claim meanwhile is still the
    oracle's first candidate (read as the claim sees the rows, after its promotion:
    OracleAtEachClaim, so a due retry counts once the promoter has flagged it). Progress
    is in the database, so a new process goes on."""
    monkeypatch.setattr(handler, "PROMOTION_BATCH", 7)
    oracle = OracleAtEachClaim(sql, monkeypatch)
    rng = random.Random(7)
    for n in range(120):
        insert_app(
            sql,
            f"analysed{n:03d}.app",
            status=rng.choice(["analysed", "analysed", "failed"]),
            retryable=True,
            reviews=rng.randint(0, 500),
            version=rng.choice([3, 4, 4, 4]),
            analysed=days_ago(rng.uniform(30, 170)),
        )
    for n in range(15):
        insert_app(sql, f"queued{n:02d}.app", reviews=rng.randint(0, 500))
    url = handler.settings().database_url

    def run_claims(policy: handler.QueuePolicy, count: int) -> list[int]:
        configure_service(
            monkeypatch, url, STALE_ANALYSIS_DAYS=str(policy.stale_days), PROMOTION_BUDGET_MS="1"
        )
        unflagged = []
        for _ in range(count):
            got = claim(client)
            expected = oracle.expected()
            assert got == (expected[0] if expected else ""), policy
            ((left,),) = sql.run(
                UNFLAGGED_STALE, days=policy.stale_days, version=policy.analysis_version
            )
            unflagged.append(left)
        return unflagged

    run_claims(POLICY, 2)
    lowered = handler.QueuePolicy(stale_days=20)
    left = run_claims(lowered, 6)
    assert left[0] > 0  # the claims above ran while promotion was partial
    assert left == sorted(left, reverse=True)
    handler.runtime().close()  # a new process: what was flagged stays flagged
    ((after_restart,),) = sql.run(UNFLAGGED_STALE, days=20, version=lowered.analysis_version)
    assert after_restart == left[-1]
    # Each claim runs at least one batch of 7 (more when the machine is fast): clearing
    # walks the 135 apps in 20 batches, flagging takes at most 20 more, so 60 claims
    # finish it however slow the machine (20 did not when a 1 ms budget fit one batch).
    left = run_claims(lowered, 60)
    assert left[-1] == 0
    ((flagged,),) = sql.run("SELECT count(*) FROM apps WHERE due")
    assert flagged > handler.PROMOTION_BATCH
    run_claims(POLICY, 12)  # raised again: flags are cleared in batches, claims exact


def test_due_retries_follow_the_oracle_while_promotion_is_partial(client, sql, monkeypatch):
    """RETRY_BACKOFF set, changed and turned off over many retryable failures, with a
    small promotion batch and budget: the promoter flags the due retries a batch per
    claim, and under a new setting first clears the old setting's flags a batch per
    claim. Every claim meanwhile is the oracle's first as the claim sees the flags
    (OracleAtEachClaim): a candidate while one is left, then the first flagged due retry
    in claim order, never an unflagged one, nor one an old setting flagged that the new
    one does not back. Once promotion is done, every due retry is flagged."""
    monkeypatch.setattr(handler, "PROMOTION_BATCH", 7)
    oracle = OracleAtEachClaim(sql, monkeypatch)
    rng = random.Random(11)
    for n in range(300):
        insert_app(
            sql,
            f"failing{n:03d}.app",
            status="failed",
            retryable=True,
            version=4,
            reviews=rng.randint(0, 500),
            streak=rng.choice([1, 1, 2, 2, 3, 4]),
            # between the steps of 1h,6h,24h and of SHORT_BACKOFF (10m,2h)
            analysed=minutes_ago(60 * rng.choice([0.5, 1.5, 4, 8, 20, 30])),
        )
    for n in range(3):
        insert_app(sql, f"queued{n}.app", reviews=rng.randint(0, 500))

    def run_claims(policy: handler.QueuePolicy, count: int) -> list[tuple[str, int]]:
        """`count` claims, each checked: (what each handed out, how many due retries
        were not flagged yet once it was done)."""
        configure_policy(monkeypatch, policy, PROMOTION_BUDGET_MS="1")
        seen = []
        for _ in range(count):
            got = claim(client)
            expected = oracle.expected()
            assert got == (expected[0] if expected else ""), policy
            due = set(oracle_tiers(sql, policy)[1])
            flagged = set(oracle_tiers(sql, policy, flagged_only=True)[1])
            seen.append((got, len(due - flagged)))
        return seen

    def retried(seen: list[tuple[str, int]]) -> list[str]:
        return [got for got, _ in seen if got.startswith("failing")]

    first = run_claims(POLICY, 40)
    assert {got for got, _ in first[:3]} == {f"queued{n}.app" for n in range(3)}
    # Due retries were handed out while others still waited for their flag, and by the
    # end every due retry was flagged.
    assert any(got.startswith("failing") and unseen for got, unseen in first)
    assert first[-1][1] == 0
    second = run_claims(handler.QueuePolicy(retry_backoff=SHORT_BACKOFF), 70)
    assert second[0][1] > 0  # the old flags go first, a batch per claim
    assert retried(second) and second[-1][1] == 0
    third = run_claims(handler.QueuePolicy(retry_backoff=()), 30)
    assert [got for got, _ in third] == [""] * 30  # no retry, flagged or not
    assert sql.run("SELECT count(*) FROM apps WHERE retry_due") == [[0]]
    assert len(set(retried(first) + retried(second))) == len(retried(first) + retried(second))


# --- retries with back-off: failures in a row, the lowest tier ------------------------


def claim_with_token(client, appid: str | None = None) -> tuple[str, str | None]:
    """A claim after time passes (as claim()): (the app handed out, its claim token)."""
    time_passes()
    path = "/queue" if appid is None else f"/queue?appId={appid}"
    answer = client.get(path, headers=ANALYSER)
    assert answer.status_code == 200
    return answer.text, answer.headers.get("x-analysis-claim-token")


def report_failure(client, sql, appid: str, token: str | None, version: int = 4) -> int:
    """A retryable failure (a USB error) reported with the claim's token: the failures
    in a row stored after it."""
    headers = {**ANALYSER, "Content-Type": "text/plain"}
    if token is not None:
        headers["X-Analysis-Claim-Token"] = token
    answer = client.post(
        f"/reportAnalysisFailure?appId={appid}&analysisVersion={version}",
        content=b"usb disconnected",
        headers=headers,
    )
    assert answer.status_code == 200, answer.text
    row = app_row(sql, appid)
    assert (row["status"], row["failure_retryable"], row["retry_due"]) == ("failed", True, False)
    return row["failure_streak"]


def upload_success(client, sql, appid: str, token: str) -> int:
    """A success uploaded with the claim's token: the failures in a row after it."""
    answer = client.post(
        f"/uploadAnalysis?appId={appid}&analysisVersion=4",
        json={"success": True},
        headers={**ANALYSER, "X-Analysis-Claim-Token": token},
    )
    assert answer.status_code == 200, answer.text
    assert app_row(sql, appid)["status"] == "analysed"
    return app_row(sql, appid)["failure_streak"]


def fail_by_name(client, sql, appid: str, version: int = 4) -> int:
    """The app claimed by name (it must be handed out) and failed: its failures in a row."""
    got, token = claim_with_token(client, appid)
    assert got == appid
    return report_failure(client, sql, appid, token, version)


def age(sql, appid: str, seconds: float) -> None:
    """The app's stored result `seconds` older (the clock moved on, as far as the rule
    can tell)."""
    sql.run(
        "UPDATE apps SET analysed = analysed"
        " - make_interval(secs => CAST(:s AS double precision)) WHERE appid = :a",
        s=seconds,
        a=appid,
    )


def expire_lease(sql, appid: str) -> None:
    sql.run(
        "UPDATE apps SET processing_started = processing_started - interval '121 minutes'"
        " WHERE appid = :a",
        a=appid,
    )


@pytest.mark.parametrize("backoff", [POLICY.retry_backoff, SHORT_BACKOFF], ids=["default", "short"])
def test_the_nth_failure_in_a_row_waits_the_nth_step(client, sql, monkeypatch, backoff):
    """Each retryable failure in a row waits RETRY_BACKOFF's next step: five minutes short
    of it the app is no candidate (by name either), five minutes past it the next claim
    hands it out. After the failure that follows the last retry there is no retry,
    however long it waits, until its result is stale."""
    policy = handler.QueuePolicy(retry_backoff=backoff)
    configure_policy(monkeypatch, policy)
    insert_app(sql, "flaky.app")
    insert_app(sql, "done.app", status="analysed", version=4, analysed=days_ago(1))
    got, token = claim_with_token(client)
    assert got == "flaky.app"
    for n, step in enumerate(backoff, start=1):
        assert report_failure(client, sql, "flaky.app", token) == n
        age(sql, "flaky.app", step - 300)
        assert (claim(client), claim(client, "flaky.app")) == ("", "")
        age(sql, "flaky.app", 600)
        got, token = claim_with_token(client)
        assert got == "flaky.app"
    assert report_failure(client, sql, "flaky.app", token) == len(backoff) + 1
    age(sql, "flaky.app", 170 * 86400)
    assert (claim(client), claim(client, "flaky.app")) == ("", "")
    age(sql, "flaky.app", 11 * 86400)  # past STALE_ANALYSIS_DAYS (180)
    assert claim(client) == "flaky.app"


def test_past_the_last_step_a_version_bump_retries_and_counts_anew(client, sql, monkeypatch):
    """A failure past RETRY_BACKOFF's last step waits for a version bump; the first
    failure at the new version is the first in a row again, and waits the first step."""
    insert_app(
        sql,
        "spent.app",
        status="failed",
        retryable=True,
        version=4,
        analysed=days_ago(10),
        streak=4,
    )
    assert (claim(client), claim(client, "spent.app")) == ("", "")
    configure_policy(monkeypatch, handler.QueuePolicy(analysis_version=5))
    got, token = claim_with_token(client)
    assert got == "spent.app"  # an outdated version, a candidate
    assert report_failure(client, sql, "spent.app", token, version=5) == 1
    age(sql, "spent.app", 3600 - 300)
    assert claim(client) == ""
    age(sql, "spent.app", 600)
    assert claim(client) == "spent.app"


def test_a_failure_of_another_version_starts_at_one(client, sql):
    """Failures in a row are counted at one analysis version: a failure sent at a newer
    analysisVersion (an analyser upgraded before the setting) is the first of its own."""
    insert_app(
        sql, "flaky.app", status="failed", retryable=True, version=4, analysed=days_ago(1), streak=2
    )
    got, token = claim_with_token(client)
    assert got == "flaky.app"
    assert report_failure(client, sql, "flaky.app", token, version=5) == 1


def test_a_success_ends_the_failures_in_a_row(client, sql):
    """A success sets the count to 0: the next failure is the first again, retried after
    RETRY_BACKOFF's first step, not after the step its earlier failures had reached."""
    insert_app(
        sql, "flaky.app", status="failed", retryable=True, version=4, analysed=days_ago(2), streak=2
    )
    got, token = claim_with_token(client)
    assert got == "flaky.app"
    assert upload_success(client, sql, "flaky.app", token) == 0
    refetch_apps(handler.api_connection(), ["flaky.app"])
    assert fail_by_name(client, sql, "flaky.app") == 1
    age(sql, "flaky.app", 3600 + 300)
    assert claim(client) == "flaky.app"


@pytest.mark.parametrize("refetch", ["applied", "waits for the lease", "breaks the lease"])
def test_a_refetch_ends_the_failures_in_a_row(client, sql, refetch):
    """An operator's refetch sets the count to 0, whether it queues the app at once, waits
    for the lease (and the lease's result queues it), or breaks the lease (--force): the
    next failure is the first in a row again."""
    insert_app(
        sql, "flaky.app", status="failed", retryable=True, version=4, analysed=days_ago(2), streak=3
    )
    if refetch == "applied":
        refetch_apps(handler.api_connection(), ["flaky.app"])
    else:
        got, token = claim_with_token(client)  # its third retry, due
        assert got == "flaky.app"
        refetch_apps(handler.api_connection(), ["flaky.app"], force=refetch == "breaks the lease")
        if refetch == "waits for the lease":
            headers = {**ANALYSER, "Content-Type": "text/plain", "X-Analysis-Claim-Token": token}
            answer = client.post(
                "/reportAnalysisFailure?appId=flaky.app&analysisVersion=4",
                content=b"usb disconnected",
                headers=headers,
            )
            assert answer.status_code == 200, answer.text
    row = app_row(sql, "flaky.app")
    assert (row["status"], row["failure_streak"]) == ("queued", 0)
    assert fail_by_name(client, sql, "flaky.app") == 1


def test_the_back_offs_lease_expired_failure_counts_in_the_row(client, sql):
    """A retry whose leases keep expiring backs off with the promoter's lease_expired
    failure: one more failure in a row, so the next retry waits the next step."""
    insert_app(sql, "hanging.app", status="failed", retryable=True, version=4, analysed=days_ago(1))
    assert claim(client) == "hanging.app"  # its first retry
    for _ in range(POLICY.max_lease_attempts - 1):
        expire_lease(sql, "hanging.app")
        assert claim(client) == "hanging.app"
    expire_lease(sql, "hanging.app")
    assert claim(client) == ""  # the promotion backs it off
    row = app_row(sql, "hanging.app")
    assert (row["status"], row["failure_reason"], row["failure_streak"]) == (
        "failed",
        "lease_expired",
        2,
    )
    age(sql, "hanging.app", POLICY.retry_backoff[1] - 300)
    assert claim(client) == ""
    age(sql, "hanging.app", 600)
    assert claim(client) == "hanging.app"


def test_retry_backoff_off_retries_nothing_before_staleness_or_a_bump(client, sql, monkeypatch):
    """RETRY_BACKOFF=off is the rule as it was: a retryable failure at the current
    version waits for the staleness window or a version bump, whatever its count."""
    configure_policy(monkeypatch, handler.QueuePolicy(retry_backoff=()))
    for n in (1, 2, 3):
        insert_app(
            sql,
            f"failed{n}.app",
            status="failed",
            retryable=True,
            version=4,
            analysed=days_ago(100),
            streak=n,
        )
    assert [claim(client, f"failed{n}.app") for n in (1, 2, 3)] == ["", "", ""]
    assert claim(client) == ""
    configure_policy(monkeypatch, handler.QueuePolicy(analysis_version=5, retry_backoff=()))
    assert {claim(client) for _ in range(3)} == {"failed1.app", "failed2.app", "failed3.app"}


def test_a_due_retry_is_handed_out_only_when_nothing_else_is(client, sql):
    """However popular, a due retry comes after every other candidate (an expired lease,
    an outdated or stale analysis, a queued app), and due retries among themselves in
    claim order. Asked for by name, a due retry is handed out at once."""
    for appid, reviews in (("retry.top", 10**6), ("retry.mid", 50), ("retry.named", 10**7)):
        insert_app(
            sql,
            appid,
            status="failed",
            retryable=True,
            version=4,
            analysed=days_ago(3),
            reviews=reviews,
        )
    insert_app(sql, "queued.app", reviews=1)
    insert_app(sql, "stale.app", status="analysed", version=4, analysed=days_ago(400), reviews=5)
    insert_app(sql, "old.app", status="analysed", version=3, analysed=days_ago(1), reviews=3)
    insert_app(
        sql, "lease.app", status="processing", processing_started=minutes_ago(300), reviews=2
    )
    assert claim(client, "retry.named") == "retry.named"
    got = [claim(client) for _ in range(7)]
    assert got == ["stale.app", "old.app", "lease.app", "queued.app", "retry.top", "retry.mid", ""]


def test_a_due_retry_waits_for_the_promoters_flag(client, sql):
    """GET /queue hands out a due retry only once the promoter has flagged it (retry_due);
    by name it needs no flag. A retry falling due within the promoter's horizon is
    flagged ahead, and handed out once due without a new promotion."""
    assert claim(client) == ""  # the promoter has just run; its memo says so
    for appid in ("retry.a", "retry.b"):
        insert_app(sql, appid, status="failed", retryable=True, version=4, analysed=days_ago(1))
    soon = datetime.now(UTC) - timedelta(hours=1) + timedelta(seconds=20)
    insert_app(sql, "retry.soon", status="failed", retryable=True, version=4, analysed=soon)
    # No time_passes(): these claims run without a promotion.
    assert client.get("/queue", headers=ANALYSER).text == ""
    assert client.get("/queue?appId=retry.b", headers=ANALYSER).text == "retry.b"
    assert claim(client) == "retry.a"  # promoted
    assert app_row(sql, "retry.soon")["retry_due"] is True  # within the horizon
    assert client.get("/queue", headers=ANALYSER).text == ""  # flagged, not due yet
    age(sql, "retry.soon", 30)
    assert client.get("/queue", headers=ANALYSER).text == "retry.soon"
    assert sql.run("SELECT count(*) FROM apps WHERE retry_due") == [[0]]


def test_retry_flags_the_rule_does_not_back_hand_out_nothing(client, sql):
    """A retry flag left on a row the rule does not make a due retry (another program's,
    or set before the row changed) is bookkeeping: the claim re-checks the rule."""
    flagged = {
        "waiting.app": {"analysed": minutes_ago(30)},
        "spent.app": {"analysed": days_ago(2), "streak": 4},
        "recent.app": {"analysed": minutes_ago(30), "streak": 0},
        "final.app": {"analysed": days_ago(2), "retryable": False, "reason": "paid_app"},
        "newer.app": {"analysed": days_ago(2), "version": 5},
        "held.app": {"analysed": days_ago(2), "held": True},
    }
    for appid, state in flagged.items():
        insert_app(
            sql,
            appid,
            status="failed",
            retry_due=True,
            **{"retryable": True, "version": 4, **state},
        )
    insert_app(sql, "analysed.app", status="analysed", version=4, analysed=days_ago(2))
    sql.run("UPDATE apps SET retry_due = true WHERE appid = 'analysed.app'")
    assert client.get("/queue", headers=ANALYSER).text == ""  # no promotion
    assert claim(client) == ""
    assert [claim(client, appid) for appid in sorted(flagged)] == [""] * len(flagged)


def test_a_new_retry_backoff_clears_the_old_flags(client, sql, monkeypatch):
    """Under a new RETRY_BACKOFF the promoter clears the retry flags the old one set and
    flags what the new one backs: off hands out nothing, a longer first step waits."""
    insert_app(
        sql, "flaky.app", status="failed", retryable=True, version=4, analysed=minutes_ago(120)
    )
    handler.promote_due_apps(handler.api_connection(), POLICY, force=True)
    assert app_row(sql, "flaky.app")["retry_due"] is True
    for backoff in ((), (3 * 3600,)):  # off; a first step longer than its two hours
        configure_policy(monkeypatch, handler.QueuePolicy(retry_backoff=backoff))
        assert claim(client) == ""
        assert app_row(sql, "flaky.app")["retry_due"] is False
    configure_policy(monkeypatch, handler.QueuePolicy(retry_backoff=(3600,)))
    assert claim(client) == "flaky.app"


HELD_STATES = {
    "queued": {},
    "expired lease": {"status": "processing", "processing_started": minutes_ago(300)},
    "outdated version": {"status": "analysed", "version": 3, "analysed": days_ago(1)},
    "stale": {"status": "analysed", "version": 4, "analysed": days_ago(400)},
    "due retry": {"status": "failed", "retryable": True, "version": 4, "analysed": days_ago(2)},
}


@pytest.mark.parametrize("state", HELD_STATES)
def test_a_held_app_is_never_handed_out(client, sql, state):
    """An operator's hold (held_at): the app is no candidate and no retry, by any rule,
    for the next claim (with a promotion or without) or by name, however popular; once
    released, it is handed out again."""
    insert_app(sql, "held.app", reviews=10**6, held=True, **HELD_STATES[state])
    insert_app(sql, "other.app", reviews=1)
    assert claim(client) == "other.app"
    assert client.get("/queue", headers=ANALYSER).text == ""  # no promotion
    assert claim(client) == ""
    assert claim(client, "held.app") == ""
    sql.run("UPDATE apps SET held_at = NULL WHERE appid = 'held.app'")
    assert claim(client) == "held.app"


def test_a_held_stale_app_leaves_queue_positions_exact(client, sql):
    """A held app is never flagged due (the promoter passes it by), so a held stale
    analysis is no sign that the promoter is behind: the queued apps' positions stay
    exact."""
    insert_app(sql, "held.stale", status="analysed", version=4, analysed=days_ago(400), held=True)
    insert_app(sql, "queued.app", reviews=1)
    assert claim(client) == "queued.app"  # promotes
    insert_app(sql, "next.app")
    assert positions(client, ["next.app"])["next.app"] == {
        "queuePosition": 1,
        "queuePositionExact": True,
    }


def test_a_held_apps_expired_lease_goes_back_to_its_result(client, sql):
    """An app held during its lease: when the lease expires the promoter gives it back its
    stored result, recording no failure (its count unchanged); released, it is
    handed out again by the rule."""
    insert_app(sql, "old.app", status="analysed", version=3, analysed=days_ago(1))
    assert claim(client) == "old.app"
    sql.run("UPDATE apps SET held_at = now() WHERE appid = 'old.app'")
    expire_lease(sql, "old.app")
    assert claim(client) == ""
    row = app_row(sql, "old.app")
    assert (row["status"], row["analysisversion"], row["failure_streak"]) == ("analysed", 3, 0)
    assert history(sql, "old.app") == []
    sql.run("UPDATE apps SET held_at = NULL WHERE appid = 'old.app'")
    assert claim(client) == "old.app"


# --- the public queue position ------------------------------------------------------------


def positions(client, appids: list[str]) -> dict[str, dict]:
    answers = {appid: client.get(f"/apps/{appid}").json() for appid in appids}
    return {
        a: {k: v for k, v in view.items() if k.startswith("queuePosition")}
        for a, view in answers.items()
    }


@pytest.mark.parametrize("seed", range(6))
def test_queue_positions_match_the_oracle(client, sql, seed):
    """A queued app's position counts the candidates ahead of it (held apps, never
    handed out, are not ahead of anyone). A held app's own position is not checked."""
    rng = random.Random(seed)
    random_state(sql, rng, size=rng.randint(5, 60))
    claim(client)  # promotes
    order = oracle_order(sql, POLICY)
    queued = [
        r[0] for r in sql.run("SELECT appid FROM apps WHERE status = 'queued' AND held_at IS NULL")
    ]
    for appid, position in positions(client, queued).items():
        assert position == {"queuePosition": order.index(appid) + 1, "queuePositionExact": True}


def test_queue_position_beyond_the_bound_says_so(client, sql):
    bound = handler.QUEUE_POSITION_BOUND
    sql.run(
        """INSERT INTO apps (appid, details)
           SELECT 'ahead' || n || '.app', '{"reviews": 1000}' FROM generate_series(1, :n) AS n""",
        n=bound - 1,
    )
    insert_app(sql, "last.exact", reviews=999)
    insert_app(sql, "analysed.ahead", status="analysed", version=2, analysed=days_ago(1), reviews=5)
    insert_app(sql, "beyond.app", reviews=1)
    got = positions(client, ["last.exact", "beyond.app"])
    assert got["last.exact"] == {"queuePosition": bound, "queuePositionExact": True}
    assert got["beyond.app"] == {
        "queuePosition": None,
        "queuePositionExact": False,
        "queuePositionNote": f"more than {bound} apps are ahead",
    }


def test_queue_position_while_promotion_is_behind_is_a_lower_bound(client, sql, monkeypatch):
    insert_app(sql, "stale.app", status="analysed", version=4, analysed=days_ago(100), reviews=9)
    insert_app(sql, "queued.app", reviews=1)
    claim(client)  # promotion done under the default policy: stale.app is not stale
    sql.run("UPDATE apps SET status = 'queued' WHERE status = 'processing'")
    configure_service(monkeypatch, handler.settings().database_url, STALE_ANALYSIS_DAYS="30")
    got = positions(client, ["queued.app"])["queued.app"]
    assert got["queuePosition"] == 1
    assert got["queuePositionExact"] is False
    assert "policy change" in got["queuePositionNote"]
