
UPDATE apps SET held_at = now(), held_by = :actor, hold_reason = :reason, due = false,
                retry_due = false
WHERE appid = :appid
RETURNING held_at
