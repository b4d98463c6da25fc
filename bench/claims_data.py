"""Build a production-like apps database at ledger state 006 (legacy JSON states).

Everything is generated inside PostgreSQL (INSERT ... SELECT FROM generate_series), from
random() draws seeded with setseed(), so a run is reproducible for a given --seed and
the rows are still random draws, not arranged to suit the claim:

* state mix: 70 % analysed, 4 % failed, 26 % queued, a few processing markers;
* popularity: details.reviews log-normal (median 20, tail to millions), written as a
  JSON string (60 %), a JSON number (33 %), missing (5 %) or non-numeric (2 %);
* added: uniform over the last three years;
* analysed: age uniform over 0-180 days for 80 %, over 180-400 days for 20 % (stale),
  never before the app was added;
* analysisversion: analysed 80 % on 4, 12 % on 3, 8 % on 2; failures 90 % on 4;
* failures: the analysers' log texts (not found, iOS too low, paid, too large, other),
  half of them with reason/retryable as the previous release wrote them, the rest with
  logs only (002-005 then classify them);
* processing markers: live leases, expired ones, and malformed timestamps;
* a few case-variant duplicates (009 merges them) and invalid bundle IDs (003).

The files 000-006 are run here as the previous server ran them, and recorded in the
previous server's ledger table (no checksum column), so the upgrade that follows goes
through the real runner exactly as a production upgrade would. Below the build, bare
pg8000 connections (no handler import: the floor's clients and the probes must not carry
the service's code).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import pg8000.native

LEGACY_FILES = (
    "000_apps.sql",
    "001_app_analyses.sql",
    "002_mark_app_not_found_non_retryable.sql",
    "003_reject_invalid_app_ids.sql",
    "004_mark_ios_version_too_low_non_retryable.sql",
    "005_mark_paid_apps_non_retryable.sql",
    "006_app_analyses_unique.sql",
)

# The share of each state among the generated apps (the measured mix).
FAILED_SHARE = 0.04
ANALYSED_SHARE = 0.70

VENDORS = (
    "acme globex initech umbrella hooli stark wayne wonka tyrell cyberdyne soylent "
    "vandelay oscorp aperture blackmesa gringotts"
).split()
GENRES = (
    "Games Productivity Education Finance Health Lifestyle Music Photo Social Travel "
    "Utilities News Shopping Sports Weather Business"
).split()
TRACKER_SETS = (
    "{}",
    '{"Google Firebase Analytics": "Google"}',
    '{"Google Firebase Analytics": "Google", "Facebook SDK": "Meta"}',
    '{"Google AdMob": "Google", "AppsFlyer": "AppsFlyer", "Adjust": "Adjust"}',
    '{"Google CrashLytics": "Google"}',
    '{"Facebook SDK": "Meta", "Branch": "Branch", "OneSignal": "OneSignal"}',
    '{"Sentry": "Sentry"}',
    '{"Amplitude": "Amplitude", "Mixpanel": "Mixpanel", "Segment": "Twilio"}',
)
PERMISSION_SETS = (
    "[]",
    '["Camera"]',
    '["Camera", "Location"]',
    '["Contacts", "Photos"]',
    '["Location", "Motion", "Bluetooth"]',
    '["Microphone", "Camera", "Photos", "Location"]',
)


def _sql_array(values: tuple[str, ...], cast: str = "text") -> str:
    quoted = ", ".join("'" + v.replace("'", "''") + "'" for v in values)
    return f"ARRAY[{quoted}]::{cast}[]"


def _draws_sql() -> str:
    """One row per app with every random draw it needs, evaluated once per row in
    generate_series order (OFFSET 0 keeps the subquery from being flattened)."""
    return """
        SELECT i,
               random() AS u_state, random() AS u_case, random() AS u_rev1,
               random() AS u_rev2, random() AS u_revkind, random() AS u_added,
               random() AS u_analysed, random() AS u_version, random() AS u_kind,
               random() AS u_format, random() AS u_proc, random() AS u_misc
        FROM generate_series(1, :n) AS i
        OFFSET 0
    """


def _insert_apps_sql(payload_bytes: int) -> str:
    padding_repeats = max(0, (payload_bytes - 700) // 32)
    vendors = _sql_array(tuple(VENDORS))
    genres = _sql_array(tuple(GENRES))
    trackers = _sql_array(TRACKER_SETS, "json")
    permissions = _sql_array(PERMISSION_SETS, "json")
    return f"""
    INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added)
    SELECT appid, details::json, analysis, analysisversion, analysed, added
    FROM (
        SELECT d.*, s.state, id.appid,
               base - d.u_added * interval '1095 days' AS added,
               -- log-normal review count: median e^3 = 20, sigma 2.5
               floor(exp(3 + 2.5 * sqrt(-2 * ln(1 - d.u_rev1)) * cos(2 * pi() * d.u_rev2)))
                   ::bigint AS reviews,
               -- analysis age: 80 % uniform over 0-180 days, 20 % over 180-400 days
               -- (stale), never before the app was added
               base - least(d.u_added * 1095, CASE
                   WHEN d.u_analysed < 0.8 THEN 180 * d.u_analysed / 0.8
                   ELSE 180 + 220 * (d.u_analysed - 0.8) / 0.2 END)
                   * interval '1 day' AS analysed_at,
               base
        FROM ({_draws_sql()}) d
        CROSS JOIN LATERAL (SELECT now() AT TIME ZONE 'UTC' AS base) b
        CROSS JOIN LATERAL (SELECT CASE
            WHEN d.u_state < :processing_share THEN 'processing'
            WHEN d.u_state < :processing_share + {FAILED_SHARE} THEN 'failed'
            WHEN d.u_state < :processing_share + {FAILED_SHARE + ANALYSED_SHARE}
                THEN 'analysed'
            ELSE 'queued' END AS state) s
        CROSS JOIN LATERAL (SELECT CASE
            WHEN d.u_case < 0.1
                THEN 'com.' || initcap(({vendors})[1 + d.i % 16]) || '.App' || d.i
            ELSE 'com.' || ({vendors})[1 + d.i % 16] || '.app' || d.i END AS appid) id
    ) r
    CROSS JOIN LATERAL (SELECT jsonb_strip_nulls(jsonb_build_object(
        'appId', r.appid,
        'title', 'App ' || r.i,
        'reviews', CASE
            WHEN r.u_revkind < 0.05 THEN NULL
            WHEN r.u_revkind < 0.06 THEN to_jsonb(to_char(r.reviews, 'FM999,999,999,999'))
            WHEN r.u_revkind < 0.07 THEN to_jsonb('n/a'::text)
            WHEN r.u_revkind < 0.40 THEN to_jsonb(r.reviews)
            ELSE to_jsonb(r.reviews::text) END,
        'version', (1 + floor(r.u_misc * 9))::int || '.' || (r.i % 10) || '.' || (r.i % 7),
        'updated', to_char(r.added + (r.base - r.added) * r.u_misc, 'YYYY-MM-DD'),
        'primaryGenre', ({genres})[1 + r.i % 16],
        'score', round((1 + 4 * r.u_misc)::numeric, 1),
        'free', r.u_misc < 0.9,
        'icon', 'https://is1-ssl.mzstatic.com/image/thumb/' || md5(r.i::text) || '/512.jpg'
    )) AS details) det
    CROSS JOIN LATERAL (SELECT
        CASE r.state
            WHEN 'analysed' THEN CASE WHEN r.u_version < 0.80 THEN 4
                                      WHEN r.u_version < 0.92 THEN 3 ELSE 2 END
            WHEN 'failed' THEN CASE WHEN r.u_version < 0.9 THEN 4 ELSE 3 END
            WHEN 'processing' THEN CASE WHEN r.u_version < 0.5 THEN 4 END
        END AS analysisversion,
        CASE WHEN r.state IN ('analysed', 'failed')
                  OR (r.state = 'processing' AND r.u_version < 0.5)
             THEN r.analysed_at END AS analysed) v
    CROSS JOIN LATERAL (SELECT CASE r.state
        WHEN 'analysed' THEN json_build_object(
            'success', CASE WHEN r.u_format < 0.95 THEN true END,
            'analysis_source', 'trackerscan-ios',
            'analysis_version', v.analysisversion::text,
            'signature_set', 'ios-v2',
            'bundleID', r.appid,
            'version', det.details->>'version',
            'trackers', ({trackers})[1 + floor(r.u_kind * 8)::int],
            'non_trackers', '{{}}'::json,
            'permissions', ({permissions})[1 + floor(r.u_misc * 6)::int],
            'tracker_details', '[]'::json,
            'trackingDomains', '[]'::json,
            'privacyTracking', r.u_kind < 0.3,
            'classCount', floor(1000 + 80000 * r.u_misc)::int,
            'raw_info_plist', json_build_object(
                'CFBundleIdentifier', r.appid,
                'CFBundleShortVersionString', det.details->>'version',
                'UIRequiredDeviceCapabilities', '["arm64"]'::json,
                'padding', (SELECT string_agg(md5(r.appid || k), '')
                            FROM generate_series(1, {padding_repeats}) AS k)))
        WHEN 'failed' THEN (
            SELECT CASE
                WHEN r.u_format < 0.4 THEN json_build_object(
                    'success', false, 'logs', f.logs, 'reason', f.reason,
                    'retryable', f.retryable)
                WHEN r.u_format < 0.5 THEN json_build_object(
                    'success', false, 'logs', f.logs, 'reason', f.reason)
                ELSE json_build_object('success', false, 'logs', f.logs) END
            FROM (SELECT CASE
                WHEN r.u_kind < 0.25 THEN 'ERROR: App not found in the App Store'
                WHEN r.u_kind < 0.40 THEN 'install failed: DeviceOSVersionTooLow'
                WHEN r.u_kind < 0.50 THEN 'ERROR: Purchasing paid apps is not supported'
                WHEN r.u_kind < 0.55 THEN 'Download exceeded MAX_ATTEMPT_DOWNLOAD_BYTES'
                ELSE 'ERROR: timed out waiting for the device to unlock' END
                    || E'\\nstep ' || r.i % 12 || ' of 12' AS logs,
                CASE
                    WHEN r.u_kind < 0.25 THEN 'app_not_found'
                    WHEN r.u_kind < 0.40 THEN 'ios_version_too_low'
                    WHEN r.u_kind < 0.50 THEN 'paid_app'
                    WHEN r.u_kind < 0.55 THEN 'ipa_too_large'
                    ELSE 'analysis_failed' END AS reason,
                r.u_kind >= 0.55 AS retryable) f)
        WHEN 'processing' THEN json_build_object(
            'success', false,
            'logs', 'Processing in progress',
            'timestamp', CASE
                WHEN r.u_proc < 0.60 THEN to_char(r.base - r.u_misc * interval '60 minutes',
                                                  'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')
                WHEN r.u_proc < 0.85 THEN to_char(r.base - interval '3 hours'
                                                  - r.u_misc * interval '7 days',
                                                  'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')
                WHEN r.u_proc < 0.95 THEN 'not a time'
                ELSE to_char(r.base - r.u_misc * interval '30 minutes',
                             'YYYY-MM-DD HH24:MI:SS') END)
        END AS analysis) a
    """


CASE_VARIANTS_SQL = """
INSERT INTO apps (appid, details, analysis, analysisversion, analysed, added)
SELECT upper(appid),
       (details::jsonb || jsonb_build_object('appId', upper(appid)))::json,
       CASE WHEN random() < 0.5 THEN NULL ELSE analysis END,
       analysisversion,
       analysed - random() * interval '30 days',
       added + random() * interval '10 days'
FROM apps
WHERE appid = lower(appid) AND analysis->>'logs' IS NULL
ORDER BY appid
LIMIT :count
"""

INVALID_IDS_SQL = """
INSERT INTO apps (appid, details)
SELECT CASE i % 3 WHEN 0 THEN 'com.bench invalid ' || i
                  WHEN 1 THEN 'com.bench.under_score' || i
                  ELSE 'com.bench.trailing' || i || '.' END,
       json_build_object('title', 'Invalid ' || i)
FROM generate_series(1, :count) AS i
"""

# History written by the previous release after 001: an older analysis for some apps,
# and a few exact duplicates that 006 removes.
OLDER_HISTORY_SQL = """
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version,
                          analysis_source, success)
SELECT appid,
       json_build_object('success', true, 'analysis_source', 'trackerscan-ios',
                         'analysis_version', '3', 'bundleID', appid, 'trackers', '{}'::json),
       3, analysed - (30 + random() * 300) * interval '1 day', details->>'version',
       'trackerscan-ios', true
FROM apps
WHERE analysed IS NOT NULL AND analysis->>'logs' IS NULL AND random() < 0.15
"""
DUPLICATE_HISTORY_SQL = """
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version,
                          analysis_source, success)
SELECT appid, analysis, analysisversion, analysed, app_version, analysis_source, success
FROM app_analyses WHERE random() < 0.001
"""

LEGACY_LEDGER_SQL = """
CREATE TABLE schema_migrations (
    filename text PRIMARY KEY,
    applied_at timestamp without time zone NOT NULL DEFAULT now()
)
"""


def seed_value(seed: int) -> float:
    """setseed() takes a number in [-1, 1]."""
    return (seed % 1_000_003) / 1_000_003.0


def build_legacy_database(connection, sql_dir: Path, n: int, seed: int, payload_bytes: int):
    """Fill an empty database with n apps at ledger state 006; returns step timings."""
    steps: list[tuple[str, float]] = []

    def step(name: str, work) -> None:
        started = time.perf_counter()
        work()
        steps.append((name, time.perf_counter() - started))

    def run_file(name: str) -> None:
        connection.execute_simple((sql_dir / name).read_text())

    connection.run("SET synchronous_commit = off")
    connection.run("SET maintenance_work_mem = '256MB'")
    connection.run("SELECT setseed(:s)", s=seed_value(seed))
    variants = max(2, n // 5000)
    invalid = 3 + n // 200_000
    main = n - variants - invalid
    processing_share = max(8, n // 40_000) / main
    step("000 apps table", lambda: run_file(LEGACY_FILES[0]))
    step(
        f"generate {main} apps",
        lambda: connection.run(
            _insert_apps_sql(payload_bytes), n=main, processing_share=processing_share
        ),
    )
    step(
        f"{variants} case variants, {invalid} invalid IDs",
        lambda: (
            connection.run(CASE_VARIANTS_SQL, count=variants),
            connection.run(INVALID_IDS_SQL, count=invalid),
        ),
    )
    step("001 history copy", lambda: run_file(LEGACY_FILES[1]))
    step(
        "older + duplicate history",
        lambda: (connection.run(OLDER_HISTORY_SQL), connection.run(DUPLICATE_HISTORY_SQL)),
    )
    for name in LEGACY_FILES[2:]:
        step(name[:3], lambda name=name: run_file(name))
    connection.run(LEGACY_LEDGER_SQL)
    for name in LEGACY_FILES:
        connection.run("INSERT INTO schema_migrations (filename) VALUES (:f)", f=name)
    # A production table has been vacuumed and analysed by autovacuum; start from there.
    step("VACUUM ANALYZE, CHECKPOINT", lambda: _vacuum_checkpoint(connection))
    return steps


def _vacuum_checkpoint(connection) -> None:
    connection.run("VACUUM ANALYZE apps")
    connection.run("VACUUM ANALYZE app_analyses")
    connection.run("CHECKPOINT")


def legacy_mix(connection) -> dict[str, int]:
    """Counts of the legacy states, read back from the JSON as the previous release did."""
    rows = connection.run(
        """
        SELECT CASE
            WHEN analysis IS NULL THEN 'queued'
            WHEN analysis->>'logs' = 'Processing in progress'
                 AND analysis->>'success' = 'false' THEN 'processing'
            WHEN analysis->>'success' = 'false' THEN 'failed'
            ELSE 'analysed' END, count(*)
        FROM apps GROUP BY 1 ORDER BY 1
        """
    )
    return {state: count for state, count in rows}


# --- bare connections ------------------------------------------------------------------

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def connection_arguments(url: str) -> dict:
    """pg8000 keyword arguments for a postgresql:// URL (TCP or ?host=<socket dir>)."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError("the database URL must start with postgresql://")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    arguments = {
        "user": unquote(parts.username or "postgres"),
        "password": unquote(parts.password) if parts.password else None,
        "database": unquote(parts.path.lstrip("/")) or "postgres",
    }
    port = parts.port or int(query.get("port", 5432))
    if query.get("host"):
        arguments["unix_sock"] = f"{query['host']}/.s.PGSQL.{port}"
    else:
        arguments.update(host=parts.hostname or "127.0.0.1", port=port)
    return arguments


def connect(url: str, application_name: str = "bench") -> pg8000.native.Connection:
    return pg8000.native.Connection(
        application_name=application_name, timeout=600, **connection_arguments(url)
    )


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def database_name(url: str) -> str:
    return unquote(urlsplit(url).path.lstrip("/")) or "postgres"


def server_reachable(url: str) -> bool:
    arguments = connection_arguments(url)
    if "unix_sock" in arguments:
        return True
    try:
        with socket.create_connection((arguments["host"], arguments["port"]), timeout=2):
            return True
    except OSError:
        return False


def bench_database(server_url: str, name: str, reuse: bool) -> str:
    """The URL of a benchmark's database on the server of `server_url`: the one a run
    left (`reuse`), or made anew."""
    server = with_database(server_url, "postgres")
    return with_database(server, name) if reuse else recreate_database(server, name)


def recreate_database(server_url: str, name: str) -> str:
    """Drop (forcing other sessions off) and create a database; returns its URL."""
    admin = connect(server_url)
    try:
        identifier = pg8000.native.identifier(name)
        admin.run(f"DROP DATABASE IF EXISTS {identifier} WITH (FORCE)")
        admin.run(f"CREATE DATABASE {identifier}")
    finally:
        admin.close()
    return with_database(server_url, name)
