-- ledger: no-transaction
-- 017: the leases the promoter has not flagged, by start time. The claim reads the expired
-- ones among them (normally none: the promoter flags a lease a minute before it expires)
-- so that an expired lease is handed out again even when the promoter is behind or was
-- skipped (a lock, a timeout). Without this index that read visits every processing row,
-- flagged or not, on every claim.
--
-- Safe while the previous release runs: an index changes no row and no column, and it is
-- built CONCURRENTLY (no write waits for it), outside a transaction as the first line
-- says. It is small: live leases only, about one per analyser.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_unflagged_leases
    ON apps (processing_started) WHERE status = 'processing' AND NOT due;
