-- 004: failures that retrying cannot fix are marked so the queue stops handing them out.
--
-- Safe while the previous release runs: an UPDATE of failure records only (row locks, no
-- schema change); the fields it merges in are the ones that release already writes.
UPDATE apps
SET analysis = (analysis::jsonb || '{"reason": "ios_version_too_low", "retryable": false}'::jsonb)::json
WHERE analysis->>'success' = 'false'
  AND (analysis->>'logs' ILIKE '%DeviceOSVersionTooLow%' OR analysis->>'logs' ILIKE '%system version is lower than the minimum OS version%');
