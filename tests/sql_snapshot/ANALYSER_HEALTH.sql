
SELECT count(*) FILTER (WHERE (a.revoked IS NULL AND a.failure_streak >= :broken_failures
    AND EXISTS (SELECT 1 FROM app_analyses h
                WHERE h.analysisversion = :analysis_version AND h.analysed >= a.failing_since
                  AND h.success AND h.analyser IS DISTINCT FROM a.name))) AS broken,
       count(*) FILTER (WHERE a.paused_at IS NOT NULL AND a.revoked IS NULL) AS paused
FROM analysers a
