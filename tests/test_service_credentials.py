"""The shared upload password and the admin token as hashes in the database (sql/034,
docs/analysers.md, "The shared password and the admin token"), on the real database:

* filled once from the environment, flagged as chosen by a person, and from then on the
  database's hash is the one credential (a changed environment is a wrong token);
* rotated by the CLI and the report entry: the new value works at once in every process,
  the old one for the overlap only, and the admin token's rotation ends every web session;
* imported from stdin into an empty row only; never printed, listed or logged but once.
"""

from __future__ import annotations

import hmac
import os
import subprocess

import pytest
from kit import ADMIN, ADMIN_TOKEN, ANALYSER, UPLOAD_PASSWORD

import handler
from helpers import LambdaContext, call_cli

STORED = "SELECT name, chosen_by_person, set_by FROM service_credentials ORDER BY name"
RECORDS = (
    "SELECT actor, source, action FROM operator_actions"
    " WHERE action LIKE 'import %' OR action LIKE 'rotate %' ORDER BY at, action"
)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def cli(database_url: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    if stdin is None:
        return call_cli(*args, env={**os.environ, "DATABASE_URL": database_url})
    return subprocess.run(
        ["python3", str(handler.HERE / "handler.py"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "DATABASE_URL": database_url},
        timeout=120,
    )


def test_the_environment_is_checked_until_imported_then_the_database_decides(
    client, sql, monkeypatch, database_url
):
    """Checking writes nothing: the environment's values work while the rows are empty.
    An import makes them the database's, flagged as a person's choice, with its record;
    from then on a changed environment is a wrong token."""
    assert client.get("/ping", headers=ANALYSER).status_code == 200
    assert client.get("/analysers", headers=ADMIN).status_code == 200
    assert sql.run(STORED) == []
    for name in ("upload-password", "admin-token"):
        imported = cli(database_url, "credentials", "import", name, "--from-environment")
        assert imported.returncode == 0, imported.stderr
        assert UPLOAD_PASSWORD not in imported.stdout + imported.stderr
    assert sql.run(STORED) == [
        ["admin_token", True, "command line"],
        ["upload_password", True, "command line"],
    ]
    assert [row[2] for row in sql.run(RECORDS)] == ["import upload-password", "import admin-token"]
    listed = cli(database_url, "credentials", "list")
    assert listed.stdout.count("chosen by a person: rotate it") == 2
    # A new process whose environment says otherwise: the database's hash decides.
    monkeypatch.setenv("UPLOAD_PASSWORD", "another-password")
    monkeypatch.setenv("ADMIN_TOKEN", "another-admin-token")
    handler.use_runtime(None)
    assert client.get("/ping", headers=bearer("another-password")).status_code == 401
    assert client.get("/ping", headers=ANALYSER).status_code == 200
    assert client.get("/analysers", headers=bearer("another-admin-token")).status_code == 401
    assert client.get("/analysers", headers=ADMIN).status_code == 200


def test_checking_a_token_writes_nothing(client, sql):
    assert client.get("/ping", headers=bearer("wrong")).status_code == 401
    assert client.get("/analysers", headers=bearer("wrong")).status_code == 401
    assert client.get("/ping", headers=ANALYSER).status_code == 200
    assert sql.run(STORED) == []


def test_nothing_configured_and_nothing_stored_is_503(client, sql, monkeypatch):
    monkeypatch.delenv("UPLOAD_PASSWORD")
    monkeypatch.delenv("ADMIN_TOKEN")
    handler.use_runtime(None)
    assert client.get("/ping", headers=ANALYSER).status_code == 503
    assert client.get("/analysers", headers=ADMIN).status_code == 503
    assert sql.run(STORED) == []


def test_the_cli_rotates_and_the_new_value_works_at_once_the_old_for_the_overlap(
    client, sql, database_url
):
    assert client.get("/ping", headers=ANALYSER).status_code == 200  # the environment's
    rotated = cli(database_url, "credentials", "rotate", "upload-password", "--overlap", "2h")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.splitlines()[-1]
    assert new.startswith("aqs_") and len(new) == 4 + 43
    assert rotated.stdout.count(new) == 1 and new not in rotated.stderr
    assert "previous value works until" in rotated.stdout
    # The database held none: the value kept is this shell's, and the CLI says so.
    assert "The previous value is UPLOAD_PASSWORD of this command's environment" in rotated.stdout
    # This process read nothing again: the database is asked on every request.
    assert client.get("/ping", headers=bearer(new)).status_code == 200
    assert client.get("/ping", headers=ANALYSER).status_code == 200  # the overlap
    assert sql.run(STORED) == [["upload_password", False, "command line"]]

    ended = cli(database_url, "credentials", "rotate", "upload-password", "--overlap", "0")
    assert ended.returncode == 0, ended.stderr
    newest = ended.stdout.splitlines()[-1]
    assert "previous value no longer works" in ended.stdout
    for old in (UPLOAD_PASSWORD, new):
        assert client.get("/ping", headers=bearer(old)).status_code == 401
    assert client.get("/ping", headers=bearer(newest)).status_code == 200

    listed = cli(database_url, "credentials", "list")
    assert listed.returncode == 0, listed.stderr
    assert "upload-password: set" in listed.stdout and "admin-token: not set" in listed.stdout
    for value in (UPLOAD_PASSWORD, new, newest, ADMIN_TOKEN):
        assert value not in listed.stdout + listed.stderr


def test_a_new_admin_token_ends_every_web_session(client, sql, database_url):
    db = handler.api_connection()
    cookie = handler.sign_in(db, ADMIN_TOKEN, "test")
    assert cookie is not None and handler.session_operator(db, cookie, "test") is not None
    assert handler.sign_in(db, "wrong", "test") is None
    rotated = handler.rotate_credential(db, handler.Operator("t", "t"), "admin-token", 3600)
    # The overlap keeps the old token working as a bearer, not the sessions it started.
    assert handler.session_operator(db, cookie, "test") is None
    assert client.get("/analysers", headers=ADMIN).status_code == 200
    assert client.get("/analysers", headers=bearer(rotated["token"])).status_code == 200
    assert rotated["token"].startswith("aqx_")


def test_web_sign_in_takes_the_current_admin_token_only_and_fills_an_empty_row(client, sql):
    """No cookie is ever signed with a key derived from a token a person chose: while
    the row is empty no cookie is valid, and the first sign-in fills it (the configured
    value, flagged, and a random session key). The previous token, in its overlap, still
    works as a bearer, but starts no session that would outlive it."""
    db = handler.api_connection()
    assert handler.web_session_key(db) is None
    # A cookie signed as one was before there were keys in the database (a key derived
    # from the token's value) is refused.
    derived = hmac.new(ADMIN_TOKEN.encode(), b"admin web session", "sha256").digest()
    forged = f"x.{hmac.new(derived, b'x', 'sha256').hexdigest()}"
    assert handler.signed_session(db, forged) is None
    assert handler.sign_in(db, "wrong", "test") is None
    assert sql.run(STORED) == []  # a refused sign-in fills nothing
    cookie = handler.sign_in(db, ADMIN_TOKEN, "test")
    assert cookie is not None and handler.session_operator(db, cookie, "test") is not None
    ((name, chosen, set_by),) = sql.run(STORED)
    assert (name, chosen) == ("admin_token", True) and set_by.startswith("admin token, session ")
    assert handler.web_session_key(db) is not None

    rotated = handler.rotate_credential(db, handler.Operator("t", "t"), "admin-token", 3600)
    assert client.get("/analysers", headers=ADMIN).status_code == 200  # a bearer: the overlap
    assert handler.sign_in(db, ADMIN_TOKEN, "test") is None  # a session: not from the old one
    assert handler.sign_in(db, rotated["token"], "test") is not None


def test_a_first_rotation_keeps_only_a_configured_value(client, sql, monkeypatch, database_url):
    """With the row empty and nothing configured here (an operator's shell without the
    deployed value), a rotation with an overlap is refused rather than cut the hosts
    off at once; --overlap 0 says it means that."""
    monkeypatch.delenv("UPLOAD_PASSWORD")
    handler.use_runtime(None)
    operator = handler.Operator("t", "t")
    with pytest.raises(handler.NothingToKeep, match="import it first"):
        handler.rotate_credential(handler.api_connection(), operator, "upload-password", 3600)
    assert sql.run(STORED) == [] and sql.run(RECORDS) == []
    env = {k: v for k, v in os.environ.items() if k != "UPLOAD_PASSWORD"}
    refused = call_cli(
        "credentials", "rotate", "upload-password", env={**env, "DATABASE_URL": database_url}
    )
    assert refused.returncode == 1 and "import it first" in refused.stderr, refused.stderr
    rotated = handler.rotate_credential(handler.api_connection(), operator, "upload-password", 0)
    assert rotated["previousFrom"] is None and rotated["previousTokenValidUntil"] is None
    again = handler.rotate_credential(handler.api_connection(), operator, "upload-password", 60)
    assert again["previousFrom"] == "the database"
    assert client.get("/ping", headers=bearer(rotated["token"])).status_code == 200


def test_an_import_fills_an_empty_row_only_from_stdin(sql, database_url):
    imported = cli(database_url, "credentials", "import", "upload-password", stdin="pi-fleet-pw\n")
    assert imported.returncode == 0, imported.stderr
    assert "pi-fleet-pw" not in imported.stdout + imported.stderr
    assert sql.run(STORED) == [["upload_password", True, "command line"]]
    again = cli(database_url, "credentials", "import", "upload-password", stdin="other\n")
    assert again.returncode == 1
    assert "set in the database already" in again.stderr
    for value, words in (
        ("\n", "1 to"),
        ("aqa_x\n", "named analyser"),
        ("two words\n", "printable ASCII"),
        ("pässword\n", "printable ASCII"),
        ("a\x01b\n", "printable ASCII"),
    ):
        refused = cli(database_url, "credentials", "import", "admin-token", stdin=value)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
    bad = cli(database_url, "credentials", "rotate", "database")
    assert bad.returncode == 2
    db = handler.api_connection()
    assert handler.credential_matches(db, "upload_password", "pi-fleet-pw")
    assert not handler.credential_matches(db, "upload_password", "pi-fleet-pw ")


def test_the_report_imports_rotates_and_lists_and_never_logs_a_value(client, sql, capsys):
    imported = handler.report(
        {"command": "credentials-import", "name": "upload-password"}, LambdaContext()
    )
    assert imported["from"] == "UPLOAD_PASSWORD" and imported["chosenByPerson"]
    with pytest.raises(handler.CredentialSet):
        handler.report(
            {"command": "credentials-import", "name": "upload-password"}, LambdaContext()
        )
    capsys.readouterr()
    rotated = handler.report(
        {"command": "credentials-rotate", "name": "admin-token", "overlap": "0"}, LambdaContext()
    )
    token = rotated["token"]
    assert rotated["name"] == "admin-token" and rotated["previousTokenValidUntil"] is None
    listed = handler.report({"command": "credentials-list"}, LambdaContext())
    admin = next(row for row in listed["credentials"] if row["name"] == "admin-token")
    assert admin["set"] and not admin["chosenByPerson"] and admin["setBy"] == "report function"
    out = capsys.readouterr()
    assert token not in out.out + out.err
    assert "credentials-rotate" in out.out + out.err
    assert client.get("/analysers", headers=bearer(token)).status_code == 200
    assert client.get("/analysers", headers=ADMIN).status_code == 401
    for event in (
        {"command": "credentials-rotate"},
        {"command": "credentials-rotate", "name": ["admin-token"]},
        {"command": "credentials-rotate", "name": "admin-token", "overlap": "forever"},
        {"command": "credentials-list", "name": "x"},
    ):
        with pytest.raises(handler.BadInput):
            handler.report(event, LambdaContext())
