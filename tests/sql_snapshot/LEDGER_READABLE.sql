
SELECT to_regclass('schema_migrations') IS NOT NULL AS ledger,
       COALESCE(has_table_privilege(to_regclass('schema_migrations'), 'SELECT'), false)
           AS readable
