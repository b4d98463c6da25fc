
UPDATE queue_policy
SET analysis_version = :analysis_version, stale_days = :stale_days,
    processing_timeout_minutes = :timeout_minutes, retry_backoff = :retry_policy,
    applied = now()
WHERE singleton = (SELECT singleton FROM queue_policy FOR UPDATE SKIP LOCKED)
RETURNING 1
