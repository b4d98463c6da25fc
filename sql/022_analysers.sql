-- 022: every analyser has its own credential, and every lease and result says whose it is.
--
-- analysers: one row per host. Its bearer token is stored only as its SHA-256 (a token is
-- 256 random bits, so a fast hash is enough: there is nothing to guess a preimage from);
-- a rotation keeps the hash of the token it replaced until previous_token_expires, so
-- the host can be given the new one with no 401 in between; revoked ends both at once.
-- last_seen is written by GET /ping; the last_result_* columns by each result it stores.
--
-- apps.claimed_by: the analyser whose claim (GET /queue) made the current lease; NULL for
-- the shared UPLOAD_PASSWORD, the previous release and the old server. apps.claimed_with:
-- the claim token that claim was handed (analysis_claim_token at the time). The lease is
-- claimed_by's only while claimed_with is still the row's analysis_claim_token: a writer
-- that knows nothing of these columns (the previous release, the old server, their
-- triggers in 018) and hands the row out again changes the token, and so ends the named
-- claim without having to clear it. apps.analysed_by: who stored the row's result;
-- app_analyses.analyser: the same, copied into history with the result.
--
-- Safe while the previous release runs (and the old server's releases):
-- * analysers is a new table that those releases never name; its indexes and CHECKs are
--   built on an empty table, in this transaction.
-- * The four new columns are nullable, with no default: a catalog change, no rewrite and
--   no scan. Statements that do not name them (every statement of those releases) write
--   NULL, which reads as "the shared password" / "not known": their leases are fenced
--   and their results accepted exactly as before this file. (Those releases know only
--   the shared password and do not fence by identity: named analysers are added once the
--   deploy is done. A result one of them stores leaves analysed_by as it was.)
-- * No new index on apps or app_analyses (that would need a file of its own, built
--   CONCURRENTLY): the named-claim lookup goes through apps_processing_started (sql/007,
--   processing rows only, a few per analyser), and the per-analyser counts through the
--   range of app_analyses the report already reads (the last 24 hours).
-- * The API role needs SELECT, INSERT, UPDATE on analysers (never DELETE: a revoked
--   analyser's row stays, with its history). The README's least-privilege block grants
--   that to tables a later ledger file creates (ALTER DEFAULT PRIVILEGES), so no GRANT
--   here; docs/analysers.md gives the GRANT for a database set up without that block.
-- * Everything is one short transaction; ALTER TABLE apps and app_analyses take ACCESS
--   EXCLUSIVE only for the catalog change (under the runner's lock_timeout).
CREATE TABLE IF NOT EXISTS analysers (
    name text PRIMARY KEY
        CONSTRAINT analysers_name_format CHECK (name ~ '^[A-Za-z0-9._:@-]{1,64}$'),
    token_hash bytea NOT NULL
        CONSTRAINT analysers_token_hash_size CHECK (octet_length(token_hash) = 32),
    previous_token_hash bytea
        CONSTRAINT analysers_previous_token_hash_size
            CHECK (octet_length(previous_token_hash) = 32),
    previous_token_expires timestamptz,
    created timestamptz NOT NULL DEFAULT now(),
    rotated timestamptz,
    revoked timestamptz,
    last_seen timestamptz,
    last_result_app text,
    last_result_at timestamptz,
    last_result_success boolean,
-- The analyser's format version, as apps.analysisversion beside it: an integer there too.
-- squawk-ignore prefer-bigint-over-int
    last_result_version integer,
    CONSTRAINT analysers_previous_token_has_an_end
        CHECK ((previous_token_hash IS NULL) = (previous_token_expires IS NULL))
);
-- Every request with a named token looks its hash up here: one index probe each.
CREATE UNIQUE INDEX IF NOT EXISTS analysers_token_hash ON analysers (token_hash);
CREATE UNIQUE INDEX IF NOT EXISTS analysers_previous_token_hash
    ON analysers (previous_token_hash) WHERE previous_token_hash IS NOT NULL;

ALTER TABLE apps
    ADD COLUMN IF NOT EXISTS claimed_by text,
    ADD COLUMN IF NOT EXISTS claimed_with uuid,
    ADD COLUMN IF NOT EXISTS analysed_by text;
ALTER TABLE app_analyses ADD COLUMN IF NOT EXISTS analyser text;
