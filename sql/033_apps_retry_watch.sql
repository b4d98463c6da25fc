-- ledger: no-transaction
-- 033: retryable failures not yet flagged, by analysis version, failures in a row (one
-- at least: a failure the release before 031 stored leaves the count at 0) and failure
-- time: the promoter flags those whose retry falls due (one range per step of
-- RETRY_BACKOFF at the current version), and the report counts them.
--
-- Safe while the previous release runs: an index changes no row and no column; it holds
-- only retryable failures. CONCURRENTLY builds it without blocking writes, outside a
-- transaction as the first line says; a failed build's INVALID index is dropped by the
-- runner before the next try.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_retry_watch
    ON apps (COALESCE(analysisversion, 0), GREATEST(failure_streak, 1), analysed)
    WHERE status = 'failed' AND failure_retryable AND NOT retry_due;
