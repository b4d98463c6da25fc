
WITH started AS (
    INSERT INTO admin_sessions (id_hash, expires, source)
    SELECT :id_hash, now() + make_interval(hours => :hours), :source WHERE :accepted
    RETURNING 1
)
INSERT INTO operator_actions (actor, source, action)
VALUES (:actor, :source, CASE WHEN :accepted THEN 'sign-in' ELSE 'sign-in refused' END)
