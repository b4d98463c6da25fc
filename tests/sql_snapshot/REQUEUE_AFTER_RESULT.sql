
UPDATE apps SET status = 'queued', failure_reason = NULL, failure_retryable = NULL, due = false,
                refetch_requested = true
WHERE appid = :appid
