
WITH seen AS (
    SELECT last_seen FROM analyser_heartbeats
    UNION ALL SELECT last_seen FROM analysers WHERE revoked IS NULL AND last_seen IS NOT NULL
)
SELECT extract(epoch FROM now() - max(last_seen)) / 60 AS minutes_since_last_ping,
       count(*) FILTER (WHERE (last_seen > now() - interval '1 hour' AND last_seen <= now())) AS analysers_last_hour
FROM seen WHERE isfinite(last_seen) AND last_seen <= now()
