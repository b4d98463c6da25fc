-- 015: analysis_day(analysed), the day (UTC, days since 1970) an analysis was made, for
-- the index of 016.
--
-- Why: the claim must hand out the first candidate of the rule even while the promoter
-- has not yet flagged every stale analysis (after STALE_ANALYSIS_DAYS is lowered, say,
-- hundreds of thousands of rows fall due at once and are flagged in bounded batches over
-- many requests). 016 orders the unflagged analysed rows by day, then in claim order, so
-- the claim reads the head of each day that is stale: one probe per day, not a scan.
--
-- Safe while the previous release runs: a new function, used by nothing it runs.
-- IMMUTABLE is true: the epoch of a timestamptz does not depend on the time zone.
-- NULL and -infinity (legacy rows; the rule treats NULL as "never analysed") sort first,
-- +infinity last.
CREATE OR REPLACE FUNCTION analysis_day(analysed timestamptz) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN analysed IS NULL OR analysed = '-infinity' THEN -2147483648
        WHEN analysed = 'infinity' THEN 2147483647
        ELSE floor(extract(epoch FROM analysed) / 86400)::integer
    END
$$;
