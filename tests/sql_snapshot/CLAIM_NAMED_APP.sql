
UPDATE apps SET status = 'processing', processing_started = now(), due = false,
    analysis_claim_token = :token, claimed_by = :analyser, claimed_with = :token,
    refetch_requested = false, retry_due = false,
    lease_attempts = CASE WHEN apps.status = 'processing' THEN apps.lease_attempts + 1 ELSE 1 END
WHERE appid = (
    SELECT appid FROM apps
    WHERE lower(appid) = lower(:appid) AND ((held_at IS NULL AND (
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
)) OR ((held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) <= now())) AND (NOT EXISTS (SELECT 1 FROM queue_pause WHERE paused_at IS NOT NULL)
    AND NOT EXISTS (SELECT 1 FROM analysers
                    WHERE name = CAST(:analyser AS text) AND paused_at IS NOT NULL))
    FOR UPDATE SKIP LOCKED)
RETURNING appid
