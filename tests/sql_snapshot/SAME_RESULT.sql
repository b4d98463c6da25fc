
SELECT COALESCE(apps.analysis = CAST(:analysis AS jsonb)
             AND apps.analysisversion IS NOT DISTINCT FROM :version, false) AS same_result
FROM apps WHERE appid = :appid
