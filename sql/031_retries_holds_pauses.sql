-- 031: what a queue that heals itself needs: retries with back-off, apps held back,
-- analysers and the whole queue paused (docs/queue.md, "Retries", "Holding an app" and
-- "Pausing an analyser or the queue").
--
-- apps.failure_streak: the stored result's failures in a row at its analysis version
-- (0 after a success, a refetch; 1 for a first failure). The Nth retry waits the Nth
-- step of RETRY_BACKOFF after the Nth failure. Rows from before this file are counted as
-- one failure (the column is added with DEFAULT 1, then new rows get 0): an app failed
-- before the upgrade is retried once, in the lowest tier, an hour after its failure.
-- apps.retry_due: the promoter's flag for a failure whose retry has fallen due, as `due`
-- is for the other rows; the claim reads the flagged rows from their own index (032)
-- only when no other candidate exists. apps.held_at, held_by, hold_reason: an operator's
-- hold ("do not analyse"); a held app is no candidate, by any rule, until released.
-- analysers.paused_at, paused_by: a paused analyser's GET /queue answers as an empty
-- queue does. analysers.failure_streak, failing_since: its results' failures in a row
-- and when the first of them came, to tell a broken analyser (docs/monitoring.md). queue_pause: one row; while its paused_at is set the whole queue is
-- paused (every claim answers empty). Resuming clears it: the API role deletes no row.
-- queue_policy.retry_backoff: the RETRY_BACKOFF the promoter's retry flags were set
-- under; when it changes, the flags are cleared and set again under the new one.
--
-- Safe while the previous release runs:
-- * Every column is added with a constant default or none: a catalog change, no rewrite,
--   no scan. SET DEFAULT changes the catalog only (rows already there keep 1).
-- * The previous release never names these columns: it claims, stores and refetches as
--   before. In the deploy window it may hand out a held app or claim for a paused
--   analyser (it knows neither); this release re-checks both on every claim, so each
--   holds again from the moment the deploy ends. A retry flag that release leaves on a
--   row it changed is bookkeeping only: the claim re-checks the retry rule.
-- * queue_pause is a new table no release before names; the least-privilege block of
--   docs/operations.md grants the API role its rights through ALTER DEFAULT PRIVILEGES,
--   and every role may read it (below).
-- * One short transaction; ACCESS EXCLUSIVE on apps, analysers and queue_policy only for
--   the catalog change (under the runner's lock_timeout).
ALTER TABLE apps
-- Failures in a row of one app, as lease_attempts beside it: an integer is plenty.
-- squawk-ignore prefer-bigint-over-int
    ADD COLUMN IF NOT EXISTS failure_streak integer NOT NULL DEFAULT 1,
    ADD COLUMN IF NOT EXISTS retry_due boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS held_at timestamptz,
    ADD COLUMN IF NOT EXISTS held_by text,
    ADD COLUMN IF NOT EXISTS hold_reason text;
ALTER TABLE apps ALTER COLUMN failure_streak SET DEFAULT 0;

ALTER TABLE analysers
    ADD COLUMN IF NOT EXISTS paused_at timestamptz,
    ADD COLUMN IF NOT EXISTS paused_by text,
-- Failures in a row of one host's results: an integer is plenty.
-- squawk-ignore prefer-bigint-over-int
    ADD COLUMN IF NOT EXISTS failure_streak integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS failing_since timestamptz;

ALTER TABLE queue_policy ADD COLUMN IF NOT EXISTS retry_backoff text;

CREATE TABLE IF NOT EXISTS queue_pause (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    paused_at timestamptz,
    paused_by text,
    reason text
);
INSERT INTO queue_pause (singleton) VALUES (true) ON CONFLICT DO NOTHING;
-- Every claim reads queue_pause: any role that may claim must read it, or every claim
-- would fail (a least-privilege role set up without the default privileges of
-- docs/operations.md). Reading it tells nothing but whether the queue is paused;
-- pausing (UPDATE) stays with the roles granted it.
GRANT SELECT ON queue_pause TO PUBLIC;
