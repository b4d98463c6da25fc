
SELECT appid, status, (status = 'failed' AND (failure_retryable OR :include_non_retryable)
  AND (failure_reason IS DISTINCT FROM 'invalid_bundle_id' OR CAST(:failed_by AS text) IS NOT NULL)
  AND (CAST(:reason AS text) IS NULL OR failure_reason = :reason) AND (:prefix = '' OR lower(appid) COLLATE "C" >= :prefix
                         AND lower(appid) COLLATE "C" < :prefix_end)
  AND (CAST(:failed_by AS text) IS NULL
       OR analysed_by = :failed_by
          AND analysed >= COALESCE(CAST(:since AS timestamptz), '-infinity'))
  AND length(appid) BETWEEN 1 AND 255
  AND appid ~ '^[A-Za-z0-9][A-Za-z0-9.-]*$' AND appid !~ '\.$') AS selected, CASE
    WHEN status = 'processing' AND :force THEN 'lease_broken'
    WHEN status = 'processing' AND NOT (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))
     OR processing_started > now() + make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))) THEN 'waiting'
    ELSE 'queued'
END AS outcome FROM apps
WHERE appid > :after ORDER BY appid LIMIT :batch
