-- ledger: no-transaction
-- 027: apps in bundle-ID order, byte by byte (COLLATE "C") and in any letter case: the
-- web view's app list (GET /admin/api/apps) pages through it by keyset and finds a
-- bundle-ID prefix as a range of it. The database's own collation (en_US on RDS) orders
-- "com.b" between "com.a" and "coma", so a prefix is no range of apps_appid_lower_key.
--
-- Safe while the previous release runs: an index changes no row and no column, and
-- lower(appid) never changes once a row exists, so updates stay as they were (HOT
-- included). CONCURRENTLY builds it without blocking writes, outside a transaction as
-- the first line says. A failed build's INVALID index is dropped by the runner before
-- the next try; IF NOT EXISTS makes a second run after success a no-op.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_bundle_id_order
    ON apps ((lower(appid)) COLLATE "C");
