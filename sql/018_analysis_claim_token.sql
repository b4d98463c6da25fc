-- 018: one claim token for this service and the old server: apps.analysis_claim_token.
--
-- Why this column. The old server's claim-token release (its 010_analysis_claim_tokens)
-- added apps.analysis_claim_token uuid and the CHECK apps_processing_claim_token_check:
-- a processing row has a token, any other row has none. A database it migrated keeps
-- that CHECK, and a claim that sets only this service's claim_token (text, sql/010)
-- breaks it. So from here on both releases share one token, that uuid column: this
-- service writes it on every claim (a random UUID made in handler.py), clears it on
-- every result and refetch, and compares it in handler.py. One column, one source of
-- truth, and the same schema whatever path led here: on a database that never had the
-- old server's 010, this file adds the column and the same CHECK.
--
-- claim_token (text, sql/010) stays and is no longer written by this release. Dropping
-- it would break the previous release of this service during the deploy window: every
-- one of its claims, results and refetches names that column.
--
-- The runner knows the old server's files by name and never orders its own files against
-- them, so on a database at the old server's 013 this file simply runs
-- (tests/test_adoption.py).
--
-- Safe while the previous release runs:
-- * The column is added without a default: a catalog change, no rewrite. On a database
--   from the old server's 010 it is already there, with its tokens, and stays as it is.
-- * The triggers keep the CHECK for writers that do not know the column: the previous
--   release of this service, whose claims set only claim_token and whose results and
--   refetches leave processing without clearing this column. Entering processing
--   without a token gets a fresh random one, and so does a renewed lease that set a new
--   claim_token but kept this one (that release re-claiming an expired lease: the
--   holder of the old uuid is fenced off); leaving processing clears it. Writers that
--   set this column themselves (this release, the old server's) pass through unchanged.
--   They fire only when status or a token is written (so the promoter's flag updates do
--   not run them), and only in the cases they repair.
-- * Rows processing now (claimed by the previous release, without a uuid token) get a
--   random token: a result with no token is still accepted; one with the previous
--   release's text token is refused (409) and the app is analysed again once its lease
--   expires. The UPDATE reads them through apps_processing_started (sql/007).
-- * The CHECK is dropped if the old server added it and added again with the same
--   condition, NOT VALID: the lock it takes is held only for the catalog change, with no
--   scan; every write from now on is checked. 019 validates it in a transaction of its
--   own, which blocks no reads or writes. (Adding it only where it is missing would need
--   a DO block, which hides the statement from the zero-downtime check in the tests.)
-- * Everything here is one short transaction under apps' ACCESS EXCLUSIVE lock (the
--   ADD COLUMN); no statement scans the table.
ALTER TABLE apps ADD COLUMN IF NOT EXISTS analysis_claim_token uuid;

CREATE OR REPLACE FUNCTION apps_claim_token_follows_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status <> 'processing' THEN
        NEW.analysis_claim_token := NULL;
    ELSIF NEW.analysis_claim_token IS NULL
       OR (TG_OP = 'UPDATE'
           AND NEW.analysis_claim_token = OLD.analysis_claim_token
           AND NEW.claim_token IS DISTINCT FROM OLD.claim_token
           AND NEW.claim_token IS NOT NULL) THEN
        NEW.analysis_claim_token := gen_random_uuid();
    END IF;
    RETURN NEW;
END $$;

-- The WHEN conditions are the cases the function repairs, evaluated without calling it:
-- this release's claims, results and refetches (which keep the CHECK themselves) never
-- enter PL/pgSQL. DROP and CREATE rather than CREATE OR REPLACE TRIGGER, which needs
-- PostgreSQL 14 (gen_random_uuid needs 13); all in this file's one transaction.
DROP TRIGGER IF EXISTS apps_claim_token_on_insert ON apps;
CREATE TRIGGER apps_claim_token_on_insert
    BEFORE INSERT ON apps FOR EACH ROW
    WHEN ((NEW.status = 'processing') <> (NEW.analysis_claim_token IS NOT NULL))
    EXECUTE FUNCTION apps_claim_token_follows_status();
DROP TRIGGER IF EXISTS apps_claim_token_on_update ON apps;
CREATE TRIGGER apps_claim_token_on_update
    BEFORE UPDATE OF status, analysis_claim_token, claim_token ON apps FOR EACH ROW
    WHEN ((NEW.status = 'processing') <> (NEW.analysis_claim_token IS NOT NULL)
          OR (NEW.status = 'processing'
              AND NEW.analysis_claim_token = OLD.analysis_claim_token
              AND NEW.claim_token IS DISTINCT FROM OLD.claim_token
              AND NEW.claim_token IS NOT NULL))
    EXECUTE FUNCTION apps_claim_token_follows_status();

UPDATE apps SET analysis_claim_token = gen_random_uuid()
WHERE status = 'processing' AND analysis_claim_token IS NULL;

ALTER TABLE apps DROP CONSTRAINT IF EXISTS apps_processing_claim_token_check;
ALTER TABLE apps ADD CONSTRAINT apps_processing_claim_token_check
    CHECK ((status = 'processing' AND analysis_claim_token IS NOT NULL)
           OR (status <> 'processing' AND analysis_claim_token IS NULL)) NOT VALID;
