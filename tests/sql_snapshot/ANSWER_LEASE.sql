
UPDATE apps SET lease_attempts = 0 WHERE appid = :appid AND status = 'processing'
