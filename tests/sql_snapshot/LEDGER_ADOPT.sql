
UPDATE schema_migrations SET checksum = :checksum WHERE filename = :filename AND checksum IS NULL
