
SELECT count(*) FILTER (WHERE analysed > now() - interval '1 hour' AND success) AS analysed_1h,
       count(*) FILTER (WHERE analysed > now() - interval '24 hours'
                        AND COALESCE(analysisversion, 0) < :analysis_version) AS outdated_24h,
       count(*) FILTER (WHERE analysed > now() - interval '1 hour' AND NOT success) AS failed_1h,
       count(*) FILTER (WHERE analysed > now() - interval '24 hours' AND success) AS analysed_24h,
       count(*) FILTER (WHERE analysed > now() - interval '24 hours' AND NOT success)
           AS failed_24h,
       count(*) FILTER (WHERE success) AS analysed_7d,
       count(*) FILTER (WHERE NOT success) AS failed_7d
FROM app_analyses WHERE analysed > now() - interval '7 days'
