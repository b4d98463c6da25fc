
SELECT failure_reason AS reason, count(*) AS apps FROM apps WHERE status = 'failed' GROUP BY 1
