
SELECT appid, analysis IS NULL AS no_result,
       COALESCE(analysis->'success' = 'false'::jsonb, false) AS failure_record,
       COALESCE(analysis->>'analysis_source' = 'queue-server'
       AND analysis->>'reason' = 'lease_expired' AND analysed_by IS NULL, false) AS server_record,
       CASE WHEN jsonb_typeof(analysis->'reason') = 'string'
            THEN analysis->>'reason' END AS reason,
       CASE WHEN jsonb_typeof(analysis->'retryable') = 'boolean'
            THEN (analysis->'retryable')::boolean END AS retryable,
       CASE WHEN jsonb_typeof(analysis->'logs') = 'string'
             AND NOT COALESCE(jsonb_typeof(analysis->'reason') = 'string'
                              AND analysis->>'reason' <> '', false)
            THEN analysis->>'logs' END AS logs
FROM apps WHERE appid = ANY(CAST(:appids AS text[]))
