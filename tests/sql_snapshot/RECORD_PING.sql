
INSERT INTO analyser_heartbeats (analyser_id, last_seen, source_address, user_agent)
VALUES (:analyser_id, now(), :source_address, :user_agent)
ON CONFLICT (analyser_id) DO UPDATE
SET last_seen = now(), source_address = EXCLUDED.source_address,
    user_agent = EXCLUDED.user_agent, pings = analyser_heartbeats.pings + 1
