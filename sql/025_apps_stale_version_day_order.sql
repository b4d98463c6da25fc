-- ledger: no-transaction
-- 025: the unflagged analysed (and retryable failed) rows by analysis version, then
-- analysis day, then in claim order: 016's order, one version at a time. The claim reads
-- the head of each (version, day) older than the staleness cutoff, for the versions up
-- to CURRENT_ANALYSIS_VERSION only (see 024 for why a newer version is never stale), so
-- the rows of a newer version are never in its way. It takes over from
-- apps_stale_day_order (016), which the previous release still reads during a deploy.
--
-- Safe while the previous release runs: an index changes no row and no column.
-- CONCURRENTLY builds it without blocking writes, outside a transaction as the first
-- line says. A failed build's INVALID index is dropped by the runner before the next
-- try; IF NOT EXISTS makes a second run after success a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_stale_version_day_order
    ON apps (COALESCE(analysisversion, 0), analysis_day(analysed),
             app_popularity(details) DESC, added, appid)
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable));
