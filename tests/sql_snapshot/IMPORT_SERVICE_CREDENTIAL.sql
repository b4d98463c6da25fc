
INSERT INTO service_credentials (name, token_hash, chosen_by_person, set_by, session_key)
VALUES (:name, :token_hash, true, :set_by, :session_key)
ON CONFLICT (name) DO NOTHING
RETURNING set_at
