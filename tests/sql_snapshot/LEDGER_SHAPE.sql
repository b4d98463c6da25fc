
SELECT to_regclass('schema_migrations') IS NOT NULL AS ledger,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('schema_migrations')
               AND attname = 'checksum' AND NOT attisdropped) AS checksums
