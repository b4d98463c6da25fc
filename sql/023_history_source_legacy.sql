-- 023: a history row whose analysis names no source says 'legacy', as the old server
-- writes it on every path (docs/fidelity.md).
--
-- Why. The old server records app_analyses.analysis_source as the analysis's own source
-- when that is a non-empty string and as 'legacy' otherwise: its results, failures,
-- refetches and backfills alike. The website shows that column in an app's history.
-- Rows written without one are NULL (the production ledger's 001 copy, the old server's
-- releases before that rule, this service's releases before this one) or the empty
-- string. From this release on, this service writes the old server's rule itself
-- (handler.HISTORY_SOURCE); this file brings the rows already written in line, and a
-- trigger does the same for the programs that still write none: the previous release
-- of this service during the deploy window, and an old server's release that predates
-- the rule.
--
-- Safe while the previous release runs, and the old server:
-- * The trigger fires only for a row that arrives with no source (its WHEN condition is
--   checked without entering PL/pgSQL): writers that name a source, this release and the
--   old server's, pass through unchanged. No column or constraint changes: a statement
--   that worked before works the same.
-- * CREATE TRIGGER takes app_analyses' SHARE ROW EXCLUSIVE lock until this file commits:
--   history inserts (a result's upload) wait that long, reads never do, and apps is not
--   touched (claims go on). The trigger comes first so that no row inserted while the
--   UPDATE runs can miss both.
-- * The UPDATE sets only analysis_source, which no index covers, on the rows without
--   one. Its scan reads the table's rows; a large analysis is stored out of line (TOAST),
--   is not read, and stays where it is.
-- * Only NULL and '' change: a source someone recorded, whatever it says, is kept.
CREATE OR REPLACE FUNCTION app_analyses_source_or_legacy() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.analysis_source := 'legacy';
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS app_analyses_no_source_is_legacy ON app_analyses;
CREATE TRIGGER app_analyses_no_source_is_legacy
    BEFORE INSERT ON app_analyses FOR EACH ROW
    WHEN (NEW.analysis_source IS NULL OR NEW.analysis_source = '')
    EXECUTE FUNCTION app_analyses_source_or_legacy();

UPDATE app_analyses SET analysis_source = 'legacy'
WHERE analysis_source IS NULL OR analysis_source = '';
