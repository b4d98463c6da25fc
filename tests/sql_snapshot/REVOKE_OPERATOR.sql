
WITH found AS (
    SELECT name, revoked IS NULL AS revoked_now FROM operators WHERE name = :name FOR UPDATE
), revoked AS (
    UPDATE operators SET revoked = COALESCE(revoked, now()), previous_token_hash = NULL,
                         previous_token_expires = NULL
    FROM found WHERE operators.name = found.name
    RETURNING operators.name, operators.revoked
)
SELECT revoked.name, revoked.revoked, found.revoked_now
FROM found JOIN revoked ON revoked.name = found.name
