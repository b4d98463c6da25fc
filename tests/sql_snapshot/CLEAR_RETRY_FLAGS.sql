
WITH cleared AS (
    UPDATE apps SET retry_due = false
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps WHERE retry_due LIMIT :batch FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) AS flagged FROM cleared
