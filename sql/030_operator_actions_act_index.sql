-- ledger: no-transaction
-- 030: operator actions by their id (operator_actions.act, sql/029), for the one
-- question asked by id: whether an action's transaction, tried again after its
-- connection was lost during COMMIT, committed the first time (handler.act). Without
-- it that question reads the whole record, which a bulk refetch grows by a row per app.
--
-- Safe while the previous release runs: an index changes no row and no column, and the
-- previous release writes no act (NULL rows are left out of this partial index).
-- CONCURRENTLY builds it without blocking the record's inserts, outside a transaction
-- as the first line says. A failed build's INVALID index is dropped by the runner before
-- the next try; IF NOT EXISTS makes a second run after success a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS operator_actions_act
    ON operator_actions (act) WHERE act IS NOT NULL;
