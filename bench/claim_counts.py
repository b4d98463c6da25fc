"""The claim's database work in counts, against a textbook SKIP LOCKED queue beside it.

    python3 bench/claim_counts.py [--apps 10000 --apps 1000000] [--claims 2000] [--reuse]

Counts do not move with the machine the way time does, so nothing is interleaved. For
each size, the database `bench_counts_<N>` is built as bench/claims.py builds its own
(ledger state 006, bench/claims_data.py, upgraded to the head by handler.migrate), and
beside `apps` a textbook queue: `textbook_queue`, the same N payloads (each app's
details) and priorities (its popularity), one partial index on the queued rows' order,
claimed by the textbook statement (TEXTBOOK_CLAIM). The promoter then flags every row
due by time, as a running service keeps them, and the rows' queue state is kept
(`bench_snapshot`) to put back. Then, for each of the two:

1. the claimed rows put back, the table vacuumed, and a CHECKPOINT, as production meets
   a claim (a checkpoint every few minutes: the first change to a page after one logs
   the whole page);
2. --claims claims, each its own transaction: ours is handler's CLAIM_NEXT_APP prepared
   with a generic plan as the API connection runs it, under EXPLAIN (ANALYZE, BUFFERS,
   WAL, TIMING OFF), which gives the buffers it dirtied and hit; the WAL between the
   checkpoint and the last claim is read back with pg_walinspect, keeping the records of
   this database and their transactions' commits: records, bytes with and without page
   images, page images per relation (how many, and their bytes), index entries written
   per index (btree inserts), and the share of HOT updates;
3. again from a checkpoint, the same claims without EXPLAIN, the backend's CPU read from
   /proc/<pid>/stat (clock ticks, summed over all the claims): each claim statement alone
   on a bare connection (`statement_cpu_us`), and ours once more from a checkpoint as a
   request makes it, handler.claim_next_app on the API's own connection, promotion
   included (`cpu_us`, which the target judges); and the apps that the statement
   alone claimed, again from a checkpoint, each claimed by name (CLAIM_NAMED_APP: one
   lookup and the same writes, no queue head read), the floor of a claim of apps
   (`named_statement_cpu_us`).

Ends with `name=value target` lines; a missed target makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

import claims
import claims_data
import claims_upgrade
import pg8000.native

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
TEXTBOOK = """
DROP TABLE IF EXISTS textbook_queue;
CREATE TABLE textbook_queue (
    id bigserial PRIMARY KEY,
    payload jsonb NOT NULL,
    priority bigint NOT NULL,
    state text NOT NULL DEFAULT 'queued',
    locked_at timestamptz
);
INSERT INTO textbook_queue (payload, priority)
SELECT details, app_popularity(details) FROM apps ORDER BY random();
CREATE INDEX textbook_queue_next ON textbook_queue (priority DESC, id) WHERE state = 'queued';
"""
TEXTBOOK_CLAIM = """
UPDATE textbook_queue SET state = 'running', locked_at = now()
WHERE id = (SELECT id FROM textbook_queue WHERE state = 'queued'
            ORDER BY priority DESC, id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, payload
"""
# The WAL of this database between two positions: its records (a block of one of its
# relations) and the commit records of their transactions.
OUR_WAL = """
WITH records AS (
    SELECT * FROM pg_get_wal_records_info(CAST(:start AS pg_lsn), CAST(:end AS pg_lsn))
), ours AS (
    SELECT * FROM records WHERE block_ref ~ ('/' || :db || '/[0-9]+')
)
SELECT resource_manager, record_type, record_length, fpi_length, block_ref FROM ours
UNION ALL
SELECT resource_manager, record_type, record_length, fpi_length, block_ref FROM records
WHERE resource_manager = 'Transaction' AND xid IN (SELECT xid FROM ours)
"""
LEAF_ENTRY_RECORDS = ("INSERT_LEAF", "INSERT_POST", "SPLIT_L", "SPLIT_R")
# One block a record refers to, and whether the record holds that page's whole image.
BLOCK_REF = re.compile(r"rel \d+/\d+/(\d+) fork (\w+) blk \d+( \(FPW\))?")
TARGETS = {  # ours ÷ the textbook's, per claim (issue 39)
    "wal_bytes_vs_textbook": 1.5,
    "dirtied_vs_textbook": 2.0,
    "cpu_vs_textbook": 2.0,
}


def backend_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def wait_for_flush(sql, lsn: str) -> None:
    """Until the WAL up to `lsn` is flushed (pg_walinspect reads no further): the WAL
    writer flushes within wal_writer_delay; this waits for what it does, not a time."""
    for _ in range(1000):
        if sql.run("SELECT pg_current_wal_flush_lsn() >= CAST(:lsn AS pg_lsn)", lsn=lsn)[0][0]:
            return
        time.sleep(0.01)
    raise RuntimeError(f"the WAL was not flushed to {lsn} in 10 s")


def fresh_start(sql) -> None:
    """Both queues as built (every claim undone), vacuumed, after a checkpoint."""
    sql.run(
        """UPDATE apps a SET status = s.status, processing_started = s.processing_started,
               due = s.due, analysis_claim_token = s.analysis_claim_token
           FROM bench_snapshot s
           WHERE a.appid = s.appid
             AND (a.status, a.processing_started, a.analysis_claim_token)
                 IS DISTINCT FROM (s.status, s.processing_started, s.analysis_claim_token)"""
    )
    sql.run("UPDATE textbook_queue SET state = 'queued', locked_at = NULL WHERE state <> 'queued'")
    sql.run("VACUUM (INDEX_CLEANUP ON) apps")
    sql.run("VACUUM (INDEX_CLEANUP ON) textbook_queue")
    sql.run("CHECKPOINT")


def wal_counts(sql, start: str, end: str, names: dict[str, str]) -> dict:
    """The WAL of this database between `start` and `end`, in counts."""
    db = str(sql.run("SELECT oid FROM pg_database WHERE datname = current_database()")[0][0])
    records = sql.run(OUR_WAL, start=start, end=end, db=db)
    per_index: dict[str, int] = {}
    # Page images per relation (and fork, but the main one): how many, and their bytes. A
    # record holding several images (a leaf split's) shares its image bytes among them.
    images: dict[str, int] = {}
    image_bytes: dict[str, float] = {}
    updates = hot = 0
    for manager, kind, _, image_length, block_ref in records:
        imaged = [
            names.get(node, node) + ("" if fork == "main" else f" ({fork})")
            for node, fork, image in BLOCK_REF.findall(block_ref or "")
            if image
        ]
        for name in imaged:
            images[name] = images.get(name, 0) + 1
            image_bytes[name] = image_bytes.get(name, 0) + image_length / len(imaged)
        # A row's entry goes in by a leaf insert, or with the split of its leaf (a
        # split's downlink to the parent, INSERT_UPPER, is no row's entry).
        if manager == "Btree" and kind in LEAF_ENTRY_RECORDS:
            node = block_ref.split("/")[2].split()[0] if block_ref else "?"
            name = names.get(node, node)
            per_index[name] = per_index.get(name, 0) + 1
        if manager in ("Heap", "Heap2") and kind.startswith(("UPDATE", "HOT_UPDATE")):
            updates += 1
            hot += kind.startswith("HOT_UPDATE")
    return {
        "records": len(records),
        "bytes": sum(r[2] for r in records),
        "bytes_without_images": sum(r[2] - r[3] for r in records),
        "images": sum(1 for r in records if r[3]),
        "index_entries": per_index,
        "images_per_relation": images,
        "image_bytes_per_relation": image_bytes,
        "hot_share": hot / updates if updates else float("nan"),
    }


def claim_values(policy) -> dict:
    """A claim's parameters: a new token, the shared password's claim, the policy."""
    return {"token": uuid.uuid4(), "analyser": None, **policy.sql_params()}


def cpu_per_statement(url: str, text: str, executions: list[list]) -> tuple[float, list]:
    """The backend's CPU µs per execution of `text`, prepared with a generic plan on a
    bare connection and executed once with each list of values, and the rows returned."""
    bare = claims_data.connect(url, "bench-cpu")
    bare.run("SET plan_cache_mode = force_generic_plan")
    bare.run(f"PREPARE statement AS {text}")
    pid = bare.run("SELECT pg_backend_pid()")[0][0]
    rows = []
    before = backend_cpu_seconds(pid)
    for values in executions:
        arguments = ", ".join(pg8000.native.literal(v) for v in values)
        rows += bare.run(f"EXECUTE statement({arguments})" if values else "EXECUTE statement")
    spent = backend_cpu_seconds(pid) - before
    bare.close()
    return spent / len(executions) * 1e6, rows


def measure(handler, sql, url: str, name: str, claims_count: int) -> dict:
    """One queue's counts per claim (module docstring, steps 1 to 3)."""
    relfilenodes = {
        str(node): rel for node, rel in sql.run("SELECT relfilenode, relname FROM pg_class")
    }
    policy = handler.settings().policy
    if name == "ours":
        text, make_values = pg8000.native.to_statement(handler.CLAIM_NEXT_APP)
    else:
        text, make_values = TEXTBOOK_CLAIM, None
    sql.run("SET plan_cache_mode = force_generic_plan")
    sql.run(f"PREPARE claim AS {text}")
    fresh_start(sql)
    # A temporary slot keeps the WAL from here until it is read (a checkpoint meanwhile,
    # timed or another session's, would otherwise recycle it); it ends with the session.
    sql.run("SELECT pg_create_physical_replication_slot('bench_counts', true, true)")
    start = sql.run("SELECT CAST(pg_current_wal_insert_lsn() AS text)")[0][0]
    hit = dirtied = made = 0
    for _ in range(claims_count):
        if make_values:
            values = ", ".join(pg8000.native.literal(v) for v in make_values(claim_values(policy)))
            execute = f"EXECUTE claim({values})"
        else:
            execute = "EXECUTE claim"
        (plan,) = sql.run(f"EXPLAIN (ANALYZE, BUFFERS, WAL, TIMING OFF, FORMAT JSON) {execute}")[0]
        top = (plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]
        hit += top["Shared Hit Blocks"]
        dirtied += top["Shared Dirtied Blocks"]
        made += round(top["Actual Rows"])  # 0: the queue was empty (PostgreSQL 18: 1.00)
    if not made:
        raise RuntimeError(f"{name}: no claim was made (an empty queue?)")
    end = sql.run("SELECT CAST(pg_current_wal_insert_lsn() AS text)")[0][0]
    wait_for_flush(sql, end)
    sql.run("DEALLOCATE claim")
    sql.run("RESET plan_cache_mode")
    wal = wal_counts(sql, start, end, relfilenodes)
    sql.run("SELECT pg_drop_replication_slot('bench_counts')")

    # The claim statement alone, as many as the counted run made, on a bare connection
    # with a generic plan (the textbook's one statement is its whole claim).
    fresh_start(sql)
    executions = [make_values(claim_values(policy)) if make_values else [] for _ in range(made)]
    statement_cpu_us, claimed = cpu_per_statement(url, text, executions)
    cpu_us = statement_cpu_us
    found = {}
    if name == "ours":  # and the whole claim, as a request makes it: promotion included
        fresh_start(sql)
        db = handler.api_connection()
        pid = db.run("SELECT pg_backend_pid()")[0][0]
        before = backend_cpu_seconds(pid)
        for _ in range(made):
            handler.claim_next_app(db, policy)
        cpu_us = (backend_cpu_seconds(pid) - before) / made * 1e6
        # The same apps claimed by name (CLAIM_NAMED_APP, `GET /queue?appId=`): one lookup
        # by the bundle ID and the same writes, no queue head read. Each is a candidate
        # again after fresh_start, so each is claimed: otherwise the figure would time
        # lookups that write nothing.
        fresh_start(sql)
        named, make_named = pg8000.native.to_statement(handler.CLAIM_NAMED_APP)
        found["named_statement_cpu_us"], named_claims = cpu_per_statement(
            url, named, [make_named({"appid": a, **claim_values(policy)}) for (a,) in claimed]
        )
        if len(named_claims) != len(claimed):
            raise RuntimeError(f"{len(named_claims)} of {len(claimed)} apps claimed by name")
    n = made
    return {
        "claims": made,
        "wal_bytes": wal["bytes"] / n,
        "wal_bytes_without_images": wal["bytes_without_images"] / n,
        "wal_records": wal["records"] / n,
        "page_images": wal["images"] / n,
        "dirtied": dirtied / n,
        "hit": hit / n,
        "index_entries": sum(wal["index_entries"].values()) / n,
        "per_index": {k: v / n for k, v in sorted(wal["index_entries"].items())},
        "images_per_relation": {
            k: v / n for k, v in sorted(wal["images_per_relation"].items(), key=lambda kv: -kv[1])
        },
        "image_bytes_per_relation": {k: v / n for k, v in wal["image_bytes_per_relation"].items()},
        "hot_share": wal["hot_share"],
        "cpu_us": cpu_us,
        "statement_cpu_us": statement_cpu_us,
        **found,
    }


def run_size(n: int, args: argparse.Namespace) -> dict[str, dict]:
    url = claims_data.bench_database(args.server_url, f"bench_counts_{n}", args.reuse)
    sql = claims_data.connect(url, "bench-counts")
    sql.run("SET statement_timeout = 0")
    claims.say(f"== {n:,} apps: {url} (load {claims.load()})")
    if not args.reuse:
        started = time.perf_counter()
        claims_data.build_legacy_database(sql, ROOT / "sql", n, args.seed, 1000)
        claims.say(f"   built at ledger 006 in {time.perf_counter() - started:.1f} s")
    claims.service_env(url)
    handler = claims.import_handler()
    handler.use_runtime(None)
    claims_upgrade.run_ledger(handler)
    sql.run("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    if not args.reuse or not sql.run("SELECT to_regclass('textbook_queue')")[0][0]:
        sql.execute_simple(TEXTBOOK)
    # The promoter flags every row due by time (stale analyses, expired leases), as a
    # running service keeps them flagged: a claim then reads the flagged rows' index, not
    # the unflagged heads that catch up while the promoter is behind. Done once here, so
    # that no measurement pays for it, and the state every measurement starts from is
    # taken after it (each put back to it).
    while not handler.promote_due_apps(
        handler.api_connection(), handler.settings().policy
    ).complete:
        pass
    sql.run("DROP TABLE IF EXISTS bench_snapshot")
    sql.run(
        "CREATE TABLE bench_snapshot AS"
        " SELECT appid, status, processing_started, due, analysis_claim_token FROM apps"
    )
    sql.run("ALTER TABLE bench_snapshot ADD PRIMARY KEY (appid)")
    sql.run("VACUUM ANALYZE apps")
    sql.run("VACUUM ANALYZE textbook_queue")
    found = {
        queue: measure(handler, sql, url, queue, args.claims) for queue in ("ours", "textbook")
    }
    fresh_start(sql)
    handler.use_runtime(None)
    sql.close()
    for queue, counts in found.items():
        indexes = ", ".join(f"{k} {v:.2f}" for k, v in counts["per_index"].items())
        image_bytes = counts["image_bytes_per_relation"]
        images = ", ".join(
            f"{k} {v:.2f} ({image_bytes[k]:,.0f} B)"
            for k, v in counts["images_per_relation"].items()
            if v >= 0.005
        )
        named = (
            f"; the same apps claimed by name {counts['named_statement_cpu_us']:.0f}"
            if "named_statement_cpu_us" in counts
            else ""
        )
        claims.say(
            f"   {queue:<9} {counts['claims']} claims: WAL {counts['wal_bytes']:8.0f} B"
            f" ({counts['wal_bytes_without_images']:.0f} without page images,"
            f" {counts['page_images']:.2f} images: {images}), {counts['wal_records']:.2f} records;"
            f" dirtied {counts['dirtied']:.2f}, hit {counts['hit']:.1f};"
            f" index entries {counts['index_entries']:.2f} ({indexes});"
            f" HOT {counts['hot_share']:.0%}; CPU {counts['cpu_us']:.0f} µs"
            f" (the statement alone {counts['statement_cpu_us']:.0f}{named})"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--apps", type=int, action="append")
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--server-url", default=claims_data.DEFAULT_SERVER)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reuse", action="store_true", help="measure bench_counts_<N> again")
    args = parser.parse_args(argv)
    sizes = args.apps or [10_000, 1_000_000]
    results = {n: run_size(n, args) for n in sizes}
    largest = results[max(sizes)]
    ours, textbook = largest["ours"], largest["textbook"]
    claims.say()
    for key in ("wal_bytes", "wal_bytes_without_images", "wal_records", "page_images"):
        claims.say(f"ours_{key}={ours[key]:.2f} reported")
        claims.say(f"textbook_{key}={textbook[key]:.2f} reported")
    for key in ("dirtied", "hit", "index_entries", "hot_share", "cpu_us", "statement_cpu_us"):
        claims.say(f"ours_{key}={ours[key]:.2f} reported")
        claims.say(f"textbook_{key}={textbook[key]:.2f} reported")
    claims.say(f"ours_named_statement_cpu_us={ours['named_statement_cpu_us']:.2f} reported")
    missed = 0
    for figure, key in (
        ("wal_bytes_vs_textbook", "wal_bytes"),
        ("dirtied_vs_textbook", "dirtied"),
        ("cpu_vs_textbook", "cpu_us"),
    ):
        value = ours[key] / textbook[key] if textbook[key] else float("nan")
        met = value <= TARGETS[figure]
        missed += not met
        claims.say(f"{figure}={value:.2f} target<={TARGETS[figure]:g} {'met' if met else 'MISSED'}")
    floor = textbook["statement_cpu_us"]  # 0 when the run was shorter than a clock tick
    for key in ("statement_cpu_us", "named_statement_cpu_us"):
        alone = ours[key] / floor if floor else float("nan")
        claims.say(f"{key.removesuffix('_us')}_vs_textbook={alone:.2f} reported")
    # What each relation's page images cost a claim: where the WAL over the textbook's goes.
    for queue, counts in (("ours", ours), ("textbook", textbook)):
        for relation, images in counts["images_per_relation"].items():
            if images >= 0.005:
                size = counts["image_bytes_per_relation"][relation]
                claims.say(f"{queue}_image_bytes_{relation}={size:.0f} reported")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
