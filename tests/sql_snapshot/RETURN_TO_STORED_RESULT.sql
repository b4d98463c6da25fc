
UPDATE apps SET status = CASE WHEN apps.refetch_requested THEN 'queued' ELSE e.status END,
    failure_reason = CASE WHEN apps.refetch_requested THEN NULL ELSE e.failure_reason END,
    failure_retryable = CASE WHEN apps.refetch_requested THEN NULL ELSE e.failure_retryable END,
    processing_started = NULL, analysis_claim_token = NULL, due = false, lease_attempts = 0,
    refetch_requested = false,
    failure_streak = CASE WHEN apps.refetch_requested THEN 0
                          WHEN e.status = 'failed' THEN GREATEST(apps.failure_streak, 1)
                          ELSE apps.failure_streak END
FROM jsonb_to_recordset(CAST(:ended AS jsonb))
     AS e(appid text, status text, failure_reason text, failure_retryable boolean)
WHERE apps.appid = e.appid AND apps.status = 'processing'
RETURNING apps.appid
