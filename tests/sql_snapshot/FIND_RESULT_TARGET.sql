
SELECT appid, status, analysisversion, analysis IS NOT NULL AS has_result,
       NOT COALESCE(analysis->'success' = 'false'::jsonb, false) AS stored_success,
       analysis_claim_token, result_claim_token, result_claim_verified, refetch_requested,
       COALESCE(analysis->>'analysis_source' = 'queue-server'
       AND analysis->>'reason' = 'lease_expired' AND analysed_by IS NULL, false) AS server_record,
       CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END AS claim_holder, CASE WHEN octet_length(details::text) <= :document_limit THEN details::text END AS details,
       octet_length(details::text) AS details_bytes, analysed
FROM apps WHERE lower(appid) = lower(:appid) FOR UPDATE
