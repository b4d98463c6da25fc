
SELECT paused_at, paused_by, reason FROM queue_pause FOR UPDATE
