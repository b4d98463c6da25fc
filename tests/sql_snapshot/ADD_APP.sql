
INSERT INTO apps (appid, details)
VALUES (:appid, NULLIF(CAST(:body AS jsonb) -> 'details', 'null'::jsonb))
ON CONFLICT DO NOTHING
RETURNING appid
