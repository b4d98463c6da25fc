"""The claim: each candidate class, the order, leases, concurrency, and the oracle.

The oracle is the queue's candidate rule (docs/queue.md) written out in Python
below, evaluated on the rows themselves; whatever /queue hands out must be the first
candidate in its order. Tests that move rows in time directly (instead of waiting) call
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
    app_row,
    connect,
    database_at,
    days_ago,
    insert_app,
    minutes_ago,
    oracle_order,
    popularity,
    run_together,
)

POLICY = handler.QueuePolicy()


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
    insert_app(
        sql, "failed.retry.recent", status="failed", retryable=True, version=4, analysed=days_ago(1)
    )
    for appid in ("failed.final.old", "failed.final.flagged"):
        insert_app(sql, appid, status="failed", retryable=False, version=1, analysed=days_ago(900))
    # The retry gate holds whatever the promoter's flag says: a row flagged due (by a
    # promotion while it was retryable, or by another program) is judged by the rule.
    sql.run("UPDATE apps SET due = true WHERE appid = 'failed.final.flagged'")
    handed_out = set()
    while True:
        appid = claim(client)
        if not appid:
            break
        handed_out.add(appid)
    assert handed_out == {
        "queued.app",
        "lease.expired",
        "analysed.oldversion",
        "analysed.noversion",
        "analysed.stale",
        "failed.retry.old",
        "failed.retry.stale",
    }
    # Asked for by name (the exact app mode), no other app is a candidate either.
    others = sql.run(
        "SELECT appid FROM apps WHERE appid <> ALL(:handed_out) ORDER BY appid",
        handed_out=sorted(handed_out),
    )
    assert len(others) == 6
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
    insert_app(
        sql, "failed.recent", status="failed", retryable=True, version=4, analysed=days_ago(3)
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
@given(seed=st.integers(0, 2**32 - 1), promoted=st.booleans(), policy=st.sampled_from(range(4)))
def test_a_claim_locks_no_row_that_cannot_win(database_url, sql, seed, promoted, policy):
    """A claim locks the first queued or flagged candidate (`head`) and, of the other
    sources (old versions, unflagged leases and stale analyses), only rows at least as
    popular as that head: a less popular one loses to it anyway, and each lock is a write.
    The claim runs in an open transaction, so its locks can be seen from another
    connection; every state is drawn, flagged by the promoter or not."""
    sql.run("DELETE FROM apps")
    rng = random.Random(seed)
    random_state(sql, rng, size=rng.randint(5, 60))
    rule = POLICIES[policy]
    if promoted:
        promoter = database_at(database_url)
        handler.promote_due_apps(promoter, rule, force=True)
        promoter.discard()
    order = oracle_order(sql, rule)
    rows = {
        r[0]: r[1:] for r in sql.run("SELECT appid, details, status = 'queued' OR due FROM apps")
    }
    head = next((appid for appid in order if rows[appid][1]), None)  # queued or flagged
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
    if head is not None:
        bar = popularity(rows[head][0])
        less_popular = {a for a in locked - {head} if popularity(rows[a][0]) < bar}
        assert less_popular == set(), (head, bar, order[:5])


# --- the oracle property ------------------------------------------------------------


def random_state(sql, rng: random.Random, size: int) -> None:
    """A random mix of every state, with ages well clear of the cutoffs so that the few
    milliseconds between the oracle's now() and the claim's cannot matter."""
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
        insert_app(sql, appid, status=status, **kwargs)


POLICIES = [
    handler.QueuePolicy(),
    handler.QueuePolicy(analysis_version=5, stale_days=180, processing_timeout_minutes=120),
    handler.QueuePolicy(analysis_version=3, stale_days=60, processing_timeout_minutes=100),
    handler.QueuePolicy(analysis_version=4, stale_days=365, processing_timeout_minutes=200),
]


@pytest.mark.parametrize("seed", range(12))
def test_oracle_on_random_states(client, sql, monkeypatch, seed):
    rng = random.Random(seed)
    random_state(sql, rng, size=rng.randint(5, 60))
    url = handler.settings().database_url
    # Several runs of the service, each with a policy drawn at random (a policy may change
    # between two runs), each claiming a few apps and checking every one.
    for _ in range(3):
        policy = rng.choice(POLICIES)
        configure_service(
            monkeypatch,
            url,
            CURRENT_ANALYSIS_VERSION=str(policy.analysis_version),
            STALE_ANALYSIS_DAYS=str(policy.stale_days),
            PROCESSING_TIMEOUT_MINUTES=str(policy.processing_timeout_minutes),
        )
        for _ in range(rng.randint(1, 8)):
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
    oracle's first candidate. Progress is in the database, so a new process goes on."""
    monkeypatch.setattr(handler, "PROMOTION_BATCH", 7)
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
            expected = oracle_order(sql, policy)
            assert claim(client) == (expected[0] if expected else ""), policy
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


# --- the public queue position ------------------------------------------------------------


def positions(client, appids: list[str]) -> dict[str, dict]:
    answers = {appid: client.get(f"/apps/{appid}").json() for appid in appids}
    return {
        a: {k: v for k, v in view.items() if k.startswith("queuePosition")}
        for a, view in answers.items()
    }


@pytest.mark.parametrize("seed", range(6))
def test_queue_positions_match_the_oracle(client, sql, seed):
    rng = random.Random(seed)
    random_state(sql, rng, size=rng.randint(5, 60))
    claim(client)  # promotes
    order = oracle_order(sql, POLICY)
    queued = [r[0] for r in sql.run("SELECT appid FROM apps WHERE status = 'queued'")]
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
