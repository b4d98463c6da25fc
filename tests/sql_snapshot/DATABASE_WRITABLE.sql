
SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'
