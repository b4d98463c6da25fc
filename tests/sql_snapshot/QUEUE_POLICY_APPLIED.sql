
SELECT (analysis_version, stale_days, processing_timeout_minutes, retry_backoff)
       IS NOT DISTINCT FROM (:analysis_version, :stale_days, :timeout_minutes, :retry_policy)
FROM queue_policy
