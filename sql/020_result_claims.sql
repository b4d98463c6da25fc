-- 020: what the queue needs to judge a result it cannot fence with a claim token, to
-- answer a retried result truthfully, to let an operator's refetch wait for a live lease,
-- and to back off an app whose leases keep expiring (docs/queue.md, "Results").
--
-- apps.result_claim_token     the claim whose result is stored now (its token), or NULL
--                             when the stored result came with no claim open. A result
--                             retried with that token is answered 2xx when it is the
--                             stored one, instead of 409 for a spent token.
-- apps.result_claim_verified  whether that result came with the token (true) or was a
--                             tokenless result attributed to the open claim (false): the
--                             token's holder may still replace an attributed result.
-- apps.lease_attempts         claims in a row whose lease expired without a result (the
--                             claim counts them: 1 from any other state, +1 from an
--                             expired lease). An expired lease at the limit is no longer a
--                             candidate; the promoter records a lease_expired failure.
-- apps.refetch_requested      an operator's refetch asked while a live lease held the
--                             app: the app is queued again when that lease's result
--                             arrives, or when the lease expires.
--
-- Safe while the previous release runs, and the old server's releases:
-- * ADD COLUMN with a constant default, or none, changes only the catalog (PostgreSQL
--   11+): no rewrite, no scan; the ACCESS EXCLUSIVE lock is held for a moment, and the
--   runner's lock_timeout bounds the wait for it.
-- * Older releases never name these columns: their INSERTs take the defaults and their
--   UPDATEs leave them as they were. What such a writer leaves behind is harmless here:
--   a result_claim_token of an older claim matches no later claim's token, a stale
--   lease_attempts is reset by this release's next claim of a row that is not processing,
--   and a refetch_requested row that an older release re-queued or claimed is cleared by
--   this release's next claim or result.
-- * No index, no constraint, no data change: nothing here can fail on existing rows.
ALTER TABLE apps
    ADD COLUMN IF NOT EXISTS result_claim_token uuid,
    ADD COLUMN IF NOT EXISTS result_claim_verified boolean NOT NULL DEFAULT false,
-- lease_attempts counts a few claims in a row (MAX_LEASE_ATTEMPTS, 3 by default), never
-- near 2^31, like the integer analysisversion beside it.
-- squawk-ignore prefer-bigint-over-int
    ADD COLUMN IF NOT EXISTS lease_attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS refetch_requested boolean NOT NULL DEFAULT false;
