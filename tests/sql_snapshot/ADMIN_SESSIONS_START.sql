
INSERT INTO admin_sessions (id_hash, expires, source, operator)
SELECT :id_hash, now() + make_interval(hours => :hours), :source, CAST(:operator AS text)
WHERE :accepted
