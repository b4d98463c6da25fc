"""What one claim writes, in counts, not time (docs/benchmarks.md, "The claim's database
work in counts"): right after a checkpoint, a GET /queue through handler.api writes an
entry in at most CLAIM_INDEX_ENTRIES indexes, each named, and its WAL changes at most
CLAIM_PAGES pages of this database. A later index that a claimed row enters, or a
column that spreads a claim over more pages, fails here the day it is added: the
benchmark (bench/claim_counts.py) says how much, this says that it did.

The WAL is read back with pg_walinspect (a contrib module of PostgreSQL 15 and later,
in the embedded server too); a page is one a WAL record names, so a page changed only by
a hint bit (never WAL-logged without checksums) is not counted.
"""

from __future__ import annotations

import re

import pytest
from kit import ANALYSER, configure_service

from helpers import call_api, gateway_event, insert_app
from markdown_pages import DOCS, table_column

pytestmark = pytest.mark.private_database  # CREATE EXTENSION pg_walinspect

# The claim's writes as they are (sql/ at 039): the row's new version enters the primary
# key, the website's lower(appid) index (009) and the two on leases
# (apps_processing_started, apps_unflagged_leases), and no index of the web view's order
# (037 leaves leased rows out); its pages are one leaf of each of those indexes and the
# row's own heap page, where the new version finds room (039's fillfactor).
CLAIM_INDEX_ENTRIES = {
    "apps_appid_lower_key": 1,
    "apps_pkey": 1,
    "apps_processing_started": 1,
    "apps_unflagged_leases": 1,
}
CLAIM_HEAP_PAGES = 1
CLAIM_PAGES = len(CLAIM_INDEX_ENTRIES) + CLAIM_HEAP_PAGES
# One block a record names (a record may name several: an update moving a row names the
# old page and the new one): its relation, fork and block number.
BLOCK_REF = re.compile(r"rel \d+/\d+/(\d+) fork (\w+) blk (\d+)")
# This database's WAL records between two positions: each named block, and the index a
# btree insert went to.
WAL_OF_THIS_DATABASE = """
SELECT record_type, resource_manager, block_ref
FROM pg_get_wal_records_info(CAST(:start AS pg_lsn), CAST(:end AS pg_lsn))
WHERE block_ref ~ ('/' || (SELECT oid FROM pg_database WHERE datname = current_database())
                   || '/[0-9]+')
"""


def claim_wal(sql) -> tuple[dict[str, int], set[tuple[str, str]]]:
    """One claim after a checkpoint: the index entries it wrote, by index, and the pages
    (relation, block) its WAL changed."""
    sql.run("CHECKPOINT")
    # A temporary slot keeps this WAL until it is read (a checkpoint meanwhile would
    # recycle it); the claim's commit flushed it (synchronous_commit, the default).
    sql.run("SELECT pg_create_physical_replication_slot('claim_wal', true, true)")
    (start,) = sql.run("SELECT CAST(pg_current_wal_insert_lsn() AS text)")[0]
    answer = call_api(gateway_event("GET", "/queue", headers=ANALYSER))
    assert answer["statusCode"] == 200 and answer["body"], answer
    (end,) = sql.run("SELECT CAST(pg_current_wal_flush_lsn() AS text)")[0]
    names = {str(node): name for node, name in sql.run("SELECT relfilenode, relname FROM pg_class")}
    entries: dict[str, int] = {}
    pages: set[tuple[str, str]] = set()
    for kind, manager, block_ref in sql.run(WAL_OF_THIS_DATABASE, start=start, end=end):
        blocks = BLOCK_REF.findall(block_ref)
        pages |= {(names.get(node, node), block) for node, fork, block in blocks if fork == "main"}
        if manager == "Btree" and kind in ("INSERT_LEAF", "INSERT_POST", "SPLIT_L", "SPLIT_R"):
            index = names.get(blocks[0][0], blocks[0][0])
            entries[index] = entries.get(index, 0) + 1
    sql.run("SELECT pg_drop_replication_slot('claim_wal')")
    return entries, pages


def test_a_claim_writes_few_index_entries_and_pages(database_url, sql, monkeypatch):
    configure_service(monkeypatch, database_url)
    sql.run("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    # A few pages of rows, and of each index; the one claimed here first, on a page that
    # later rows filled as far as the fillfactor lets them.
    for number in reversed(range(300)):
        insert_app(sql, f"com.example.app{number:03}", reviews=number)
    # The first claim of a process runs the promoter's first pass: not this measurement.
    insert_app(sql, "com.example.first", reviews=1000)
    assert call_api(gateway_event("GET", "/queue", headers=ANALYSER))["body"] == "com.example.first"
    sql.run("VACUUM apps")
    entries, pages = claim_wal(sql)
    assert entries == CLAIM_INDEX_ENTRIES, entries
    assert len(pages) <= CLAIM_PAGES, sorted(pages)
    assert {relation for relation, _ in pages} - set(CLAIM_INDEX_ENTRIES) == {"apps"}
    assert len([page for page in pages if page[0] == "apps"]) == CLAIM_HEAP_PAGES, sorted(pages)


def test_an_index_that_a_claimed_row_enters_is_caught(database_url, sql, monkeypatch):
    """The guard at work: one more index whose condition a claimed row meets is one more
    entry per claim, named."""
    configure_service(monkeypatch, database_url)
    sql.run("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    for number in range(50):
        insert_app(sql, f"com.example.app{number:03}", reviews=number)
    assert call_api(gateway_event("GET", "/queue", headers=ANALYSER))["statusCode"] == 200
    sql.run("CREATE INDEX apps_by_status ON apps (status)")
    sql.run("VACUUM apps")
    entries, _ = claim_wal(sql)
    assert entries == {**CLAIM_INDEX_ENTRIES, "apps_by_status": 1}


def test_the_adoption_page_names_every_index_on_apps_and_those_a_claim_writes(sql):
    """docs/adopting.md's table of the indexes on apps names each one the ledger leaves,
    and says "yes" (a claim writes it) for exactly those a claim enters here."""
    page = (DOCS / "adopting.md").read_text()
    heading = "## The indexes on apps, and whose queries they serve"
    indexes = table_column(page, heading, column=0)
    writes = table_column(page, heading, column=4)
    named = {
        name: written
        for cell, written in zip(indexes, writes, strict=True)
        for name in re.findall(r"\bapps_[a-z_]+", cell)
    }
    ledger = {
        name for (name,) in sql.run("SELECT indexname FROM pg_indexes WHERE tablename = 'apps'")
    }
    assert set(named) == ledger
    assert {name for name, written in named.items() if written == "yes"} == set(CLAIM_INDEX_ENTRIES)
