
SELECT at, actor, source, action, outcome FROM operator_actions
WHERE app_id = :appid ORDER BY at DESC LIMIT :limit
