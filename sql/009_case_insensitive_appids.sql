-- 009: one row per bundle ID, whatever its letter case (the App Store ignores case).
--
-- Rows whose bundle IDs differ only by case are merged into one keeper: the row that is
-- analysed, then the one analysed most recently, then the one added first, then the
-- smallest bundle ID. The others' history moves to the keeper; a history row that would
-- then collide with another on (appid, analysed) is dropped first (the keeper's own row
-- wins; between two moved rows the lower id wins). NULL analysed times never collide.
--
-- Safe while the previous release runs: no appid is rewritten (so apps_appid_valid still
-- holds and no reference breaks); the unique index on lower(appid) only rejects a new
-- case variant of an existing app, which that release inserts with ON CONFLICT and which
-- this release treats as the same app.
CREATE TEMPORARY TABLE app_merge ON COMMIT DROP AS
SELECT appid AS loser, keeper
FROM (
    SELECT appid,
           first_value(appid) OVER same_app AS keeper,
           count(*) OVER (PARTITION BY lower(appid)) AS variants
    FROM apps
    WINDOW same_app AS (
        PARTITION BY lower(appid)
        ORDER BY status = 'analysed' DESC, analysed DESC NULLS LAST, added, appid)
) ranked
WHERE variants > 1 AND appid <> keeper;

DELETE FROM app_analyses moved
USING app_merge m
WHERE moved.appid = m.loser
  AND (EXISTS (SELECT 1 FROM app_analyses kept
               WHERE kept.appid = m.keeper AND kept.analysed = moved.analysed)
       OR EXISTS (SELECT 1 FROM app_analyses other
                  JOIN app_merge om ON other.appid = om.loser
                  WHERE om.keeper = m.keeper
                    AND other.analysed = moved.analysed
                    AND other.id < moved.id));

UPDATE app_analyses h SET appid = m.keeper
FROM app_merge m
WHERE h.appid = m.loser;

DELETE FROM apps a USING app_merge m WHERE a.appid = m.loser;

CREATE UNIQUE INDEX IF NOT EXISTS apps_appid_lower_key ON apps (lower(appid));
