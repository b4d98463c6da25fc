-- ledger: no-transaction
-- 032: the failures whose retry the promoter flagged due (031), in claim order: the
-- claim reads its head only when no other candidate exists (the lowest tier).
--
-- Safe while the previous release runs: an index changes no row and no column, and it
-- holds only flagged rows (none until this release's promoter runs). CONCURRENTLY
-- builds it without blocking writes, outside a transaction as the first line says; a
-- failed build's INVALID index is dropped by the runner before the next try.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_retry_order
    ON apps (app_popularity(details) DESC, added, appid)
    WHERE retry_due;
