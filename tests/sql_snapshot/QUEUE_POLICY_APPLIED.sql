
SELECT (analysis_version, stale_days, processing_timeout_minutes)
       IS NOT DISTINCT FROM (:analysis_version, :stale_days, :timeout_minutes)
FROM queue_policy
