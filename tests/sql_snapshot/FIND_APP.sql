
SELECT appid, CASE WHEN octet_length(details::text) <= :document_limit THEN details::text END AS details,
       octet_length(details::text) AS details_bytes, CASE WHEN octet_length(analysis::text) <= :document_limit THEN analysis::text END AS analysis,
       octet_length(analysis::text) AS analysis_bytes,
       analysisversion, analysed, added, status, processing_started, failure_reason,
       failure_retryable, analysis_claim_token, app_popularity(details) AS popularity,
       COALESCE(analysis->'success' = 'false'::jsonb, false) AS failure_record, CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END AS claim_holder, analysed_by
FROM apps WHERE lower(appid) = lower(:appid)
