
SELECT id, at, actor, source, action, app_id, analyser, outcome FROM operator_actions
WHERE id < COALESCE(CAST(:before AS bigint), 9223372036854775807)
ORDER BY id DESC LIMIT :limit
