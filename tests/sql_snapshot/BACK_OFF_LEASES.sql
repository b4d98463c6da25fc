
SELECT appid, status, analysisversion, analysis IS NOT NULL AS has_result,
       NOT COALESCE(analysis->'success' = 'false'::jsonb, false) AS stored_success,
       analysis_claim_token, result_claim_token, result_claim_verified, refetch_requested,
       COALESCE(analysis->>'analysis_source' = 'queue-server'
       AND analysis->>'reason' = 'lease_expired' AND analysed_by IS NULL, false) AS server_record, held_at IS NOT NULL AS held
FROM apps
WHERE status = 'processing' AND (processing_started IS NULL
     OR processing_started < now() - make_interval(mins => :timeout_minutes)
     OR processing_started > now() + make_interval(mins => :timeout_minutes)) AND NOT refetch_requested
  AND (lease_attempts >= :max_lease_attempts OR held_at IS NOT NULL)
LIMIT :batch FOR UPDATE SKIP LOCKED
