
WITH flagged AS (
    UPDATE apps SET due = true
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps
        WHERE status = 'processing' AND NOT due AND held_at IS NULL
          AND ((processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes))
               OR processing_started < now() - make_interval(mins => :timeout_minutes) + make_interval(secs => :horizon_seconds))
          AND lease_attempts < :max_lease_attempts
        LIMIT :batch FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) AS flagged FROM flagged
