
SELECT appid FROM apps WHERE status = 'processing' AND analysis_claim_token = :token
