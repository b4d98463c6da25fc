
SELECT a.name, a.created, a.rotated, a.revoked, a.last_seen, a.previous_token_expires,
       a.paused_at, a.paused_by, a.failure_streak, a.failing_since,
       (a.revoked IS NULL AND a.failure_streak >= :broken_failures
    AND EXISTS (SELECT 1 FROM app_analyses h
                WHERE h.analysisversion = :analysis_version AND h.analysed >= a.failing_since
                  AND h.success AND h.analyser IS DISTINCT FROM a.name)) AS broken,
       a.revoked IS NULL AND (a.last_seen > now() - interval '1 hour' AND a.last_seen <= now()) AS online,
       a.last_result_app, a.last_result_at, a.last_result_success, a.last_result_version,
       a.last_result_version < :analysis_version AS outdated_version,
       held.appid AS holding, held.processing_started AS holding_since,
       held.processing_started + make_interval(mins => :timeout_minutes) AS holding_until,
       COALESCE(day.results, 0) AS results_24h, COALESCE(day.failures, 0) AS failures_24h
FROM analysers a
LEFT JOIN LATERAL (
    SELECT appid, processing_started FROM apps
    WHERE status = 'processing' AND claimed_by = a.name AND CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END = a.name
    ORDER BY processing_started DESC LIMIT 1
) held ON true
LEFT JOIN (
    SELECT analyser, count(*) FILTER (WHERE success) AS results,
           count(*) FILTER (WHERE NOT success) AS failures
    FROM app_analyses WHERE analysed > now() - interval '24 hours' AND analyser IS NOT NULL
    GROUP BY analyser
) day ON day.analyser = a.name
ORDER BY a.name
