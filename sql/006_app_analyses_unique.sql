-- 006: at most one history row per app and analysis time.
--
-- Safe while the previous release runs: that release writes history with
-- ON CONFLICT DO NOTHING, which this unique index makes effective. Deleting exact
-- duplicates (the lowest id is kept) loses no distinct analysis.
DELETE FROM app_analyses a
USING app_analyses b
WHERE a.appid = b.appid
  AND a.analysed = b.analysed
  AND a.id > b.id;

CREATE UNIQUE INDEX IF NOT EXISTS app_analyses_appid_analysed_key
    ON app_analyses (appid, analysed);
