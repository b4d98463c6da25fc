
WITH RECURSIVE old_versions(version) AS (
    SELECT min(COALESCE(analysisversion, 0)) FROM apps
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) < :analysis_version
  UNION ALL
    SELECT (SELECT min(COALESCE(analysisversion, 0)) FROM apps
            WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
              AND COALESCE(analysisversion, 0) > v.version
              AND COALESCE(analysisversion, 0) < :analysis_version)
    FROM old_versions v WHERE v.version IS NOT NULL
), stale_versions(version) AS (
    SELECT min(COALESCE(analysisversion, 0)) FROM apps
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) <= :analysis_version
  UNION ALL
    SELECT (SELECT min(COALESCE(analysisversion, 0)) FROM apps
            WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
              AND COALESCE(analysisversion, 0) > v.version
              AND COALESCE(analysisversion, 0) <= :analysis_version)
    FROM stale_versions v WHERE v.version IS NOT NULL
), stale_days(version, day) AS (
    SELECT s.version, (SELECT min(analysis_day(analysed)) FROM apps
                       WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
                         AND COALESCE(analysisversion, 0) = s.version
                         AND analysis_day(analysed) <= analysis_day(now() - make_interval(days => :stale_days)))
    FROM stale_versions s WHERE s.version IS NOT NULL AND (
    SELECT min(f.oldest) FROM stale_versions s CROSS JOIN LATERAL (
        SELECT min(COALESCE(analysed, '-infinity')) AS oldest FROM apps
        WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = s.version) f
) < now() - make_interval(days => :stale_days)
  UNION ALL
    SELECT d.version, (SELECT min(analysis_day(analysed)) FROM apps
                       WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable))
                         AND COALESCE(analysisversion, 0) = d.version
                         AND analysis_day(analysed) > d.day
                         AND analysis_day(analysed) <= analysis_day(now() - make_interval(days => :stale_days)))
    FROM stale_days d WHERE d.day IS NOT NULL AND d.day < analysis_day(now() - make_interval(days => :stale_days))
),
head AS (
    SELECT appid, app_popularity(details) AS popularity, added FROM apps
    WHERE (status = 'queued' OR due) AND (
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
)
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED
), version_heads AS (
    SELECT h.* FROM old_versions v CROSS JOIN LATERAL (
        SELECT appid, app_popularity(details) AS popularity, added FROM apps
        WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = v.version
          AND COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes)
        ORDER BY app_popularity(details) DESC, added, appid
        LIMIT 1 FOR UPDATE SKIP LOCKED
    ) h
), lease_heads AS (
    SELECT appid, app_popularity(details) AS popularity, added FROM apps
    WHERE status = 'processing' AND NOT due AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes))
      AND lease_attempts < :max_lease_attempts
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED
), stale_heads AS (
    SELECT h.* FROM stale_days d CROSS JOIN LATERAL (
        SELECT appid, app_popularity(details) AS popularity, added FROM apps
        WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = d.version
          AND analysis_day(analysed) = d.day
          AND COALESCE(analysed, '-infinity') < now() - make_interval(days => :stale_days)
        ORDER BY app_popularity(details) DESC, added, appid
        LIMIT 1 FOR UPDATE SKIP LOCKED
    ) h
), choice AS (
    SELECT appid FROM (
        SELECT * FROM head UNION ALL SELECT * FROM version_heads
        UNION ALL SELECT * FROM lease_heads UNION ALL SELECT * FROM stale_heads
    ) c
    ORDER BY popularity DESC, added, appid
    LIMIT 1
)
UPDATE apps SET status = 'processing', processing_started = now(), due = false,
    analysis_claim_token = :token, claimed_by = :analyser, claimed_with = :token,
    refetch_requested = false,
    lease_attempts = CASE WHEN apps.status = 'processing' THEN apps.lease_attempts + 1 ELSE 1 END
FROM choice WHERE apps.appid = choice.appid
RETURNING apps.appid
