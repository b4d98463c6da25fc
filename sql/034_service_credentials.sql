-- 034: the shared upload password and the admin token as hashes in the database
-- (docs/analysers.md, "The shared password and the admin token"). Once a row exists, its
-- hash is the one credential checked for that name, on every request and in every
-- process: a rotation, or the end of its overlap, holds from the next request on. The
-- environment (UPLOAD_PASSWORD, ADMIN_TOKEN) or a secret store only fills an empty row,
-- which is flagged chosen_by_person (a value a person picked may be guessable) until
-- rotated; `credentials rotate` makes a random 256-bit value, for which SHA-256 without
-- salt or stretching is enough, as for the named analysers' tokens. session_key signs the
-- web view's session cookies (admin_token's row): a new one at each rotation ends every
-- session.
--
-- Safe while the previous release runs:
-- * A new table no release before names. The previous release goes on checking the
--   values of its environment and secrets, the values this table is filled from, so the
--   deployed analysers keep working across the deploy.
-- * The least-privilege block of docs/operations.md grants the API role SELECT, INSERT
--   and UPDATE on it through ALTER DEFAULT PRIVILEGES: the API fills an empty row, and
--   the report function rotates.
-- * One short transaction; nothing a request waits for is rewritten or locked.
CREATE TABLE IF NOT EXISTS service_credentials (
    name text PRIMARY KEY CHECK (name IN ('upload_password', 'admin_token')),
    token_hash bytea NOT NULL,
    previous_token_hash bytea,
    previous_token_expires timestamptz,
    chosen_by_person boolean NOT NULL,
    set_at timestamptz NOT NULL DEFAULT now(),
    set_by text NOT NULL,
    session_key bytea NOT NULL
);
