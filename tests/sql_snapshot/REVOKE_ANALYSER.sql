
WITH found AS (
    SELECT name, revoked IS NULL AS revoked_now FROM analysers WHERE name = :name FOR UPDATE
), revoked AS (
    UPDATE analysers SET revoked = COALESCE(revoked, now()), previous_token_hash = NULL,
                         previous_token_expires = NULL
    FROM found WHERE analysers.name = found.name
    RETURNING analysers.name, analysers.revoked
)
SELECT revoked.name, revoked.revoked, found.revoked_now
FROM found JOIN revoked ON revoked.name = found.name
