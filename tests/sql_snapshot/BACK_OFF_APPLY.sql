
WITH abandoned AS (
    UPDATE apps SET status = 'failed', failure_reason = 'lease_expired',
        failure_retryable = true, analysisversion = :analysis_version, analysed = now(),
        analysis = jsonb_build_object(
            'success', false, 'reason', 'lease_expired', 'retryable', true,
            'analysis_source', 'queue-server',
            'logs', format('no result after %s leases in a row of %s minutes each',
                           lease_attempts, CAST(:timeout_minutes AS integer))),
        processing_started = NULL, analysis_claim_token = NULL, due = false,
        lease_attempts = 0, refetch_requested = false, retry_due = false,
        failure_streak = CASE
        WHEN COALESCE(apps.analysis->'success' = 'false'::jsonb, false)
             AND COALESCE(apps.analysisversion, 0) = :analysis_version
        THEN apps.failure_streak + 1 ELSE 1 END,
        result_claim_token = analysis_claim_token, result_claim_verified = false,
        analysed_by = NULL
    WHERE appid = ANY(CAST(:failed AS text[])) AND status = 'processing'
    RETURNING appid, analysis, analysisversion, analysed, details
), recorded AS (
    INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version,
                              analysis_source, success)
    SELECT appid, analysis, analysisversion, analysed, details->>'version',
           'queue-server', false
    FROM abandoned
    ON CONFLICT DO NOTHING
    RETURNING 1
), returned AS (
UPDATE apps SET status = CASE WHEN apps.refetch_requested THEN 'queued' ELSE e.status END,
    failure_reason = CASE WHEN apps.refetch_requested THEN NULL ELSE e.failure_reason END,
    failure_retryable = CASE WHEN apps.refetch_requested THEN NULL ELSE e.failure_retryable END,
    processing_started = NULL, analysis_claim_token = NULL, due = false, lease_attempts = 0,
    refetch_requested = false,
    failure_streak = CASE WHEN apps.refetch_requested THEN 0
                          WHEN e.status = 'failed' THEN GREATEST(apps.failure_streak, 1)
                          ELSE apps.failure_streak END
FROM jsonb_to_recordset(CAST(:ended AS jsonb))
     AS e(appid text, status text, failure_reason text, failure_retryable boolean)
WHERE apps.appid = e.appid AND apps.status = 'processing'
RETURNING apps.appid
)
SELECT (SELECT count(*) FROM abandoned) AS abandoned,
       (SELECT count(*) FROM returned) AS returned
