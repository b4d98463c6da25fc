-- 008: json -> jsonb and timestamp -> timestamptz.
--
-- Safe while the previous release runs: its driver reads and writes json and jsonb, and
-- timestamp and timestamptz, the same way. The stored timestamps were written in UTC,
-- so they are read AT TIME ZONE 'UTC' and keep their instant.
--
-- jsonb cannot hold the NUL character (\u0000), which json accepts; a log with one would
-- abort the conversion, so those values are converted with U+FFFD in its place.
--
-- Cost: this rewrites apps and app_analyses under an ACCESS EXCLUSIVE lock (one rewrite
-- per table: each table changes in a single ALTER TABLE). README gives the measured time.
CREATE OR REPLACE FUNCTION pg_temp.to_jsonb_lenient(value json) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN value::jsonb;
EXCEPTION WHEN untranslatable_character OR invalid_text_representation THEN
    RETURN replace(value::text, '\u0000', '\ufffd')::jsonb;
END $$;

ALTER TABLE apps
    ALTER COLUMN details TYPE jsonb USING pg_temp.to_jsonb_lenient(details),
    ALTER COLUMN analysis TYPE jsonb USING pg_temp.to_jsonb_lenient(analysis),
    ALTER COLUMN analysed TYPE timestamptz USING analysed AT TIME ZONE 'UTC',
    ALTER COLUMN added TYPE timestamptz USING added AT TIME ZONE 'UTC';

ALTER TABLE app_analyses
    ALTER COLUMN analysis TYPE jsonb USING pg_temp.to_jsonb_lenient(analysis),
    ALTER COLUMN analysed TYPE timestamptz USING analysed AT TIME ZONE 'UTC',
    ALTER COLUMN app_store_updated TYPE timestamptz USING app_store_updated AT TIME ZONE 'UTC';
