
UPDATE analysers SET last_result_app = :appid, last_result_at = now(),
                     last_result_success = :success, last_result_version = :version
WHERE name = :name
