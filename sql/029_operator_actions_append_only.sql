-- 029: operator_actions is append-only. The record of operator actions is written by
-- one statement (handler.OPERATOR_ACTIONS_INSERT, in the transaction of the change it
-- records) and never changed: a row updated or deleted would rewrite who did what, and
-- the sign-in limit counts refused sign-ins in it, so a role that could delete or update
-- them could lift the limit. The least-privilege API role of docs/operations.md may
-- only insert and read here; but a database whose grants were made by an older
-- docs/operations.md (UPDATE on every table, by default privileges) is closed too: this
-- trigger refuses UPDATE, DELETE and TRUNCATE for every role but one that may drop the
-- trigger (the table's owner: the migration role), and says why.
--
-- Safe while the previous release runs: no release of this service has ever updated,
-- deleted or truncated operator_actions (026 created it; every write since is the
-- INSERT above), so no running statement is refused. CREATE OR REPLACE FUNCTION and
-- CREATE TRIGGER take a brief SHARE ROW EXCLUSIVE lock on the table, which waits
-- behind a sign-in's INSERT at most (a few milliseconds) under the runner's
-- lock_timeout; DROP TRIGGER IF EXISTS first makes a second run a no-op in effect.
CREATE OR REPLACE FUNCTION operator_actions_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'operator_actions is append-only: % is refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;
DROP TRIGGER IF EXISTS operator_actions_append_only ON operator_actions;
CREATE TRIGGER operator_actions_append_only
    BEFORE UPDATE OR DELETE ON operator_actions
    FOR EACH ROW EXECUTE FUNCTION operator_actions_append_only();
DROP TRIGGER IF EXISTS operator_actions_no_truncate ON operator_actions;
CREATE TRIGGER operator_actions_no_truncate
    BEFORE TRUNCATE ON operator_actions
    FOR EACH STATEMENT EXECUTE FUNCTION operator_actions_append_only();
