"""Databases as other programs left them, built from SQL kept in this repository.

States a database can be in when this service is pointed at it:

* "006": the production ledger before the state-machine change (queue state in JSON);
* "009": the state-machine change applied by the old server (007-009);
* "old010" ... "old013": the old server's later releases, whose ledger files are in
  tests/legacy_sql/ (written from what those files are known to have done);
* "head": this service's previous release (its ledger up to 012_due_index).

Each state holds legacy rows in every queue state, written by the statements of the
program that ran then: a queued app, a live lease, an expired lease, an analysis and a
retryable failure (`LEGACY_APPS`), on top of the production rows of
`build_production_database` (the database at 006, which tests/test_ledger.py upgrades).
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import handler
from helpers import connect, migrate, record_in_ledger

LEGACY_SQL_DIR = Path(__file__).resolve().parent / "legacy_sql"
ALL_OUR_FILES = [path.name for path in sorted(handler.SQL_DIR.glob("*.sql"))]
OLD_SERVER_FILES = [path.name for path in sorted(LEGACY_SQL_DIR.glob("*.sql"))]
STATE_MACHINE_FILES = [
    "007_apps_state_columns.sql",
    "008_jsonb_timestamptz.sql",
    "009_case_insensitive_appids.sql",
]
# The previous server's ledger: the files production ran before the state-machine change.
PRODUCTION_FILES = [name for name in ALL_OUR_FILES if name < "007"]
OLD_STATES = ["old010", "old011", "old012", "old013"]
STATES = ["006", "009", *OLD_STATES, "head"]

# The legacy apps (reviews decide the claim order: all are above the production rows').
LEGACY_APPS = {
    "old.live": 950,  # processing, lease live
    "old.expired": 900,  # processing, lease expired three hours ago
    "old.queued": 800,
    "old.done": 700,  # analysed, current version
    "old.failed": 600,  # failed, retryable
}

# --- the old server at its 010 and later: its own statements, in its own shape --------
OLD_ADD_APP = """
INSERT INTO apps (appid, details) VALUES (:appid, CAST(:details AS jsonb))
ON CONFLICT DO NOTHING
"""
# Its claim: a fresh random UUID with each lease, in analysis_claim_token.
OLD_CLAIM_NEXT = """
UPDATE apps SET status = 'processing', processing_started = now(), analysis_claim_token = :token
WHERE appid = (
    SELECT appid FROM apps
    WHERE status = 'queued'
       OR (status = 'processing' AND processing_started < now() - interval '2 hours')
    ORDER BY added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING appid
"""
OLD_CLAIM_NAMED = """
UPDATE apps SET status = 'processing', processing_started = now(), analysis_claim_token = :token
WHERE appid = :appid
  AND (status <> 'processing' OR processing_started < now() - interval '2 hours')
RETURNING appid
"""
# Its completion: only while the token is the current one; the token is cleared.
OLD_COMPLETE = """
UPDATE apps SET analysis = CAST(:analysis AS jsonb), analysisversion = :version,
                analysed = now(), status = :status, failure_reason = :reason,
                failure_retryable = :retryable, processing_started = NULL,
                analysis_claim_token = NULL
WHERE appid = :appid AND analysis_claim_token = :token
RETURNING appid
"""
OLD_RECORD_HISTORY = """
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version, success)
SELECT appid, analysis, analysisversion, analysed, analysis->>'version', status = 'analysed'
FROM apps WHERE appid = :appid
ON CONFLICT DO NOTHING
"""
# The history statement of the release before the state-machine change (tests/
# test_deploy_window.py runs that release's statements after each ledger file).
PRE_STATE_MACHINE_RECORD_HISTORY = """
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed)
SELECT appid, analysis, analysisversion, analysed FROM apps WHERE appid = :appid
ON CONFLICT DO NOTHING
"""
# From its 013 on, history rows carry the storefront listing from the website's cache.
OLD_RECORD_HISTORY_013 = """
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version, success,
                          storefront_details, storefront_fetched_at)
SELECT a.appid, a.analysis, a.analysisversion, a.analysed, a.analysis->>'version',
       a.status = 'analysed', c.details, c.fetched_at
FROM apps a LEFT JOIN app_store_cache c ON c.appid_key = lower(a.appid)
WHERE a.appid = :appid
ON CONFLICT DO NOTHING
"""
# The website (from the old server's 011 on) caches App Store search results.
OLD_CACHE_APP = """
INSERT INTO app_store_cache (appid_key, details) VALUES (lower(:appid), CAST(:details AS jsonb))
ON CONFLICT (appid_key) DO UPDATE SET details = EXCLUDED.details, fetched_at = now()
"""

# --- this service's previous release (ledger up to 012): its claim token is text ------
PREVIOUS_CLAIM_NAMED = """
UPDATE apps SET status = 'processing', processing_started = now(), due = false,
                claim_token = :token
WHERE appid = :appid
RETURNING appid
"""
PREVIOUS_STORE_RESULT = """
UPDATE apps SET analysis = CAST(:analysis AS jsonb), analysisversion = 4, analysed = now(),
                status = :status, failure_reason = :reason, failure_retryable = :retryable,
                processing_started = NULL, claim_token = NULL, due = false
WHERE appid = :appid
RETURNING appid
"""
PREVIOUS_REFETCH = """
UPDATE apps SET status = 'queued', processing_started = NULL, failure_reason = NULL,
                failure_retryable = NULL, claim_token = NULL, due = false
WHERE appid = :appid
"""

# --- this service's release before named analysers (ledger up to 019), verbatim -------
RELEASE_019_CLAIM_NAMED = """
UPDATE apps SET status = 'processing', processing_started = now(), due = false,
                analysis_claim_token = :token
WHERE appid = (
    SELECT appid FROM apps
    WHERE lower(appid) = lower(:appid) AND (
    status = 'queued'
    OR (status = 'processing'
        AND COALESCE(processing_started, '-infinity')
            < now() - make_interval(mins => :timeout_minutes))
    OR ((status = 'analysed' OR (status = 'failed' AND failure_retryable))
        AND (COALESCE(analysisversion, 0) < :analysis_version
             OR COALESCE(analysed, '-infinity') < now() - make_interval(days => :stale_days)))
)
    FOR UPDATE SKIP LOCKED)
RETURNING appid
"""
RELEASE_019_STORE_RESULT = """
UPDATE apps SET analysis = CAST(:analysis AS jsonb), analysisversion = :version,
                analysed = now(), status = :status, failure_reason = :failure_reason,
                failure_retryable = :failure_retryable, processing_started = NULL,
                analysis_claim_token = NULL, due = false
WHERE appid = :appid
RETURNING appid,
       CASE WHEN octet_length(details::text) <= :document_limit THEN details::text END AS details,
       octet_length(details::text) AS details_bytes, analysed
"""
RELEASE_019_RECORD_HISTORY = """
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version,
                          analysis_source, success)
SELECT appid, analysis, analysisversion, analysed,
       COALESCE(analysis->>'version', details->>'version'), analysis->>'analysis_source',
       status = 'analysed'
FROM apps WHERE appid = ANY(CAST(:appids AS text[]))
  AND analysis IS NOT NULL AND analysed IS NOT NULL
ON CONFLICT DO NOTHING
"""
RELEASE_019_REFETCH_APPLY = """
UPDATE apps SET status = 'queued', processing_started = NULL, failure_reason = NULL,
                failure_retryable = NULL, analysis_claim_token = NULL, due = false
WHERE appid = ANY(CAST(:appids AS text[]))
"""
RELEASE_019_LAST_PING = """
SELECT max(last_seen) AS last_seen,
       count(*) FILTER (WHERE last_seen > now() - interval '1 hour') AS analysers_last_hour
FROM analyser_heartbeats
"""

FAILURE = {"success": False, "logs": "usb error", "reason": "analysis_failed", "retryable": True}


def details(appid: str) -> str:
    return json.dumps({"appId": appid, "title": appid, "reviews": str(LEGACY_APPS[appid])})


def run_old_server_file(sql, name: str) -> None:
    sql.execute_simple((LEGACY_SQL_DIR / name).read_text())
    record_in_ledger(sql, name)  # as the old server recorded it: no checksum


def old_server_complete(sql, appid: str, token: uuid.UUID, payload: dict, history: str) -> list:
    state = handler.derive_analysis_state(payload)
    sql.run("BEGIN")
    rows = sql.run(
        OLD_COMPLETE,
        appid=appid,
        token=token,
        analysis=json.dumps(payload),
        version=4,
        status=state.status,
        reason=state.failure_reason,
        retryable=state.failure_retryable,
    )
    if rows:
        sql.run(history, appid=appid)
    sql.run("COMMIT")
    return rows


def build(url: str, state: str) -> dict[str, str | None]:
    """The database in `state`, with the production rows and LEGACY_APPS; returns the claim
    token each legacy lease holder has (None where that program handed out none)."""
    build_production_database(url, with_rows=True)
    if state == "head":
        migrate(url, _our_files_up_to("012"))
    sql = connect(url)
    try:
        if state == "006":
            return _legacy_rows_at_006(sql)
        if state == "head":
            return _legacy_rows_at_previous_release(sql)
        for name in STATE_MACHINE_FILES:
            sql.execute_simple((handler.SQL_DIR / name).read_text())
            record_in_ledger(sql, name)
        if state == "009":
            return _legacy_rows_at_009(sql)
        stage = OLD_STATES.index(state)
        run_old_server_file(sql, OLD_SERVER_FILES[0])
        tokens = _legacy_rows_at_old_010(sql)
        if stage >= 1:
            run_old_server_file(sql, OLD_SERVER_FILES[1])
            for appid in LEGACY_APPS:
                sql.run(OLD_CACHE_APP, appid=appid, details=details(appid))
        if stage >= 2:
            run_old_server_file(sql, OLD_SERVER_FILES[2])
        if stage >= 3:
            run_old_server_file(sql, OLD_SERVER_FILES[3])
            # A history row written by that release, with its storefront listing.
            token = uuid.uuid4()
            sql.run(OLD_CLAIM_NAMED, appid="old.done", token=token)
            old_server_complete(
                sql,
                "old.done",
                token,
                {"success": True, "version": "7.0", "again": True},
                OLD_RECORD_HISTORY_013,
            )
        return tokens
    finally:
        sql.close()


def _legacy_rows_at_006(sql) -> dict[str, str | None]:
    marker = {"success": False, "logs": "Processing in progress"}
    rows = [
        ("old.live", {**marker, "timestamp": "now"}, None, None),
        ("old.expired", {**marker, "timestamp": "3 hours ago"}, None, None),
        ("old.queued", None, None, None),
        ("old.done", {"success": True, "trackers": {}}, 4, "now"),
        ("old.failed", FAILURE, 4, "now"),
    ]
    for appid, analysis, version, analysed in rows:
        if analysis and "timestamp" in analysis:
            ((stamp,),) = sql.run(
                "SELECT to_char((now() - CAST(:ago AS interval)) AT TIME ZONE 'UTC',"
                ' \'YYYY-MM-DD"T"HH24:MI:SS"Z"\')',
                ago="0" if analysis["timestamp"] == "now" else "3 hours",
            )
            analysis = {**analysis, "timestamp": stamp}
        sql.run(
            "INSERT INTO apps (appid, details, analysis, analysisversion, analysed)"
            " VALUES (:a, CAST(:d AS json), CAST(:j AS json), :v,"
            " CASE WHEN :t = 'now' THEN now() END)",
            a=appid,
            d=details(appid),
            j=None if analysis is None else json.dumps(analysis),
            v=version,
            t=analysed,
        )
    return {"old.live": None, "old.expired": None}


def _legacy_rows_at_009(sql) -> dict[str, str | None]:
    rows = [
        ("old.live", "processing", "0", None, None),
        ("old.expired", "processing", "3 hours", None, None),
        ("old.queued", "queued", None, None, None),
        ("old.done", "analysed", None, {"success": True, "trackers": {}}, None),
        ("old.failed", "failed", None, FAILURE, True),
    ]
    for appid, status, ago, analysis, retryable in rows:
        sql.run(
            "INSERT INTO apps (appid, details, analysis, analysisversion, analysed, status,"
            " processing_started, failure_reason, failure_retryable)"
            " VALUES (:a, CAST(:d AS jsonb), CAST(:j AS jsonb), :v,"
            " CASE WHEN :analysed THEN now() END, :s,"
            " now() - CAST(:ago AS interval), :reason, :retryable)",
            a=appid,
            d=details(appid),
            j=None if analysis is None else json.dumps(analysis),
            v=4 if analysis else None,
            analysed=analysis is not None,
            s=status,
            ago=ago,
            reason="analysis_failed" if status == "failed" else None,
            retryable=retryable,
        )
    return {"old.live": None, "old.expired": None}


def _legacy_rows_at_old_010(sql) -> dict[str, str | None]:
    """The old server at its 010 added, claimed and completed these with its tokens."""
    for appid in LEGACY_APPS:
        sql.run(OLD_ADD_APP, appid=appid, details=details(appid))
    tokens = {}
    for appid in ("old.live", "old.expired", "old.done", "old.failed"):
        tokens[appid] = uuid.uuid4()
        assert sql.run(OLD_CLAIM_NAMED, appid=appid, token=tokens[appid]) == [[appid]]
    sql.run(
        "UPDATE apps SET processing_started = now() - interval '3 hours'"
        " WHERE appid = 'old.expired'"
    )
    assert old_server_complete(
        sql, "old.done", tokens["old.done"], {"success": True, "trackers": {}}, OLD_RECORD_HISTORY
    )
    assert old_server_complete(sql, "old.failed", tokens["old.failed"], FAILURE, OLD_RECORD_HISTORY)
    return {"old.live": str(tokens["old.live"]), "old.expired": str(tokens["old.expired"])}


def _legacy_rows_at_previous_release(sql) -> dict[str, str | None]:
    """This service's previous release (ledger up to 012) and its text claim tokens."""
    for appid in LEGACY_APPS:
        sql.run(OLD_ADD_APP, appid=appid, details=details(appid))
    tokens = {}
    for appid in ("old.live", "old.expired", "old.done", "old.failed"):
        tokens[appid] = f"previous-release-{appid}"
        sql.run(PREVIOUS_CLAIM_NAMED, appid=appid, token=tokens[appid])
    sql.run(
        "UPDATE apps SET processing_started = now() - interval '3 hours'"
        " WHERE appid = 'old.expired'"
    )
    for appid, payload in (("old.done", {"success": True}), ("old.failed", FAILURE)):
        state = handler.derive_analysis_state(payload)
        sql.run(
            PREVIOUS_STORE_RESULT,
            appid=appid,
            analysis=json.dumps(payload),
            status=state.status,
            reason=state.failure_reason,
            retryable=state.failure_retryable,
        )
    return {"old.live": tokens["old.live"], "old.expired": tokens["old.expired"]}


@functools.cache
def _our_files_up_to(last: str) -> Path:
    """A copy of sql/ holding our files up to `last` (a three-digit prefix), made once per
    test run and removed when it ends."""
    scratch = tempfile.TemporaryDirectory(prefix="ledger-subsets-")
    _SCRATCH_DIRECTORIES.append(scratch)  # kept alive (and cleaned up) with the process
    directory = Path(scratch.name)
    for path in sorted(handler.SQL_DIR.glob("*.sql")):
        if path.name[:3] <= last:
            shutil.copy(path, directory / path.name)
    return directory


_SCRATCH_DIRECTORIES: list[tempfile.TemporaryDirectory] = []


# --- the production database at 006 -----------------------------------------------------


def build_production_database(url: str, with_rows: bool = False) -> None:
    """The database as the previous server left it: a ledger without checksums, files
    000-006 applied. With rows, the legacy apps exist before 001 (which copies their
    analyses into history) and the legacy history rows before 002, so 002-006 run over
    them as they did in production."""
    sql = connect(url)
    sql.run(
        "CREATE TABLE schema_migrations (filename text PRIMARY KEY,"
        " applied_at timestamp without time zone NOT NULL DEFAULT now())"
    )
    for name in PRODUCTION_FILES:
        if with_rows and name.startswith("001"):
            insert_production_apps(sql)
        if with_rows and name.startswith("002"):
            insert_production_history(sql)
        sql.execute_simple((handler.SQL_DIR / name).read_text())
        record_in_ledger(sql, name)
    if with_rows:
        # Written by the previous server after 006: a log with a NUL byte, as json.
        nul_log = '{"success": false, "logs": "bad\\u0000byte"}'
        sql.run(
            "INSERT INTO apps (appid, details, analysis, analysisversion, analysed)"
            " VALUES ('app.failed.nul', CAST(:d AS json), CAST(:j AS json), 4, now())",
            d='{"appId": "app.failed.nul", "note": "\\u0000"}',
            j=nul_log,
        )
        sql.run(
            "INSERT INTO app_analyses (appid, analysis)"
            " VALUES ('app.failed.nul', CAST(:j AS json))",
            j=nul_log,
        )
    sql.close()


PRODUCTION_APPS = [
    # appid, analysis (json text or None), analysisversion, analysed, added
    ("app.queued", None, None, None, "2024-01-01 00:00"),
    (
        "app.processing",
        {
            "success": False,
            "logs": "Processing in progress",
            "timestamp": "2026-11-29T10:00:00.000Z",
        },
        None,
        None,
        "2024-01-02",
    ),
    (
        "app.processing.badtime",
        {
            "success": False,
            "logs": "Processing in progress",
            "timestamp": "Sun Nov 29 2026 10:00 GMT",
        },
        None,
        None,
        "2024-01-03",
    ),
    (
        "app.processing.impossible",
        {"success": False, "logs": "Processing in progress", "timestamp": "2026-13-45T99:99:99Z"},
        None,
        None,
        "2024-01-03",
    ),
    (
        "app.processing.notime",
        {"success": False, "logs": "Processing in progress"},
        None,
        None,
        "2024-01-03",
    ),
    (
        "app.failed.final",
        {"success": False, "logs": "x", "reason": "paid_app", "retryable": False},
        4,
        "2026-10-01",
        "2024-01-04",
    ),
    ("app.failed.noflag", {"success": False, "logs": "usb error"}, 4, "2026-10-01", "2024-01-05"),
    (
        "app.failed.retry",
        {"success": False, "logs": "x", "reason": "analysis_failed", "retryable": True},
        3,
        "2026-10-01",
        "2024-01-06",
    ),
    (
        "app.failed.notfound",
        {"success": False, "logs": "Error: App not found"},
        4,
        "2026-10-01",
        "2024-01-06",
    ),
    ("app.analysed", {"success": True, "trackers": {}}, 4, "2026-11-01 12:00", "2024-01-07"),
    ("app.analysed.nosuccess", {"trackers": {"x": "y"}}, 3, "2025-01-01", "2024-01-08"),
    ("bad id!", None, None, None, "2024-01-09"),
    # Case variants: the analysed one is kept, whatever its age.
    ("com.Example.App", {"success": True}, 4, "2026-06-01", "2024-03-01"),
    ("com.example.app", None, None, None, "2024-01-01"),
    ("COM.EXAMPLE.APP", {"success": False, "logs": "x"}, 4, "2026-09-01", "2024-02-01"),
    # Neither analysed: the most recently analysed one is kept.
    ("org.Two", {"success": False, "logs": "x"}, 4, "2026-01-01", "2024-01-01"),
    ("org.two", {"success": False, "logs": "y"}, 4, "2026-05-01", "2024-05-01"),
    # Nothing analysed: the first added is kept.
    ("net.Three", None, None, None, "2024-02-01"),
    ("net.three", None, None, None, "2024-01-01"),
]

PRODUCTION_HISTORY = [
    # appid, analysed: some collide with the keeper's, some between losers
    ("com.Example.App", "2026-06-01"),
    ("com.Example.App", "2026-01-01"),
    ("com.example.app", "2026-01-01"),  # collides with the keeper's row: dropped
    ("com.example.app", "2025-07-01"),  # collides with the next (loser vs loser): kept (lower id)
    ("COM.EXAMPLE.APP", "2025-07-01"),  # dropped
    ("COM.EXAMPLE.APP", "2026-09-01"),  # moved
    ("org.Two", "2026-01-01"),  # moved to org.two
    ("org.two", "2026-05-01"),
    ("app.analysed", "2026-11-01 12:00"),
]


def insert_production_apps(sql) -> None:
    for appid, analysis, version, analysed, added in PRODUCTION_APPS:
        document = (
            analysis if isinstance(analysis, str) or analysis is None else json.dumps(analysis)
        )
        sql.run(
            "INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added)"
            " VALUES (:a, CAST(:d AS json), CAST(:j AS json), :v, CAST(:t AS timestamp),"
            " CAST(:added AS timestamp))",
            a=appid,
            d=json.dumps({"appId": appid, "reviews": "10"}),
            j=document,
            v=version,
            t=analysed,
            added=added,
        )


def insert_production_history(sql) -> None:
    for appid, analysed in PRODUCTION_HISTORY:
        sql.run(
            "INSERT INTO app_analyses (appid, analysis, analysed)"
            " VALUES (:a, CAST(:j AS json), CAST(:t AS timestamp))",
            a=appid,
            j=json.dumps({"success": True, "at": analysed}),
            t=analysed,
        )
