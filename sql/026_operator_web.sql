-- 026: the operator's web view (ADMIN_WEB): its sign-in sessions, and the record of
-- every operator action it (and /admin/api) takes.
--
-- admin_sessions: one row per sign-in. The browser holds a random session id, signed
-- with a key derived from the admin token (so rotating the token ends every session);
-- this table keeps only the id's SHA-256, when it ends, and whether it was ended early
-- (POST /admin/logout), so a stolen cookie dies with its sign-out.
--
-- operator_actions: who (a session, shown by a prefix of its hash, or the bearer
-- token), from where, what, when, on which app or analyser, with what outcome; one row
-- per app a refetch touched, so each app's page lists the actions on it. Refused
-- sign-ins are rows too: the sign-in's rate limit per source counts them.
--
-- Safe while the previous release runs: two new tables that no earlier release names,
-- with their indexes built on empty tables in this one short transaction; nothing on
-- apps or app_analyses changes. The API role needs SELECT, INSERT, UPDATE on both and
-- USAGE on the identity's sequence: the least-privilege block of docs/operations.md
-- grants that on tables and sequences a later ledger file creates (ALTER DEFAULT
-- PRIVILEGES), so no GRANT here.
CREATE TABLE IF NOT EXISTS admin_sessions (
    id_hash bytea PRIMARY KEY
        CONSTRAINT admin_sessions_id_hash_size CHECK (octet_length(id_hash) = 32),
    created timestamptz NOT NULL DEFAULT now(),
    expires timestamptz NOT NULL,
    ended timestamptz,
    source text NOT NULL
);
CREATE TABLE IF NOT EXISTS operator_actions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    actor text NOT NULL,
    source text NOT NULL,
    action text NOT NULL,
    app_id text,
    analyser text,
    outcome text
);
-- An app's page: its actions, newest first.
CREATE INDEX IF NOT EXISTS operator_actions_app_id
    ON operator_actions (app_id, at DESC) WHERE app_id IS NOT NULL;
-- The sign-in's rate limit: refused sign-ins from one source in the last minutes.
CREATE INDEX IF NOT EXISTS operator_actions_refused_sign_ins
    ON operator_actions (source, at) WHERE action = 'sign-in refused';
