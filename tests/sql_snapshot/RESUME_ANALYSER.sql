
WITH found AS (
    SELECT name, paused_at IS NOT NULL AS was_paused FROM analysers
    WHERE name = :name FOR UPDATE
), resumed AS (
    UPDATE analysers SET paused_at = NULL, paused_by = NULL, failure_streak = 0,
                         failing_since = NULL
    FROM found WHERE analysers.name = found.name AND found.was_paused
    RETURNING analysers.name
)
SELECT name, was_paused FROM found
