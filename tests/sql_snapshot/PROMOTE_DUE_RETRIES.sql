
WITH flagged AS (
    UPDATE apps SET retry_due = true
    WHERE appid = ANY(ARRAY(
        SELECT r.appid FROM generate_subscripts(CAST(:retry_backoff AS integer[]), 1) s
        CROSS JOIN LATERAL (
            SELECT appid FROM apps
            WHERE (held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND NOT retry_due AND GREATEST(failure_streak, 1) = s
              AND analysed < now() + make_interval(secs => :horizon_seconds)
                             - make_interval(secs => (CAST(:retry_backoff AS integer[]))[s])
            ORDER BY analysed
            LIMIT :batch FOR UPDATE SKIP LOCKED) r
        LIMIT :batch))
    RETURNING 1
)
SELECT count(*) AS flagged FROM flagged
