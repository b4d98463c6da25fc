-- ledger: no-transaction
-- 028: failed apps by failure reason, each reason in bundle-ID order (as 027): the web
-- view's list of failures (GET /admin/api/apps?state=failed&reason=...), and its bulk
-- refetch, read a page of one reason without walking the apps of every other state.
--
-- Safe while the previous release runs: an index changes no row and no column. It holds
-- failed rows only, so a claim, which never writes a failed row, never touches it.
-- CONCURRENTLY builds it without blocking writes, outside a transaction as the first
-- line says. A failed build's INVALID index is dropped by the runner before the next
-- try; IF NOT EXISTS makes a second run after success a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_failed_by_reason
    ON apps (failure_reason, (lower(appid)) COLLATE "C") WHERE status = 'failed';
