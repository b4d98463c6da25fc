-- ledger: no-transaction
-- 037: apps in bundle-ID order (as 027: byte by byte, in any letter case), but not the
-- leased ones (status 'processing'). A claim writes a new version of the row it leases,
-- and a new version enters every index whose condition it meets: 027's index held every
-- row, so each claim wrote one entry into it, most often on a leaf nothing else had
-- touched since the last checkpoint, logged whole (a fifth of a claim's WAL,
-- docs/benchmarks.md). A leased row meets this condition no longer, so a claim writes
-- nothing here; the web view's list reads the few leased rows through
-- apps_processing_started and merges them in (IN_BUNDLE_ID_ORDER). 038 then drops
-- 027's index.
--
-- Safe while the previous release runs: an index changes no row and no column.
-- CONCURRENTLY builds it without blocking writes, outside a transaction as the first
-- line says. A failed build's INVALID index is dropped by the runner before the next
-- try; IF NOT EXISTS makes a second run after success a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_bundle_id_order_unleased
    ON apps ((lower(appid)) COLLATE "C") WHERE status <> 'processing';
