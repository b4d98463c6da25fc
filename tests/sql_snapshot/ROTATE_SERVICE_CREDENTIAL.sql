
INSERT INTO service_credentials AS c (name, token_hash, previous_token_hash,
                                      previous_token_expires, chosen_by_person, set_by,
                                      session_key)
VALUES (:name, :token_hash, CAST(:configured_hash AS bytea),
        now() + make_interval(secs => :overlap_seconds), false, :set_by, :session_key)
ON CONFLICT (name) DO UPDATE SET
    previous_token_hash = c.token_hash, previous_token_expires = EXCLUDED.previous_token_expires,
    token_hash = EXCLUDED.token_hash, chosen_by_person = false, set_at = now(),
    set_by = EXCLUDED.set_by, session_key = EXCLUDED.session_key
RETURNING set_at,
    CASE WHEN previous_token_hash IS NOT NULL AND previous_token_expires > now()
         THEN previous_token_expires END AS previous_token_expires
