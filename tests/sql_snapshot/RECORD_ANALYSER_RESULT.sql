
UPDATE analysers SET last_result_app = :appid, last_result_at = now(),
                     last_result_success = :success, last_result_version = :version,
                     failure_streak = CASE WHEN :success THEN 0 ELSE failure_streak + 1 END,
                     failing_since = CASE WHEN :success THEN NULL
                                          WHEN failure_streak = 0 THEN now()
                                          ELSE COALESCE(failing_since, now()) END
WHERE name = :name
