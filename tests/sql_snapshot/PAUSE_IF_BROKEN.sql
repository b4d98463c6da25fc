
UPDATE analysers a SET paused_at = now(), paused_by = :actor
WHERE a.name = :name AND a.paused_at IS NULL AND (a.revoked IS NULL AND a.failure_streak >= :broken_failures
    AND EXISTS (SELECT 1 FROM app_analyses h
                WHERE h.analysisversion = :analysis_version AND h.analysed >= a.failing_since
                  AND h.success AND h.analyser IS DISTINCT FROM a.name))
RETURNING a.name, a.failure_streak
