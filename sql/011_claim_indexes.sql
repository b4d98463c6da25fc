-- 011: the indexes the claim reads from the head of (see 010 and handler.py).
--
-- Safe while the previous release runs: indexes change no row and no column. They are
-- kept apart from 010 so that 010's ACCESS EXCLUSIVE lock (held until its transaction
-- commits) is not held while they build. CREATE INDEX takes a SHARE lock: the previous
-- release keeps reading apps while they build; its writes wait for the build (README
-- gives the measured time at 10k, 100k and 1M apps).
--
-- * apps_claim_order: queued and promoted-due rows, in claim order.
-- * apps_version_order: analysed and retryable-failed rows not promoted, by version
--   then claim order; the claim probes its head once per old version.
-- * apps_stale_watch: the same rows by analysis time, for the promoter's range scan.
CREATE INDEX IF NOT EXISTS apps_claim_order
    ON apps (app_popularity(details) DESC, added, appid)
    WHERE status = 'queued' OR due;

CREATE INDEX IF NOT EXISTS apps_version_order
    ON apps (COALESCE(analysisversion, 0), app_popularity(details) DESC, added, appid)
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable));

CREATE INDEX IF NOT EXISTS apps_stale_watch
    ON apps (COALESCE(analysed, '-infinity'::timestamptz))
    WHERE NOT due AND (status = 'analysed' OR (status = 'failed' AND failure_retryable));
