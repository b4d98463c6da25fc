
UPDATE admin_sessions SET ended = now()
WHERE id_hash = :id_hash AND ended IS NULL AND expires > now()
RETURNING 1
