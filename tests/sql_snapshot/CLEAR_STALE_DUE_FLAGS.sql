
WITH examined AS (
    SELECT appid FROM apps WHERE due AND appid > :after ORDER BY appid LIMIT :batch
), cleared AS (
    UPDATE apps SET due = false
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps
        WHERE appid IN (SELECT appid FROM examined)
          AND due AND status <> 'queued' AND NOT (held_at IS NULL AND (
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
          AND NOT (status = 'processing' AND NOT (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)))
        FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT (SELECT count(*) FROM examined) AS examined, (SELECT max(appid) FROM examined) AS last,
       (SELECT count(*) FROM cleared) AS cleared
