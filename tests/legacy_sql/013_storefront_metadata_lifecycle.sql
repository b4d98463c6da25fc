-- Test fixture: the old server's 013. History rows carry the storefront listing they were
-- analysed against (and whether its version is the analysed one, a stored generated
-- column); the cache learns about refresh attempts; the cache is seeded from every app's
-- details, and history is back-filled from the apps' details and analyses.
ALTER TABLE app_analyses
    ADD COLUMN storefront_details jsonb,
    ADD COLUMN storefront_fetched_at timestamptz,
    ADD COLUMN storefront_version_matches boolean
        GENERATED ALWAYS AS ((storefront_details->>'version') IS NOT DISTINCT FROM app_version)
        STORED;

ALTER TABLE app_store_cache
    ADD COLUMN refresh_attempted_at timestamptz,
    ADD COLUMN refresh_failures integer NOT NULL DEFAULT 0,
    ADD COLUMN refresh_error text;
CREATE INDEX app_store_cache_refresh_due ON app_store_cache (refresh_attempted_at NULLS FIRST);
CREATE INDEX app_store_cache_refresh_failing ON app_store_cache (refresh_failures)
    WHERE refresh_failures > 0;

INSERT INTO app_store_cache (appid_key, details)
SELECT lower(appid), details FROM apps WHERE details IS NOT NULL
ON CONFLICT (appid_key) DO NOTHING;

UPDATE app_analyses h
SET storefront_details = a.details, storefront_fetched_at = now()
FROM apps a
WHERE a.appid = h.appid AND a.details IS NOT NULL;

UPDATE app_analyses SET app_version = analysis->>'version'
WHERE app_version IS NULL AND analysis->>'version' IS NOT NULL;
