
SELECT (
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
) AS candidate,
       status = 'processing' AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)) AS lease_over,
       lease_attempts, refetch_requested, COALESCE(analysisversion, 0) AS version,
       processing_started + make_interval(mins => :timeout_minutes) AS lease_ends,
       COALESCE(analysed, '-infinity') + make_interval(mins => :timeout_minutes)
           AS outdated_due,
       COALESCE(analysed, '-infinity') + make_interval(days => :stale_days) AS stale_due
FROM apps WHERE lower(appid) = lower(:appid)
