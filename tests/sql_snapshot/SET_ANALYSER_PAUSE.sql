
WITH found AS (
    SELECT name, paused_at IS NOT NULL AS was_paused FROM analysers
    WHERE name = :name FOR UPDATE
), changed AS (
    UPDATE analysers
    SET paused_at = CASE WHEN :paused THEN now() END,
        paused_by = CASE WHEN :paused THEN CAST(:actor AS text) END,
        failure_streak = CASE WHEN :paused THEN analysers.failure_streak ELSE 0 END,
        failing_since = analysers.failing_since
    FROM found WHERE analysers.name = found.name AND found.was_paused <> :paused
    RETURNING analysers.name
)
SELECT name, was_paused FROM found
