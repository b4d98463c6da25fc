
SELECT appid, status, {rows} AS selected, {outcome} AS outcome FROM apps
WHERE appid > :after ORDER BY appid LIMIT :batch
