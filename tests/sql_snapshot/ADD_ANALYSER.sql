
INSERT INTO analysers (name, token_hash) VALUES (:name, :token_hash)
ON CONFLICT DO NOTHING
RETURNING name, created
