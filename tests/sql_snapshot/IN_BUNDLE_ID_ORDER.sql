
SELECT * FROM (
    (SELECT {columns}
     FROM apps WHERE status <> 'processing' AND ({where})
     ORDER BY lower(appid) COLLATE "C" LIMIT {limit})
  UNION ALL
    (SELECT {columns}
     FROM apps WHERE status = 'processing' AND ({where})
     ORDER BY lower(appid) COLLATE "C" LIMIT {limit})
) AS ordered
ORDER BY sort_key LIMIT {limit}
