
SELECT name, chosen_by_person, set_at, set_by,
       CASE WHEN previous_token_expires > now() THEN previous_token_expires END
           AS previous_token_expires
FROM service_credentials
