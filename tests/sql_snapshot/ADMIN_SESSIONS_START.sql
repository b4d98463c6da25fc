
INSERT INTO admin_sessions (id_hash, expires, source)
SELECT :id_hash, now() + make_interval(hours => :hours), :source WHERE :accepted
