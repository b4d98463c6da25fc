
WITH choice AS (SELECT appid FROM apps
    WHERE retry_due AND CASE WHEN ((held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) <= now()) THEN true ELSE false END
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED)
UPDATE apps SET status = 'processing', processing_started = now(), due = false,
    analysis_claim_token = :token, claimed_by = :analyser, claimed_with = :token,
    refetch_requested = false, retry_due = false,
    lease_attempts = CASE WHEN apps.status = 'processing' THEN apps.lease_attempts + 1 ELSE 1 END
FROM choice WHERE apps.appid = choice.appid AND (NOT EXISTS (SELECT 1 FROM queue_pause WHERE paused_at IS NOT NULL)
    AND NOT EXISTS (SELECT 1 FROM analysers
                    WHERE name = CAST(:analyser AS text) AND paused_at IS NOT NULL))
RETURNING apps.appid
