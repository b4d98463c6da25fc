
SELECT name, token_hash, previous_token_hash, read_only FROM operators
WHERE revoked IS NULL
  AND (token_hash = :token_hash
       OR (previous_token_hash = :token_hash AND previous_token_expires > now()))
