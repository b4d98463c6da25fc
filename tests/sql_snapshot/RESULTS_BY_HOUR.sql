
SELECT date_trunc('hour', analysed) AS hour, analyser,
       count(*) FILTER (WHERE success) AS results,
       count(*) FILTER (WHERE NOT success
                        AND analysis_source IS DISTINCT FROM 'queue-server') AS failures,
       count(*) FILTER (WHERE analysis_source = 'queue-server') AS expired_leases
FROM app_analyses WHERE analysed >= :start
GROUP BY 1, 2
