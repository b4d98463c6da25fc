-- 007: queue state moves out of the analysis JSON into real columns.
--
-- Before this file, apps.analysis encoded four things: NULL = queued; a
-- {"success": false, "logs": "Processing in progress", "timestamp": ...} marker = an
-- analyser holds the app; {"success": false, "reason", "retryable", "logs"} = failed;
-- anything else = a completed analysis. From here on status, processing_started,
-- failure_reason and failure_retryable say that, and analysis is only the raw payload.
--
-- Safe while the previous release runs:
-- * The columns are additive with constant defaults (no table rewrite); the previous
--   release names its columns and never reads these.
-- * The backfill only reads analysis. The processing marker also carries
--   success = false, so it is classified before failures.
-- * A marker timestamp that does not parse falls back to now() (through a pg_temp
--   helper that catches the cast error), so one bad row cannot abort the deploy; the
--   lease then simply expires one timeout from now.
-- * A failure record without "retryable" counts as retryable, and one without "reason"
--   as analysis_failed, as the previous release read them.
-- * jsonb (008) cannot hold NUL, and ->> on a json value holding \u0000 raises, so one
--   failure log with a NUL byte would abort this file: those values get U+FFFD first.
-- * apps_appid_valid (003) is NOT VALID: the rows 003 marked invalid still break it, and
--   PostgreSQL checks it on every UPDATE of such a row. It is dropped for the backfill and
--   added back, NOT VALID again, before this transaction commits.
SET LOCAL TIME ZONE 'UTC';

ALTER TABLE apps DROP CONSTRAINT IF EXISTS apps_appid_valid;

UPDATE apps SET analysis = replace(analysis::text, '\u0000', '\ufffd')::json
WHERE strpos(analysis::text, '\u0000') > 0;

ALTER TABLE apps
    ADD COLUMN IF NOT EXISTS status text NOT NULL DEFAULT 'queued',
    ADD COLUMN IF NOT EXISTS processing_started timestamptz,
    ADD COLUMN IF NOT EXISTS failure_reason text,
    ADD COLUMN IF NOT EXISTS failure_retryable boolean;

ALTER TABLE apps ADD CONSTRAINT apps_status_valid
    CHECK (status IN ('queued', 'processing', 'analysed', 'failed'));

CREATE OR REPLACE FUNCTION pg_temp.parse_marker_time(value text) RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
    IF value ~ '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)?$' THEN
        RETURN value::timestamptz;
    END IF;
    RETURN NULL;
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$;

UPDATE apps SET
    status = 'processing',
    processing_started = COALESCE(pg_temp.parse_marker_time(analysis->>'timestamp'), now())
WHERE analysis->>'logs' = 'Processing in progress'
  AND analysis->>'success' = 'false';

UPDATE apps SET
    status = 'failed',
    failure_reason = COALESCE(analysis->>'reason', 'analysis_failed'),
    failure_retryable = CASE analysis->>'retryable'
        WHEN 'false' THEN false
        ELSE true
    END
WHERE status = 'queued'
  AND analysis->>'success' = 'false';

UPDATE apps SET status = 'analysed'
WHERE status = 'queued'
  AND analysis IS NOT NULL
  AND analysis->>'success' IS DISTINCT FROM 'false';

ALTER TABLE apps ADD CONSTRAINT apps_appid_valid
    CHECK (length(appid) BETWEEN 1 AND 255
           AND appid ~ '^[A-Za-z0-9][A-Za-z0-9.-]*$'
           AND appid !~ '\.$') NOT VALID;

-- Live leases are looked up by age when they expire.
CREATE INDEX IF NOT EXISTS apps_processing_started
    ON apps (processing_started) WHERE status = 'processing';
