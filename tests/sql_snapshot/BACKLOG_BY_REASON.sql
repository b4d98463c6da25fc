
SELECT CASE
    WHEN status = 'queued' THEN 'queued'
    WHEN status = 'processing' THEN 'lease_expired'
    WHEN status = 'failed' THEN 'retry_failed'
    WHEN COALESCE(analysisversion, 0) < :analysis_version THEN 'outdated_version'
    ELSE 'stale'
END AS reason, count(*) AS apps FROM apps WHERE (
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
) GROUP BY 1
