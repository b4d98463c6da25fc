
SELECT count(*) FROM operator_actions
WHERE action = 'sign-in refused' AND source = :source
  AND at > now() - make_interval(mins => :minutes)
