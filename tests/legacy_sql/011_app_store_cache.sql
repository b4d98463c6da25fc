-- Test fixture: the old server's 011. The website's App Store search results, keyed by
-- the lower-cased bundle ID; not part of the queue.
CREATE TABLE app_store_cache (
    appid_key text PRIMARY KEY,
    details jsonb NOT NULL,
    fetched_at timestamptz NOT NULL DEFAULT now(),
    CHECK (appid_key = lower(appid_key))
);
