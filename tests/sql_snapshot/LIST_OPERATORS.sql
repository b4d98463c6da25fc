
SELECT name, read_only, created, created_by, rotated, revoked,
       CASE WHEN previous_token_expires > now() THEN previous_token_expires END
           AS previous_token_expires
FROM operators ORDER BY name
