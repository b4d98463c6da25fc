
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version,
                          analysis_source, success, analyser)
SELECT appid, analysis, analysisversion, analysed,
       COALESCE(analysis->>'version', details->>'version'), CASE
    WHEN jsonb_typeof(analysis->'analysis_source') = 'string'
         AND analysis->>'analysis_source' <> '' THEN analysis->>'analysis_source'
    ELSE 'legacy'
END,
       status = 'analysed', analysed_by
FROM apps WHERE appid = ANY(CAST(:appids AS text[]))
  AND analysis IS NOT NULL AND analysed IS NOT NULL
ON CONFLICT DO NOTHING
