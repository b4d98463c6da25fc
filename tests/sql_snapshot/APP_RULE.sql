
SELECT (held_at IS NULL AND (
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
)) AS candidate, ((held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) <= now()) AS retry_due_now, (held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AS retryable_now,
       status = 'processing' AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)) AS lease_over,
       lease_attempts, refetch_requested, COALESCE(analysisversion, 0) AS version,
       GREATEST(failure_streak, 1) AS failure_streak, analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) AS retry_at, held_at, held_by,
       hold_reason,
       (SELECT paused_at FROM queue_pause) AS queue_paused_at,
       processing_started + make_interval(mins => :timeout_minutes) AS lease_ends,
       COALESCE(analysed, '-infinity') + make_interval(mins => :timeout_minutes)
           AS outdated_due,
       COALESCE(analysed, '-infinity') + make_interval(days => :stale_days) AS stale_due
FROM apps WHERE lower(appid) = lower(:appid)
