
INSERT INTO admin_sessions (id_hash, expires, source)
VALUES (:id_hash, now() + make_interval(hours => :hours), :source)
