
UPDATE analysers SET last_seen = now() WHERE name = :name AND revoked IS NULL
