
WITH found AS (
    SELECT name, revoked IS NOT NULL AS revoked FROM operators WHERE name = :name FOR UPDATE
), rotated AS (
    UPDATE operators
    SET previous_token_hash = CASE WHEN :overlap_seconds > 0 THEN token_hash END,
        (rotated, previous_token_expires) = (
            SELECT at, CASE WHEN :overlap_seconds > 0
                            THEN at + make_interval(secs => :overlap_seconds) END
            FROM (SELECT clock_timestamp() AS at) AS stamp),
        token_hash = :token_hash
    FROM found WHERE operators.name = found.name AND NOT found.revoked
    RETURNING operators.name, operators.rotated, operators.previous_token_expires
)
SELECT found.name, found.revoked, rotated.rotated, rotated.previous_token_expires
FROM found LEFT JOIN rotated ON rotated.name = found.name
