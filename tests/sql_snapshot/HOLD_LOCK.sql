
SELECT appid, held_at, held_by, hold_reason,
       CASE WHEN status = 'processing' AND :force THEN 'lease_broken'
            WHEN status = 'processing' AND NOT (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))
     OR processing_started > now() + make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))) THEN 'waiting'
            ELSE 'held' END AS outcome,
       status = 'processing' AND (:force OR NOT (status = 'processing' AND NOT (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))
     OR processing_started > now() + make_interval(mins => GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0)))))) AS ends_lease
FROM apps WHERE lower(appid) = lower(:appid)
FOR UPDATE
