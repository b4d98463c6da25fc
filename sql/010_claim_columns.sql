-- 010: what the index-head claim needs: a popularity function, the promoter's flag, the
-- claim token, analyser heartbeats and the last queue policy the promoter applied.
--
-- How a claim stays an index read (handler.py, "Queue logic", has the full argument):
-- queued rows, and non-queued rows that the promoter found due (expired lease or stale
-- analysis, flag `due`), sit in one partial index in claim order; rows due only because
-- their analysisversion is old are read from the head of a second index, one probe per
-- old version. /queue takes the best of those heads.
--
-- Safe while the previous release runs:
-- * Columns are added with constant defaults (catalog-only, no rewrite). The previous
--   release inserts rows with status 'queued', which are claimable with due = false, so
--   nothing it adds is missed.
-- * New tables are not touched by that release.
-- * app_popularity is IMMUTABLE, so it can back an index; it reads details->>'reviews'
--   as a number when it is all digits, else 0 (numeric, so a 30-digit count cannot
--   overflow and abort an insert).
CREATE OR REPLACE FUNCTION app_popularity(details jsonb) RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN details->>'reviews' ~ '^[0-9]+$'
                THEN (details->>'reviews')::numeric
                ELSE 0 END
$$;

ALTER TABLE apps
    ADD COLUMN IF NOT EXISTS due boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS claim_token text;

CREATE TABLE IF NOT EXISTS analyser_heartbeats (
    analyser_id text PRIMARY KEY,
    last_seen timestamptz NOT NULL DEFAULT now(),
    source_address text,
    user_agent text,
    pings bigint NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS analyser_heartbeats_last_seen ON analyser_heartbeats (last_seen DESC);

-- One row: the policy (CURRENT_ANALYSIS_VERSION, STALE_ANALYSIS_DAYS,
-- PROCESSING_TIMEOUT_MINUTES) the promoter last applied. When the service starts with a
-- different policy, due flags that no longer hold are cleared once.
CREATE TABLE IF NOT EXISTS queue_policy (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    analysis_version integer,
    stale_days integer,
    processing_timeout_minutes integer,
    applied timestamptz
);
INSERT INTO queue_policy (singleton) VALUES (true) ON CONFLICT DO NOTHING;
