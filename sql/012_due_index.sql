-- 012: an index of the rows the promoter flagged due, for clearing flags a new policy
-- no longer supports (a longer staleness window or lease, an older current version)
-- without reading the whole table.
--
-- Safe while the previous release runs: an index changes no row and no column; it is
-- small (flagged rows only) and builds under a SHARE lock that blocks writes only for
-- as long as one pass over apps takes.
CREATE INDEX IF NOT EXISTS apps_due ON apps (appid) WHERE due;
