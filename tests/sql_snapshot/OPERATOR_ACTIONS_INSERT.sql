
INSERT INTO operator_actions (actor, source, action, app_id, analyser, outcome, act)
SELECT :actor, :source, :action, a.app_id, :analyser, a.outcome, CAST(:act AS uuid)
FROM unnest(CAST(:app_ids AS text[]), CAST(:outcomes AS text[])) AS a(app_id, outcome)
