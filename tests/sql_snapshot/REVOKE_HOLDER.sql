
WITH found AS (
    SELECT name, revoked IS NULL AS revoked_now FROM {table} WHERE name = :name FOR UPDATE
), revoked AS (
    UPDATE {table} SET revoked = COALESCE(revoked, now()), previous_token_hash = NULL,
                         previous_token_expires = NULL
    FROM found WHERE {table}.name = found.name
    RETURNING {table}.name, {table}.revoked
)
SELECT revoked.name, revoked.revoked, found.revoked_now
FROM found JOIN revoked ON revoked.name = found.name
