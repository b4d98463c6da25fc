
SELECT token_hash, session_key,
       CASE WHEN previous_token_expires > now() THEN previous_token_hash END
           AS previous_token_hash
FROM service_credentials WHERE name = :name
