-- 001: app_analyses keeps every analysis ever stored, so a refetch never loses a result.
--
-- Safe while the previous release runs: a new table and its indexes; the copy only reads
-- apps. Processing markers are not analyses, so they are not copied.
CREATE TABLE IF NOT EXISTS app_analyses (
    id bigserial PRIMARY KEY,
    appid text NOT NULL REFERENCES apps ON DELETE CASCADE,
    analysis json NOT NULL,
    analysisversion integer,
    analysed timestamp without time zone NOT NULL DEFAULT now(),
    app_version text,
    app_store_updated timestamp without time zone,
    analysis_source text,
    success boolean NOT NULL DEFAULT true
);
CREATE INDEX IF NOT EXISTS app_analyses_appid_analysed ON app_analyses (appid, analysed DESC);
CREATE INDEX IF NOT EXISTS app_analyses_version_analysed ON app_analyses (analysisversion, analysed DESC);

INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version, analysis_source, success)
SELECT appid,
       analysis,
       analysisversion,
       COALESCE(analysed, added),
       details->>'version',
       analysis->>'analysis_source',
       analysis->>'success' IS DISTINCT FROM 'false'
FROM apps
WHERE analysis IS NOT NULL
  AND analysis->>'logs' IS DISTINCT FROM 'Processing in progress';
