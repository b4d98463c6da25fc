
SELECT count(*) FILTER (WHERE status = 'failed' AND failure_reason = 'lease_expired')
           AS lease_expired_failures,
       count(*) FILTER (WHERE status = 'processing' AND lease_attempts >= :max_lease_attempts
                        AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes))) AS abandoned_leases,
       count(*) FILTER (WHERE (status = 'analysed' OR (status = 'failed' AND failure_retryable))
                        AND COALESCE(analysisversion, 0) < :analysis_version
                        AND NOT COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes)) AS outdated_settling,
       count(*) FILTER (WHERE refetch_requested AND status = 'processing') AS refetch_waiting,
       count(*) FILTER (WHERE (held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) > now()
                        AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) <= now() + interval '1 hour') AS retries_next_hour,
       count(*) FILTER (WHERE (held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) > now()) AS retries_waiting,
       count(*) FILTER (WHERE (held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) IS NULL) AS retries_exhausted,
       count(*) FILTER (WHERE held_at IS NOT NULL) AS held_apps
FROM apps
