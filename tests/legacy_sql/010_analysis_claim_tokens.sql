-- Test fixture: the old server's 010, written here from what it is known to have done (it
-- is not this service's file and never runs in production from this repository).
-- A claim token column, every lease ended (processing rows back to queued), and the CHECK
-- tying a token to the processing state, added valid.
ALTER TABLE apps ADD COLUMN analysis_claim_token uuid;

UPDATE apps SET status = 'queued', processing_started = NULL WHERE status = 'processing';

ALTER TABLE apps ADD CONSTRAINT apps_processing_claim_token_check
    CHECK ((status = 'processing' AND analysis_claim_token IS NOT NULL)
           OR (status <> 'processing' AND analysis_claim_token IS NULL));
