
SELECT name, token_hash, previous_token_hash{columns} FROM {table}
WHERE revoked IS NULL
  AND (token_hash = :token_hash
       OR (previous_token_hash = :token_hash AND previous_token_expires > now()))
