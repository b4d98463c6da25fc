-- 036: the queue over time (docs/web-view.md, "The queue over time"). The scheduled
-- report writes one row an hour: the apps by state, the backlog by reason and the failed
-- apps by reason as it counted them, so the web view draws the backlog of the last days
-- with no CloudWatch (a local `serve` writes them too). Results, failures and expired
-- leases per hour are not kept here: app_analyses already records each one. Rows older
-- than 90 days are deleted by the report that writes the next one; nothing else writes
-- here, and no claim, result or refetch reads or writes this table.
--
-- Safe while the previous release runs:
-- * queue_snapshots is a new table no earlier release names; its primary key is built on
--   an empty table, in this transaction. About 2,200 rows of a few hundred bytes at most.
-- * The API role (which the report function uses) gets SELECT, INSERT and UPDATE on it
--   through docs/operations.md's ALTER DEFAULT PRIVILEGES, and pruning needs DELETE: the
--   block below grants DELETE on this one table to each role that may insert into it,
--   and to no other. Where the grants were made without default privileges, the block of
--   docs/operations.md names the table (and the report keeps working without it: it
--   logs that no snapshot was kept).
-- * One short transaction; no existing table is locked.
CREATE TABLE IF NOT EXISTS queue_snapshots (
    hour timestamptz PRIMARY KEY,
    taken timestamptz NOT NULL DEFAULT now(),
    states jsonb NOT NULL CONSTRAINT queue_snapshots_states_object
        CHECK (jsonb_typeof(states) = 'object'),
    backlog jsonb NOT NULL CONSTRAINT queue_snapshots_backlog_object
        CHECK (jsonb_typeof(backlog) = 'object'),
    failed jsonb NOT NULL CONSTRAINT queue_snapshots_failed_object
        CHECK (jsonb_typeof(failed) = 'object')
);

DO $grant$
DECLARE
    grantee_name text;
BEGIN
    FOR grantee_name IN
        SELECT DISTINCT grantee FROM information_schema.role_table_grants
        WHERE table_schema = current_schema() AND table_name = 'queue_snapshots'
          AND privilege_type = 'INSERT' AND grantee <> current_user
    LOOP
        EXECUTE format('GRANT DELETE ON queue_snapshots TO %I', grantee_name);
    END LOOP;
END
$grant$;
