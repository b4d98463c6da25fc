-- 003: bundle IDs must look like bundle IDs.
--
-- Safe while the previous release runs: the rows that break the rule are marked as
-- failed (not retryable) instead of deleted, and the CHECK is added NOT VALID, so it
-- guards new writes without a table scan and without rejecting the rows already there.
UPDATE apps
SET analysis = json_build_object(
        'success', false,
        'reason', 'invalid_bundle_id',
        'retryable', false,
        'logs', 'Invalid bundle ID')
WHERE NOT (length(appid) BETWEEN 1 AND 255
           AND appid ~ '^[A-Za-z0-9][A-Za-z0-9.-]*$'
           AND appid !~ '\.$');

ALTER TABLE apps ADD CONSTRAINT apps_appid_valid
    CHECK (length(appid) BETWEEN 1 AND 255
           AND appid ~ '^[A-Za-z0-9][A-Za-z0-9.-]*$'
           AND appid !~ '\.$') NOT VALID;
