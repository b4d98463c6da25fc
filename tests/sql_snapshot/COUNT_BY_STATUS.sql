
SELECT status, count(*) AS apps, count(*) FILTER (WHERE failure_retryable) AS retryable
FROM apps GROUP BY status
