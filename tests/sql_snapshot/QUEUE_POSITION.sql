
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
)
SELECT
    (SELECT count(*) FROM (
        (SELECT 1 FROM apps WHERE (status = 'queued' OR due) AND (held_at IS NULL AND (
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
)) AND app_popularity(details) > :popularity
     ORDER BY app_popularity(details) DESC, added, appid LIMIT :limit)
    UNION ALL
    (SELECT 1 FROM apps WHERE (status = 'queued' OR due) AND (held_at IS NULL AND (
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
)) AND app_popularity(details) = :popularity
       AND (added, appid) < (:added, :appid)
     ORDER BY app_popularity(details) DESC, added, appid LIMIT :limit)
        UNION ALL
        (SELECT 1 FROM apps WHERE appid = ANY(ARRAY(SELECT appid FROM apps WHERE status = 'processing' AND NOT due AND lease_attempts < :max_lease_attempts AND processing_started IS NULL
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
)) AND app_popularity(details) > :popularity
     ORDER BY app_popularity(details) DESC, added, appid LIMIT :limit)
    UNION ALL
    (SELECT 1 FROM apps WHERE appid = ANY(ARRAY(SELECT appid FROM apps WHERE status = 'processing' AND NOT due AND lease_attempts < :max_lease_attempts AND processing_started IS NULL
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
)) AND app_popularity(details) = :popularity
       AND (added, appid) < (:added, :appid)
     ORDER BY app_popularity(details) DESC, added, appid LIMIT :limit)
        UNION ALL
        (SELECT 1 FROM old_versions v CROSS JOIN LATERAL (
            (SELECT 1 FROM apps WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = v.version
    AND COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes) AND held_at IS NULL AND app_popularity(details) > :popularity
     ORDER BY COALESCE(analysisversion, 0), app_popularity(details) DESC, added, appid LIMIT :limit)
    UNION ALL
    (SELECT 1 FROM apps WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = v.version
    AND COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes) AND held_at IS NULL AND app_popularity(details) = :popularity
       AND (added, appid) < (:added, :appid)
     ORDER BY COALESCE(analysisversion, 0), app_popularity(details) DESC, added, appid LIMIT :limit)) x
         WHERE v.version IS NOT NULL)
        LIMIT :limit) ahead),
    (
    SELECT min(f.oldest) FROM stale_versions s CROSS JOIN LATERAL (
        SELECT min(COALESCE(analysed, '-infinity')) AS oldest FROM apps
        WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = s.version
          AND held_at IS NULL) f
) < now() - make_interval(days => :stale_days)
