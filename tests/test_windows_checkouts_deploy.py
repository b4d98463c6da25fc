"""A deploy from a Windows checkout is not refused.

sql/ keeps LF line endings in every checkout (.gitattributes), and the ledger checksum is
taken over LF line endings, so CRLF copies hash the same; checksums recorded before
(over raw bytes, LF or CRLF) stay valid; a real edit is still refused.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess

import pytest

import handler
from helpers import database_at

LEDGER_FILES = sorted(path.name for path in handler.SQL_DIR.glob("*.sql"))


def copy_ledger(tmp_path, crlf: bool):
    directory = tmp_path / ("crlf" if crlf else "lf")
    shutil.copytree(handler.SQL_DIR, directory)
    if crlf:
        for path in directory.glob("*.sql"):
            path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    return directory


def test_sql_files_are_lf_in_the_repository_and_kept_so_by_gitattributes():
    for path in handler.SQL_DIR.glob("*.sql"):
        assert b"\r" not in path.read_bytes(), path.name
    attributes = subprocess.run(
        ["git", "check-attr", "text", "eol", "--", *(f"sql/{n}" for n in LEDGER_FILES)],
        cwd=handler.HERE,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(attributes) == 2 * len(LEDGER_FILES)
    for line in attributes:
        assert line.endswith((": text: set", ": eol: lf")), line


def test_checksums_do_not_depend_on_line_endings(tmp_path):
    lf = handler.migration_files(copy_ledger(tmp_path, crlf=False))
    crlf = handler.migration_files(copy_ledger(tmp_path, crlf=True))
    assert [m.checksum for m in lf] == [m.checksum for m in crlf]
    assert [m.sql for m in lf] == [m.sql for m in crlf]
    # Over LF bytes, as every checksum already recorded from this repository was.
    for migration in lf:
        raw = (handler.SQL_DIR / migration.name).read_bytes()
        assert migration.checksum == hashlib.sha256(raw).hexdigest()


def test_a_crlf_checkout_migrates_a_database_the_lf_one_migrated(empty_database, tmp_path):
    db = database_at(empty_database)
    try:
        assert handler.apply_migrations(db, copy_ledger(tmp_path, crlf=False)) == LEDGER_FILES
        assert handler.apply_migrations(db, copy_ledger(tmp_path, crlf=True)) == []
    finally:
        db.discard()


def test_checksums_recorded_over_crlf_bytes_stay_valid(empty_database, tmp_path):
    crlf = copy_ledger(tmp_path, crlf=True)
    db = database_at(empty_database)
    try:
        handler.apply_migrations(db, crlf)
        # What a runner that hashed raw bytes would have recorded for that checkout.
        with db.raw_connection() as connection:
            for path in crlf.glob("*.sql"):
                connection.run(
                    "UPDATE schema_migrations SET checksum = :checksum WHERE filename = :name",
                    checksum=hashlib.sha256(path.read_bytes()).hexdigest(),
                    name=path.name,
                )
        assert handler.apply_migrations(db, copy_ledger(tmp_path, crlf=False)) == []
        assert handler.apply_migrations(db, crlf) == []
    finally:
        db.discard()


def test_an_edit_is_still_refused_whatever_the_line_endings(empty_database, tmp_path):
    db = database_at(empty_database)
    try:
        handler.apply_migrations(db, copy_ledger(tmp_path, crlf=False))
        edited = copy_ledger(tmp_path, crlf=True)
        path = edited / LEDGER_FILES[-1]
        path.write_bytes(path.read_bytes() + b"-- a late edit\r\n")
        with pytest.raises(handler.MigrationRefused, match="was edited after it was applied"):
            handler.apply_migrations(db, edited)
    finally:
        db.discard()
