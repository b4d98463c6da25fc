
SELECT * FROM (
    (SELECT appid, lower(appid) COLLATE "C" AS sort_key, status, failure_reason,
       failure_retryable, analysisversion, analysed, processing_started,
       CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END AS claim_holder, app_popularity(details) AS popularity, added
     FROM apps WHERE status <> 'processing' AND ((CAST(:after AS text) IS NULL OR lower(appid) COLLATE "C" > :after)
  AND (:prefix = '' OR lower(appid) COLLATE "C" >= :prefix
                         AND lower(appid) COLLATE "C" < :prefix_end)
  AND (CAST(:state AS text) IS NULL OR status = :state)
  AND (CAST(:reason AS text) IS NULL OR status = 'failed' AND failure_reason = :reason))
     ORDER BY lower(appid) COLLATE "C" LIMIT :limit)
  UNION ALL
    (SELECT appid, lower(appid) COLLATE "C" AS sort_key, status, failure_reason,
       failure_retryable, analysisversion, analysed, processing_started,
       CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END AS claim_holder, app_popularity(details) AS popularity, added
     FROM apps WHERE status = 'processing' AND ((CAST(:after AS text) IS NULL OR lower(appid) COLLATE "C" > :after)
  AND (:prefix = '' OR lower(appid) COLLATE "C" >= :prefix
                         AND lower(appid) COLLATE "C" < :prefix_end)
  AND (CAST(:state AS text) IS NULL OR status = :state)
  AND (CAST(:reason AS text) IS NULL OR status = 'failed' AND failure_reason = :reason))
     ORDER BY lower(appid) COLLATE "C" LIMIT :limit)
) AS ordered
ORDER BY sort_key LIMIT :limit
