
WITH requeued AS (
    UPDATE apps SET status = 'queued', processing_started = NULL, analysis_claim_token = NULL,
                    due = false, lease_attempts = 0, refetch_requested = false,
                    failure_streak = 0
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps
        WHERE status = 'processing' AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)) AND refetch_requested
          AND (lease_attempts >= :max_lease_attempts OR held_at IS NOT NULL)
        LIMIT :batch FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) AS flagged FROM requeued
