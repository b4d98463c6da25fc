
WITH RECURSIVE stale_versions(version) AS (
    -- Each analysis version up to the current one that an unflagged analysed or retryable
    -- row holds, lowest first: a skip scan of apps_stale_version_watch.
    SELECT min(COALESCE(analysisversion, 0)) FROM apps
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) <= :analysis_version
  UNION ALL
    SELECT (SELECT min(COALESCE(analysisversion, 0)) FROM apps
            WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
              AND COALESCE(analysisversion, 0) > v.version
              AND COALESCE(analysisversion, 0) <= :analysis_version)
    FROM stale_versions v WHERE v.version IS NOT NULL
), old_versions(version) AS (
    SELECT version FROM stale_versions WHERE version < :analysis_version
), stale_days(version, day) AS (
    -- For each stale version whose oldest unflagged analysis is past the cutoff, each
    -- analysis day up to the cutoff that holds such rows, oldest first: a skip scan.
    SELECT s.version, (SELECT min(analysis_day(analysed)) FROM apps
                       WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND held_at IS NULL
                         AND COALESCE(analysisversion, 0) = s.version
                         AND analysis_day(analysed) <= analysis_day(now() - make_interval(days => :stale_days)))
    FROM stale_versions s WHERE s.version IS NOT NULL AND (
    SELECT min(f.oldest) FROM stale_versions s CROSS JOIN LATERAL (
        SELECT min(COALESCE(analysed, '-infinity')) AS oldest FROM apps
        WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = s.version
          AND held_at IS NULL) f
) < now() - make_interval(days => :stale_days)
  UNION ALL
    SELECT d.version, (SELECT min(analysis_day(analysed)) FROM apps
                       WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND held_at IS NULL
                         AND COALESCE(analysisversion, 0) = d.version
                         AND analysis_day(analysed) > d.day
                         AND analysis_day(analysed) <= analysis_day(now() - make_interval(days => :stale_days)))
    FROM stale_days d WHERE d.day IS NOT NULL AND d.day < analysis_day(now() - make_interval(days => :stale_days))
),
head AS (
    -- The first queued or flagged (due) candidate in claim order: apps_claim_order.
    SELECT appid, app_popularity(details) AS popularity, added FROM apps
    WHERE (status = 'queued' OR due) AND (held_at IS NULL AND (
    status = 'queued'
    OR (status = 'processing' AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)) AND lease_attempts < :max_lease_attempts)
    OR ((status = 'analysed' OR (status = 'failed' AND failure_retryable))
        AND ((COALESCE(analysisversion, 0) < :analysis_version
              AND COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes))
             OR (COALESCE(analysisversion, 0) <= :analysis_version
                 AND COALESCE(analysed, '-infinity')
                     < now() - make_interval(days => :stale_days))))
))
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED
), bar AS (
    -- head's popularity, or below any (popularity is never negative) when there is none.
    SELECT COALESCE((SELECT popularity FROM head), -1) AS popularity
), version_heads AS (
    -- For each old version, its first unflagged row whose outdated analysis is a lease old.
    SELECT h.* FROM old_versions v CROSS JOIN LATERAL (
        SELECT appid, app_popularity(details) AS popularity, added FROM apps
        WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = v.version
          AND COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes) AND app_popularity(details) >= (SELECT popularity FROM bar) AND held_at IS NULL
        ORDER BY app_popularity(details) DESC, added, appid
        LIMIT 1 FOR UPDATE SKIP LOCKED
    ) h
), lease_heads AS (
    -- The first expired lease not flagged yet (normally none: the promoter flags them).
    SELECT appid, app_popularity(details) AS popularity, added FROM apps
    WHERE appid = ANY(ARRAY(SELECT appid FROM apps WHERE status = 'processing' AND NOT due AND lease_attempts < :max_lease_attempts AND processing_started IS NULL
    UNION ALL SELECT appid FROM apps WHERE status = 'processing' AND NOT due AND lease_attempts < :max_lease_attempts AND processing_started < now() - make_interval(mins => :timeout_minutes)
    UNION ALL SELECT appid FROM apps WHERE status = 'processing' AND NOT due AND lease_attempts < :max_lease_attempts AND processing_started > now() + make_interval(mins => :timeout_minutes))) AND NOT due AND (held_at IS NULL AND (
    status = 'queued'
    OR (status = 'processing' AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)) AND lease_attempts < :max_lease_attempts)
    OR ((status = 'analysed' OR (status = 'failed' AND failure_retryable))
        AND ((COALESCE(analysisversion, 0) < :analysis_version
              AND COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes))
             OR (COALESCE(analysisversion, 0) <= :analysis_version
                 AND COALESCE(analysed, '-infinity')
                     < now() - make_interval(days => :stale_days))))
)) AND app_popularity(details) >= (SELECT popularity FROM bar)
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED
), stale_heads AS (
    -- For each stale version and analysis day, its first unflagged row past the cutoff.
    SELECT h.* FROM stale_days d CROSS JOIN LATERAL (
        SELECT appid, app_popularity(details) AS popularity, added FROM apps
        WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = d.version
          AND analysis_day(analysed) = d.day
          AND COALESCE(analysed, '-infinity') < now() - make_interval(days => :stale_days) AND app_popularity(details) >= (SELECT popularity FROM bar)
          AND held_at IS NULL
        ORDER BY app_popularity(details) DESC, added, appid
        LIMIT 1 FOR UPDATE SKIP LOCKED
    ) h
), choice AS (
    -- The best of the heads: the most popular, then the first added. Nothing at all
    -- while claims are closed (a pause): a one-time filter, so no head is read.
    SELECT appid FROM (
        SELECT * FROM head UNION ALL SELECT * FROM version_heads
        UNION ALL SELECT * FROM lease_heads UNION ALL SELECT * FROM stale_heads
    ) c
    WHERE (NOT EXISTS (SELECT 1 FROM queue_pause WHERE paused_at IS NOT NULL)
    AND NOT EXISTS (SELECT 1 FROM analysers
                    WHERE name = CAST(:analyser AS text) AND paused_at IS NOT NULL))
    ORDER BY popularity DESC, added, appid
    LIMIT 1
)
-- Lease the chosen app to this claim's token.
UPDATE apps SET status = 'processing', processing_started = now(), due = false,
    analysis_claim_token = :token, claimed_by = :analyser, claimed_with = :token,
    refetch_requested = false, retry_due = false,
    lease_attempts = CASE WHEN apps.status = 'processing' THEN apps.lease_attempts + 1 ELSE 1 END
FROM choice WHERE apps.appid = choice.appid
RETURNING apps.appid
