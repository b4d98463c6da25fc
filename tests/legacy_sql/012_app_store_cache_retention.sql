-- Test fixture: the old server's 012. The website expires its cache by age.
CREATE INDEX app_store_cache_fetched_at ON app_store_cache (fetched_at);
