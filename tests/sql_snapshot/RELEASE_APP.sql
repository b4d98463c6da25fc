
WITH found AS (
    SELECT appid, held_at IS NOT NULL AS was_held FROM apps
    WHERE lower(appid) = lower(:appid) FOR UPDATE
), released AS (
    UPDATE apps SET held_at = NULL, held_by = NULL, hold_reason = NULL
    FROM found WHERE apps.appid = found.appid AND found.was_held
    RETURNING apps.appid
)
SELECT appid, was_held FROM found
