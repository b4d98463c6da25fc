
SELECT appid, processing_started, lease_attempts, refetch_requested,
       CASE WHEN isfinite(processing_started)
            THEN extract(epoch FROM now() - processing_started) / 60 END AS age_minutes,
       (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)) AS expired
FROM apps WHERE status = 'processing'
ORDER BY processing_started
LIMIT :limit
