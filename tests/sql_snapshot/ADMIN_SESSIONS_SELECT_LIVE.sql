
SELECT s.operator, COALESCE(o.read_only, false) AS read_only
FROM admin_sessions s LEFT JOIN operators o ON o.name = s.operator
WHERE s.id_hash = :id_hash AND s.ended IS NULL AND s.expires > now()
  AND (s.operator IS NULL
       OR (o.name IS NOT NULL AND o.revoked IS NULL
           AND s.created >= COALESCE(o.rotated, '-infinity')))
