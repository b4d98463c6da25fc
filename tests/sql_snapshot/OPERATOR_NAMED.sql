
SELECT name, read_only FROM operators WHERE name = :name AND revoked IS NULL
