SELECT appid FROM apps
    WHERE retry_due AND CASE WHEN ((held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version) AND analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[GREATEST(failure_streak, 1)]) <= now()) THEN true ELSE false END
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED