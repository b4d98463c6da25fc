
UPDATE queue_pause SET paused_at = CASE WHEN :paused THEN now() END,
                       paused_by = CASE WHEN :paused THEN :actor END,
                       reason = CASE WHEN :paused THEN :reason END
RETURNING paused_at, paused_by, reason
