
SELECT 1 FROM admin_sessions WHERE id_hash = :id_hash AND ended IS NULL AND expires > now()
