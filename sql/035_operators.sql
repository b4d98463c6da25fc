-- 035: named operators (docs/operations.md, "Operators by name"), as named analysers are
-- (sql/022): each has a token of its own, kept only as its SHA-256 (256 random bits: a
-- fast hash is enough), a rotation's previous token until previous_token_expires, and
-- revoked, which ends both at once. read_only: the operator reads, and every write of
-- theirs is refused. A name begins with a letter or digit (never "." or "..", nor "-x"
-- that a shell reads as an option), is unique in any letter case, and is never "sign-in"
-- (the record's name for a refused sign-in). Every action and sign-in is recorded under the operator's name
-- (operator_actions.actor); the admin token stays as the break-glass credential.
--
-- admin_sessions.operator: the named operator a web view session was started by (NULL:
-- the admin token). A session is live only while its operator is not revoked and has
-- not rotated their token since it started: revocation and rotation end it at once.
--
-- Safe while the previous release runs:
-- * operators is a new table no earlier release names; its indexes and CHECKs are built
--   on an empty table, in this transaction.
-- * admin_sessions.operator is nullable with no default: a catalog change, no rewrite and
--   no scan. The previous release's sign-ins write NULL (the admin token), which is what
--   they are.
-- * The API role needs SELECT, INSERT, UPDATE on operators (never DELETE: a revoked
--   operator's row stays, as their records do): the least-privilege block of
--   docs/operations.md grants it through ALTER DEFAULT PRIVILEGES, so no GRANT here.
-- * One short transaction; ALTER TABLE admin_sessions takes ACCESS EXCLUSIVE only for the
--   catalog change (under the runner's lock_timeout), on a table of sign-ins.
CREATE TABLE IF NOT EXISTS operators (
    name text PRIMARY KEY
        CONSTRAINT operators_name_format
            CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$' AND lower(name) <> 'sign-in'),
    token_hash bytea NOT NULL
        CONSTRAINT operators_token_hash_size CHECK (octet_length(token_hash) = 32),
    previous_token_hash bytea
        CONSTRAINT operators_previous_token_hash_size
            CHECK (octet_length(previous_token_hash) = 32),
    previous_token_expires timestamptz,
    read_only boolean NOT NULL,
    created timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    rotated timestamptz,
    revoked timestamptz,
    CONSTRAINT operators_previous_token_has_an_end
        CHECK ((previous_token_hash IS NULL) = (previous_token_expires IS NULL))
);
-- One name in any letter case: alice and Alice would read alike in the record.
CREATE UNIQUE INDEX IF NOT EXISTS operators_name_lower ON operators (lower(name));
-- Every admin request with a named operator's token looks its hash up here.
CREATE UNIQUE INDEX IF NOT EXISTS operators_token_hash ON operators (token_hash);
CREATE UNIQUE INDEX IF NOT EXISTS operators_previous_token_hash
    ON operators (previous_token_hash) WHERE previous_token_hash IS NOT NULL;

ALTER TABLE admin_sessions ADD COLUMN IF NOT EXISTS operator text;
