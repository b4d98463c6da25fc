
SELECT n.nspname, c.relname
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE NOT i.indisvalid
  AND n.nspname = current_schema()
  AND c.relname = ANY(regexp_split_to_array(lower(:file_text), '[^a-z0-9_$]+'))
