
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
), flagged AS (
    UPDATE apps SET due = true
    WHERE appid = ANY(ARRAY(
        SELECT r.appid FROM stale_versions s CROSS JOIN LATERAL (
            SELECT appid FROM apps
            WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable)) AND COALESCE(analysisversion, 0) = s.version
              AND COALESCE(analysed, '-infinity')
                  < now() - make_interval(days => :stale_days) + make_interval(secs => :horizon_seconds)
              AND held_at IS NULL
            ORDER BY COALESCE(analysed, '-infinity')
            LIMIT :batch FOR UPDATE SKIP LOCKED) r
        LIMIT :batch))
    RETURNING 1
)
SELECT count(*) AS flagged FROM flagged
