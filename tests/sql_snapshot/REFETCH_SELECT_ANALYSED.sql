
SELECT appid, status, CASE
    WHEN status = 'processing' AND :force THEN 'lease_broken'
    WHEN status = 'processing' AND NOT (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))
     OR processing_started > now() + make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))) THEN 'waiting'
    ELSE 'queued'
END AS outcome FROM apps WHERE status = 'analysed' AND (:prefix = '' OR lower(appid) COLLATE "C" >= :prefix
                         AND lower(appid) COLLATE "C" < :prefix_end)
ORDER BY app_popularity(details) DESC, added, appid
LIMIT :limit
