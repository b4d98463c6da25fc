"""What an operator reads off the running service (docs/monitoring.md): the
version in /healthz, `queue-status --json`, and that the deployed API does not serve the
OpenAPI document (the local server does)."""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from kit import configure_function
from mangum import Mangum

import handler
from helpers import (
    LambdaContext,
    call_cli,
    days_ago,
    gateway_event,
    insert_app,
    invoke_api,
    json_answer,
    minutes_ago,
    run_python,
)
from queue_status import QUEUE_STATUS_KEYS

pytestmark = pytest.mark.usefixtures("lambda_container")
DOCS = handler.HERE / "docs" / "monitoring.md"


# --------------------------------------------------------------------------- /healthz


def test_healthz_names_the_build_and_the_ledger_head(database_url, monkeypatch):
    configure_function(monkeypatch, "ApiFunction", database_url)
    answer = json_answer(invoke_api("healthz.json"))
    version = answer["version"]
    assert answer == {"status": "ok", "version": version}
    assert version["ledger"] == sorted(p.name for p in handler.SQL_DIR.glob("*.sql"))[-1]
    assert len(version["build"]) == 12 and set(version["build"]) <= set(string.hexdigits)


def test_healthz_says_the_version_when_it_is_not_ok(database_url, monkeypatch, sql):
    configure_function(monkeypatch, "ApiFunction", database_url)
    handler.api_connection().run("SET default_transaction_read_only = on")
    answer = invoke_api("healthz.json")
    assert answer["statusCode"] == 503
    assert json_answer(answer)["version"] == handler.package_version()


def _package(directory: Path) -> Path:
    """A copy of what the Makefile packages: handler.py, sql/ and web/."""
    directory.mkdir()
    shutil.copy2(handler.HERE / "handler.py", directory / "handler.py")
    shutil.copytree(handler.SQL_DIR, directory / "sql")
    shutil.copytree(handler.WEB_DIR, directory / "web")
    return directory


def _version_of(package: Path) -> dict[str, str]:
    """package_version() in a cold interpreter that imports handler from `package`."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import handler;"
        " print(json.dumps(handler.package_version()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = run_python(code, str(package), env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _to_crlf(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))


@pytest.mark.no_database
def test_the_build_id_changes_exactly_with_handler_sql_or_web(tmp_path):
    base = _version_of(_package(tmp_path / "base"))
    assert base == _version_of(_package(tmp_path / "same"))  # the same code: the same id

    other_files = _package(tmp_path / "other-files")
    (other_files / "README.md").write_text("# not code\n")
    (other_files / "sql" / "notes.txt").write_text("not a ledger file\n")
    crlf = _package(tmp_path / "crlf")  # a Windows checkout (core.autocrlf)
    _to_crlf(crlf / "handler.py")
    # web/vendor/ is -text in .gitattributes: git never converts its line endings.
    web_pages = [path for path in (crlf / "web").iterdir() if path.is_file()]
    for path in [*(crlf / "sql").glob("*.sql"), *web_pages]:
        _to_crlf(path)
    for unchanged in (other_files, crlf):
        assert _version_of(unchanged) == base, unchanged.name

    edited = _package(tmp_path / "edited")
    with (edited / "handler.py").open("a") as f:
        f.write("\n# changed\n")
    sql_edited = _package(tmp_path / "sql-edited")
    first = sorted((sql_edited / "sql").glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- changed\n")
    added = _package(tmp_path / "added")
    (added / "sql" / "999_next.sql").write_text("SELECT 1;\n")
    web_edited = _package(tmp_path / "web-edited")
    with (web_edited / "web" / "admin.css").open("a") as f:
        f.write("p{color:red}\n")
    builds = {base["build"]}
    for changed in (edited, sql_edited, added, web_edited):
        version = _version_of(changed)
        assert version["build"] not in builds, changed.name
        builds.add(version["build"])
    assert _version_of(added)["ledger"] == "999_next.sql"


def test_the_version_is_not_computed_at_import(tmp_path):
    """No I/O at import: a package without sql/ imports; only package_version reads it."""
    package = _package(tmp_path / "package")
    shutil.rmtree(package / "sql")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import handler;"
        " print(handler.package_version.cache_info().currsize)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = run_python(code, str(package), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]


# --------------------------------------------------------------------------- OpenAPI


def _get(path: str) -> dict:
    return handler.api(gateway_event("GET", path), LambdaContext())


def test_the_local_server_serves_the_openapi_document_and_the_deployed_api_does_not():
    from starlette.testclient import TestClient

    with TestClient(handler.app) as client:
        local = client.get("/openapi.json")
    assert local.status_code == 200 and local.json()["paths"]
    deployed = _get("/openapi.json")
    assert (deployed["statusCode"], json_answer(deployed)) == (404, {"detail": "Not Found"})
    unknown = _get("/no-such-path")
    assert deployed["body"] == unknown["body"]
    assert deployed["headers"] == unknown["headers"]
    # The document is still what the app would serve, through Mangum without the filter.
    unfiltered = Mangum(handler.app, lifespan="off")(gateway_event("GET", "/openapi.json"), None)
    assert unfiltered["statusCode"] == 200


@example([False] * len("openapi.json"))  # the plain spelling
@given(st.lists(st.booleans(), min_size=len("openapi.json"), max_size=len("openapi.json")))
def test_no_spelling_of_the_openapi_path_reaches_the_document(encoded):
    """Any mix of percent-encoded characters: the deployed API answers its 404."""
    name = "".join(
        f"%{ord(c):02X}" if escape else c for c, escape in zip("openapi.json", encoded, strict=True)
    )
    answer = _get("/" + name)
    assert answer["statusCode"] == 404, name
    assert json_answer(answer) == {"detail": "Not Found"}


# --------------------------------------------------------------------------- queue-status --json


def _keys(value):
    """The shape of a JSON value: its keys, recursively (lists by their items' shape)."""
    if isinstance(value, dict):
        return {key: _keys(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes = [_keys(item) for item in value]
        assert all(shape == shapes[0] for shape in shapes), shapes
        return [shapes[0]] if shapes else []
    return None


def _status_json(database_url: str) -> dict:
    env = {**os.environ, "DATABASE_URL": database_url}
    done = call_cli("queue-status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_queue_status_json_has_the_same_keys_whatever_the_queue_holds(database_url, sql):
    empty = _status_json(database_url)
    assert empty["counts"] == dict.fromkeys(handler.APP_STATES, 0)
    assert empty["backlog"] == dict.fromkeys(handler.REASON_TEXT, 0)
    assert empty["failed_by_reason"] == [] and empty["processing"] == []

    insert_app(sql, "app.queued", reviews="10")
    insert_app(sql, "app.processing", status="processing", processing_started=minutes_ago(5))
    insert_app(sql, "app.failed", status="failed", retryable=False, reason="paid_app")
    insert_app(sql, "app.analysed", status="analysed", version=4, analysed=days_ago(1))
    full = _status_json(database_url)
    assert full["counts"] == {"queued": 1, "processing": 1, "analysed": 1, "failed": 1}
    assert full["failed_by_reason"] == [{"reason": "paid_app", "apps": 1}]
    assert [app["appid"] for app in full["processing"]] == ["app.processing"]
    assert [app["appid"] for app in full["top_backlog"]] == ["app.queued"]

    # The lists' items have the keys the full report shows; the rest is the same.
    shape = _keys(full)
    assert {k: v for k, v in _keys(empty).items() if not isinstance(v, list)} == {
        k: v for k, v in shape.items() if not isinstance(v, list)
    }
    assert set(shape) == set(DOCUMENTED_KEYS)
    assert set(shape["processing"][0]) == {
        "appid",
        "started",
        "age_minutes",
        "expired",
        "lease_attempts",
        "refetch_requested",
    }
    assert set(shape["top_backlog"][0]) == {"appid", "popularity", "added", "reason"}


# The top-level keys docs/monitoring.md lists for `queue-status --json`: the document's.
DOCUMENTED_KEYS = QUEUE_STATUS_KEYS


def test_the_docs_list_the_json_keys():
    text = DOCS.read_text()
    section = text.split("## `queue-status --json`", 1)[1].split("\n## ", 1)[0]
    for key in DOCUMENTED_KEYS:
        assert f"`{key}`" in section, key


@given(
    st.dictionaries(st.sampled_from(handler.APP_STATES), st.integers(0, 10**6)),
    st.dictionaries(st.sampled_from(list(handler.REASON_TEXT)), st.integers(0, 10**6)),
    st.dictionaries(st.text(min_size=1, max_size=12), st.integers(0, 10**6), max_size=5),
)
def test_the_json_keys_do_not_depend_on_which_states_have_apps(counts, backlog, failed):
    status = handler.QueueStatus(
        counts=counts, backlog=backlog, failed_by_reason=failed, total=sum(counts.values())
    )
    document = status.document()
    assert list(document["counts"]) == list(handler.APP_STATES)
    assert list(document["backlog"]) == list(handler.REASON_TEXT)
    assert all(set(item) == {"reason", "apps"} for item in document["failed_by_reason"])
    assert sum(item["apps"] for item in document["failed_by_reason"]) == sum(failed.values())
