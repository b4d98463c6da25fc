
SELECT appid, CASE WHEN octet_length(rendered.details_text) <= :document_limit THEN rendered.details_text END AS details,
       octet_length(rendered.details_text) AS details_bytes,
       CASE WHEN octet_length(rendered.analysis_text) <= :document_limit THEN rendered.analysis_text END AS analysis,
       octet_length(rendered.analysis_text) AS analysis_bytes,
       analysisversion, analysed, added, status, processing_started, failure_reason,
       failure_retryable, analysis_claim_token, app_popularity(details) AS popularity,
       COALESCE(analysis->'success' = 'false'::jsonb, false) AS failure_record, CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END AS claim_holder, analysed_by
FROM apps CROSS JOIN LATERAL (
    SELECT details::text AS details_text, analysis::text AS analysis_text OFFSET 0) AS rendered
WHERE lower(appid) = lower(:appid)
