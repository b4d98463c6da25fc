
UPDATE apps SET status = 'queued', failure_reason = NULL, failure_retryable = NULL, due = false,
                refetch_requested = true, failure_streak = 0, retry_due = false
WHERE appid = :appid
