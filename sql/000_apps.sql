-- 000: the apps table, one row per App Store bundle ID.
--
-- Safe while the previous release runs: CREATE TABLE IF NOT EXISTS does nothing on the
-- databases that had this table before the ledger existed, and creates it on a new one.
CREATE TABLE IF NOT EXISTS apps (
    appid text PRIMARY KEY,
    details json,
    analysis json,
    analysisversion integer,
    analysed timestamp without time zone,
    added timestamp without time zone NOT NULL DEFAULT now()
);
