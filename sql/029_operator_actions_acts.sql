-- 029: the record of operator actions, as the service writes it since every action is
-- one act (handler.act: a change and its record in one transaction).
--
-- operator_actions.act: the id of the action a row records, the same in each row of one
-- action (a refetch writes one row per app). A transaction tried again after its
-- connection was lost during COMMIT looks for it to learn whether its first try
-- committed, so an action is never done twice. NULL in the rows written before.
--
-- operator_actions is append-only: one statement writes it (handler.OPERATOR_ACTIONS_
-- INSERT) and nothing changes a row. A row updated or deleted would rewrite who did
-- what, and the sign-in limit counts the refused sign-ins in it, so a role that could
-- delete or update them could lift the limit. The least-privilege API role of
-- docs/operations.md may only read and insert here; a database whose grants followed an
-- older docs/operations.md (UPDATE on every table) is closed too: these triggers refuse
-- UPDATE, DELETE and TRUNCATE for every role but one that may drop them (the table's
-- owner, the migration role), and say why.
--
-- Safe while the previous release runs: a nullable column without a default is a change
-- of the catalog only (no rewrite); the previous release's INSERT names its columns and
-- leaves it NULL. No release has ever updated, deleted or truncated operator_actions
-- (026 made it; every write since is an INSERT), so no statement it runs is refused.
-- ADD COLUMN and CREATE TRIGGER lock the table briefly, behind a sign-in's INSERT at
-- most (milliseconds), under the runner's lock_timeout. IF NOT EXISTS, CREATE OR REPLACE
-- and DROP TRIGGER IF EXISTS make a second run change nothing.
ALTER TABLE operator_actions ADD COLUMN IF NOT EXISTS act uuid;
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
