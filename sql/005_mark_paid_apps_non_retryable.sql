-- 005: failures that retrying cannot fix are marked so the queue stops handing them out.
--
-- Safe while the previous release runs: an UPDATE of failure records only (row locks, no
-- schema change); the fields it merges in are the ones that release already writes.
UPDATE apps
SET analysis = (analysis::jsonb || '{"reason": "paid_app", "retryable": false}'::jsonb)::json
WHERE analysis->>'success' = 'false'
  AND analysis->>'logs' ILIKE '%purchasing paid apps is not supported%';
