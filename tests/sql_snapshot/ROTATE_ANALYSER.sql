
WITH found AS (
    SELECT name, revoked IS NOT NULL AS revoked FROM analysers WHERE name = :name FOR UPDATE
), rotated AS (
    UPDATE analysers
    SET previous_token_hash = CASE WHEN :overlap_seconds > 0 THEN token_hash END,
        previous_token_expires = CASE WHEN :overlap_seconds > 0
                                      THEN now() + make_interval(secs => :overlap_seconds) END,
        token_hash = :token_hash, rotated = clock_timestamp()
    FROM found WHERE analysers.name = found.name AND NOT found.revoked
    RETURNING analysers.name, analysers.rotated, analysers.previous_token_expires
)
SELECT found.name, found.revoked, rotated.rotated, rotated.previous_token_expires
FROM found LEFT JOIN rotated ON rotated.name = found.name
