
INSERT INTO service_credentials AS c (name, token_hash, chosen_by_person, set_by, session_key)
VALUES (:name, :token_hash, false, :set_by, :session_key)
ON CONFLICT (name) DO UPDATE SET
    previous_token_hash = CASE WHEN :overlap_seconds > 0 THEN c.token_hash END,
    previous_token_expires = CASE WHEN :overlap_seconds > 0
                                  THEN now() + make_interval(secs => :overlap_seconds) END,
    token_hash = EXCLUDED.token_hash, chosen_by_person = false, set_at = now(),
    set_by = EXCLUDED.set_by, session_key = EXCLUDED.session_key
RETURNING set_at, previous_token_expires
