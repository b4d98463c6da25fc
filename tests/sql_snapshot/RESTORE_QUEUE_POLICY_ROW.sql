
INSERT INTO queue_policy (singleton) VALUES (true) ON CONFLICT DO NOTHING
