
WITH scanned AS (
SELECT * FROM (
    (SELECT appid, lower(appid) COLLATE "C" AS sort_key, status, failure_reason
     FROM apps WHERE status <> 'processing' AND ((CAST(:after AS text) IS NULL OR lower(appid) COLLATE "C" > :after)
  AND (:prefix = '' OR lower(appid) COLLATE "C" >= :prefix
                         AND lower(appid) COLLATE "C" < :prefix_end))
     ORDER BY lower(appid) COLLATE "C" LIMIT :scan)
  UNION ALL
    (SELECT appid, lower(appid) COLLATE "C" AS sort_key, status, failure_reason
     FROM apps WHERE status = 'processing' AND ((CAST(:after AS text) IS NULL OR lower(appid) COLLATE "C" > :after)
  AND (:prefix = '' OR lower(appid) COLLATE "C" >= :prefix
                         AND lower(appid) COLLATE "C" < :prefix_end))
     ORDER BY lower(appid) COLLATE "C" LIMIT :scan)
) AS ordered
ORDER BY sort_key LIMIT :scan
), matched AS (
    SELECT appid, sort_key FROM scanned
    WHERE strpos(sort_key, :contains) > 0
      AND (CAST(:state AS text) IS NULL OR status = :state)
      AND (CAST(:reason AS text) IS NULL OR status = 'failed' AND failure_reason = :reason)
    ORDER BY sort_key
    LIMIT :limit
)
SELECT a.appid, m.sort_key, a.status, a.failure_reason, a.failure_retryable,
       a.analysisversion, a.analysed, a.processing_started,
       CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END AS claim_holder,
       app_popularity(a.details) AS popularity, a.added, ends.scanned_to, ends.scanned
FROM (SELECT max(sort_key) AS scanned_to, count(*) AS scanned FROM scanned) AS ends
LEFT JOIN (matched AS m JOIN apps AS a ON a.appid = m.appid) ON true
ORDER BY m.sort_key
