
WITH found AS (
    SELECT name, paused_at IS NOT NULL AS was_paused FROM analysers
    WHERE name = :name FOR UPDATE
), paused AS (
    UPDATE analysers SET paused_at = now(), paused_by = :actor
    FROM found WHERE analysers.name = found.name AND NOT found.was_paused
    RETURNING analysers.name
)
SELECT name, was_paused FROM found
