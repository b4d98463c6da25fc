-- 008: json -> jsonb and timestamp -> timestamptz.
--
-- Safe while the previous release runs: its driver reads and writes json and jsonb, and
-- timestamp and timestamptz, the same way. The stored timestamps were written in UTC,
-- so they are read AT TIME ZONE 'UTC' and keep their instant.
--
-- jsonb cannot hold the NUL character (\u0000), which json accepts; a value with one
-- would abort the conversion, so those values get U+FFFD first (007 did so for
-- apps.analysis; details and history may hold them too).
--
-- Cost: this rewrites apps and app_analyses under an ACCESS EXCLUSIVE lock (one rewrite
-- per table: each table changes in a single ALTER TABLE). README gives the measured time.
UPDATE apps SET details = replace(details::text, '\u0000', '\ufffd')::json
WHERE strpos(details::text, '\u0000') > 0;
UPDATE apps SET analysis = replace(analysis::text, '\u0000', '\ufffd')::json
WHERE strpos(analysis::text, '\u0000') > 0;
UPDATE app_analyses SET analysis = replace(analysis::text, '\u0000', '\ufffd')::json
WHERE strpos(analysis::text, '\u0000') > 0;

ALTER TABLE apps
    ALTER COLUMN details TYPE jsonb USING details::jsonb,
    ALTER COLUMN analysis TYPE jsonb USING analysis::jsonb,
    ALTER COLUMN analysed TYPE timestamptz USING analysed AT TIME ZONE 'UTC',
    ALTER COLUMN added TYPE timestamptz USING added AT TIME ZONE 'UTC';

ALTER TABLE app_analyses
    ALTER COLUMN analysis TYPE jsonb USING analysis::jsonb,
    ALTER COLUMN analysed TYPE timestamptz USING analysed AT TIME ZONE 'UTC',
    ALTER COLUMN app_store_updated TYPE timestamptz USING app_store_updated AT TIME ZONE 'UTC';
