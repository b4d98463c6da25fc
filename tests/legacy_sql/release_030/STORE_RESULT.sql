
WITH sent AS MATERIALIZED (SELECT CAST(:analysis AS jsonb) AS document)
UPDATE apps SET analysis = sent.document, analysisversion = :version,
                analysed = now(), status = :status, failure_reason = :failure_reason,
                failure_retryable = :failure_retryable, processing_started = NULL,
                analysis_claim_token = NULL, due = false, lease_attempts = 0,
                result_claim_token = :result_claim, result_claim_verified = :verified,
                refetch_requested = false, analysed_by = :analyser
FROM sent
WHERE apps.appid = :appid AND NOT (:unless_stored AND COALESCE(apps.analysis = sent.document
             AND apps.analysisversion IS NOT DISTINCT FROM :version, false))
RETURNING apps.appid, CASE WHEN octet_length(apps.details::text) <= :document_limit THEN apps.details::text END AS details,
       octet_length(apps.details::text) AS details_bytes, apps.analysed
