-- 036: the queue over time (docs/web-view.md, "The queue over time"). The scheduled
-- report writes one row an hour: the apps by state, the backlog by reason and the failed
-- apps by reason as it counted them, so the web view draws the backlog of the last days
-- with no CloudWatch (a local `serve` writes them too). Results, failures and expired
-- leases per hour are not kept here: app_analyses already records each one. Rows older
-- than 90 days are deleted by the report that writes the next one (through
-- prune_queue_snapshots); no claim, result or refetch reads or writes this table.
--
-- Safe while the previous release runs:
-- * queue_snapshots is a new table no earlier release names; its primary key is built on
--   an empty table, in this transaction. About 2,200 rows of a few hundred bytes at most.
-- * The API role (which the report function uses) gets SELECT, INSERT and UPDATE on it
--   through docs/operations.md's ALTER DEFAULT PRIVILEGES, and prunes through
--   prune_queue_snapshots() (below), which every role may call: no DELETE is granted.
--   Where the grants were made without default privileges, the block of
--   docs/operations.md names the table (and the report keeps working without it: it
--   logs that no snapshot was kept).
-- * One short transaction; no existing table is locked. The previous release never calls
--   the function.
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

-- Pruning is this function's alone: it deletes the snapshots past 90 days, and nothing
-- else. It runs as the table's owner (SECURITY DEFINER, with its own search_path), so
-- the API role needs no DELETE on the table: a leaked API credential cannot erase the
-- recent history, only what is past its window anyway.
CREATE OR REPLACE FUNCTION prune_queue_snapshots() RETURNS bigint
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $prune$
    WITH pruned AS (
        DELETE FROM public.queue_snapshots WHERE hour < now() - interval '90 days'
        RETURNING 1
    )
    SELECT count(*) FROM pruned
$prune$;
