
WITH sent AS MATERIALIZED (SELECT CAST(:analysis AS jsonb) AS document)
UPDATE apps SET analysis = sent.document, analysisversion = :version,
                analysed = now(), status = :status, failure_reason = :failure_reason,
                failure_retryable = :failure_retryable, processing_started = NULL,
                analysis_claim_token = NULL, due = false, lease_attempts = 0,
                result_claim_token = :result_claim, result_claim_verified = :verified,
                refetch_requested = false, analysed_by = :analyser, retry_due = false,
                failure_streak = CASE WHEN CAST(:status AS text) = 'failed'
                    THEN CASE
        WHEN COALESCE(apps.analysis->'success' = 'false'::jsonb, false)
             AND COALESCE(apps.analysisversion, 0) = :version
        THEN apps.failure_streak + 1 ELSE 1 END ELSE 0 END
FROM sent
WHERE apps.appid = :appid AND NOT (:unless_stored AND COALESCE(apps.analysis = sent.document
             AND apps.analysisversion IS NOT DISTINCT FROM :version, false))
RETURNING apps.appid, CASE WHEN octet_length(apps.details::text) <= :document_limit THEN apps.details::text END AS details,
       octet_length(apps.details::text) AS details_bytes, apps.analysed
