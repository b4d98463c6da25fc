
WITH seen AS (
    SELECT last_seen, true AS current FROM analyser_heartbeats
    UNION ALL
    SELECT last_seen, revoked IS NULL FROM analysers WHERE last_seen IS NOT NULL
)
SELECT extract(epoch FROM now() - max(last_seen)) / 60 AS minutes_since_last_ping,
       count(*) FILTER (WHERE current AND (last_seen > now() - interval '1 hour' AND last_seen <= now()))
           AS analysers_last_hour
FROM seen WHERE isfinite(last_seen) AND last_seen <= now()
