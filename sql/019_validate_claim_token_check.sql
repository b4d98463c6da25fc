-- 019: validate apps_processing_claim_token_check (added NOT VALID by 018).
--
-- Safe while the previous release runs: VALIDATE CONSTRAINT scans apps under a SHARE
-- UPDATE EXCLUSIVE lock, which lets every read and write go on (only other schema
-- changes wait). Every row passes: 018 gave the processing rows a token, no other row
-- ever had one, and writes since 018 were checked. Validated, the CHECK is what the old
-- server's release expects to find (and what PostgreSQL may rely on).
ALTER TABLE apps VALIDATE CONSTRAINT apps_processing_claim_token_check;
