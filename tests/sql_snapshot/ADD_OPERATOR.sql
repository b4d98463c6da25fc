
INSERT INTO operators (name, token_hash, read_only, created_by)
VALUES (:name, :token_hash, :read_only, :created_by)
ON CONFLICT DO NOTHING
RETURNING name, created, read_only
