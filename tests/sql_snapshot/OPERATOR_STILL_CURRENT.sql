
SELECT 1 FROM operators
WHERE name = :name AND token_hash = :token_hash AND revoked IS NULL
FOR SHARE
