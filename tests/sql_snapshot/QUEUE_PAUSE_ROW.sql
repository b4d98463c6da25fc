
INSERT INTO queue_pause (singleton) VALUES (true) ON CONFLICT DO NOTHING
