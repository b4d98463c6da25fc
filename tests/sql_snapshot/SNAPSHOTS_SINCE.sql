
SELECT hour, taken, states::text AS states, backlog::text AS backlog, failed::text AS failed
FROM queue_snapshots WHERE hour >= :start ORDER BY hour
