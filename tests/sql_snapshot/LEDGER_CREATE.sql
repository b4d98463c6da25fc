
CREATE TABLE IF NOT EXISTS schema_migrations (
    filename text PRIMARY KEY,
    applied_at timestamp without time zone NOT NULL DEFAULT now()
)
