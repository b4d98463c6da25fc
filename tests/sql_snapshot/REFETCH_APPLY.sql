
WITH requeued AS (
    UPDATE apps SET status = 'queued', processing_started = NULL, failure_reason = NULL,
                    failure_retryable = NULL, analysis_claim_token = NULL, due = false,
                    refetch_requested = false, lease_attempts = 0,
                    result_claim_verified = true, failure_streak = 0, retry_due = false
    WHERE appid = ANY(CAST(:requeue AS text[]))
    RETURNING 1
), deferred AS (
    UPDATE apps SET refetch_requested = true WHERE appid = ANY(CAST(:wait AS text[]))
    RETURNING 1
)
SELECT (SELECT count(*) FROM requeued) AS requeued, (SELECT count(*) FROM deferred) AS deferred
