-- ledger: no-transaction
-- 016: the unflagged analysed (and retryable failed) rows by analysis day, then in claim
-- order. The claim reads one head per day older than the staleness cutoff, so it finds
-- the first stale analysis the promoter has not flagged yet (see 015 and handler.py,
-- "Queue operations").
--
-- Safe while the previous release runs: an index changes no row and no column.
-- CONCURRENTLY builds it without blocking writes (the previous release keeps claiming
-- and storing results during the build), which is why this file runs outside a
-- transaction ("ledger: no-transaction" above). If the build fails, it leaves an INVALID
-- index behind; the runner drops that before the next try, and IF NOT EXISTS makes a
-- second run after success a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_stale_day_order
    ON apps (analysis_day(analysed), app_popularity(details) DESC, added, appid)
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable));
