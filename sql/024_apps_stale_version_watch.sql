-- ledger: no-transaction
-- 024: the unflagged analysed (and retryable failed) rows by analysis version, then
-- analysis time. An analysis of a version above CURRENT_ANALYSIS_VERSION is no longer
-- stale by age (docs/queue.md, "The rule"): an analyser at or below the current version
-- could only be refused. So the promoter and the claim look for stale analyses one
-- version at a time, up to the current one, and never read the rows of a newer version,
-- however many there are (all of them, while a fleet upgraded before the setting, or
-- after the setting was rolled back). This index gives each version's oldest analysis in
-- one probe (the claim's gate, handler.UNFLAGGED_STALE_EXIST) and its stale analyses in
-- time order (the promoter, handler.PROMOTE_STALE_BATCH). It takes over from
-- apps_stale_watch (011), which the previous release still reads during a deploy.
--
-- Safe while the previous release runs: an index changes no row and no column.
-- CONCURRENTLY builds it without blocking writes (the previous release keeps claiming
-- and storing results during the build), which is why this file runs outside a
-- transaction ("ledger: no-transaction" above). If the build fails, it leaves an INVALID
-- index behind; the runner drops that before the next try, and IF NOT EXISTS makes a
-- second run after success a no-op. It holds the rows apps_stale_watch holds, with an
-- integer more each.
CREATE INDEX CONCURRENTLY IF NOT EXISTS apps_stale_version_watch
    ON apps (COALESCE(analysisversion, 0), COALESCE(analysed, '-infinity'::timestamptz))
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable));
