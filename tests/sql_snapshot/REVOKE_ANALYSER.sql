
UPDATE analysers SET revoked = COALESCE(revoked, now()), previous_token_hash = NULL,
                     previous_token_expires = NULL
WHERE name = :name
RETURNING name, revoked
