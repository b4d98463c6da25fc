
SELECT analysed, analysisversion, analysis_source, success, analyser, app_version,
       CASE WHEN NOT success THEN analysis->>'reason' END AS reason,
       CASE WHEN NOT success AND octet_length(analysis::text) <= :document_limit
            THEN analysis::text END AS failure_log
FROM app_analyses WHERE appid = :appid
ORDER BY analysed DESC
LIMIT :limit
