
INSERT INTO queue_snapshots (hour, states, backlog, failed)
VALUES (date_trunc('hour', now()), CAST(:states AS jsonb), CAST(:backlog AS jsonb),
        CAST(:failed AS jsonb))
ON CONFLICT (hour) DO NOTHING
