
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
