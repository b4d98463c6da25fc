"""The pages list what the code has, each thing once, and nothing it does not have.

* docs/api.md's routes table: every route of `handler.app` (the web view's from its
  dispatcher's table) and every HttpApi event of template.yaml, each with its auth, and
  no other route.
* Every setting handler.py reads and every template parameter: one row, in
  docs/configuration.md's settings table or docs/deploy.md's parameters table.
* docs/cli.md: every command, subcommand and flag of `handler.cli_parser()`, and no flag
  the parser does not have.
* docs/local-lambda.md names every file in events/; docs/monitoring.md every alarm of
  template.yaml; neither names one that does not exist.
* docs/api.md's OpenAPI section lists exactly the paths of `handler.app.openapi()`.
* No page writes a constant of the code in the form of a setting.

Each test fails when something is added to the code without its line in the docs.
"""

from __future__ import annotations

import argparse
import re

import pytest
from fastapi.routing import APIRoute

import handler
from markdown_pages import DOCS, ROOT, prose, table_column
from sam_template import load_template

# Uses no PostgreSQL (conftest.py holds it to that): CI's second pass leaves it out.
pytestmark = pytest.mark.no_database

AUTH = ("analyser", "admin", "public")


def section(page: str, heading: str) -> str:
    """The text of `## heading` up to the next heading of its level."""
    text = (DOCS / page).read_text()
    body = text.split(f"\n## {heading}\n", 1)[1]
    return re.split(r"\n## ", body, maxsplit=1)[0]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the tables in `text` (header and rule left out)."""
    rows = []
    for block in re.findall(r"(?:^\|.*\n?)+", prose(text), re.MULTILINE):
        for line in block.splitlines()[2:]:
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


# --------------------------------------------------------------------------- routes


def code_routes() -> set[tuple[str, str]]:
    """The app's routes, the web view's (one dispatcher, its table) apart."""
    return {
        (method, route.path_format)
        for route in handler.app.routes
        if isinstance(route, APIRoute) and route.endpoint is not handler.admin
        for method in route.methods
        if method != "HEAD"
    }


def admin_routes() -> set[tuple[str, str]]:
    """The web view's routes: the dispatcher's table."""
    return {(method, path) for method, path, _, _ in handler.ADMIN_ROUTES}


# The HTTP API hands the dispatcher every /admin path; it holds the table.
TEMPLATE_ADMIN_ROUTES = {("ANY", "/admin"), ("ANY", "/admin/{proxy+}")}


def test_the_web_view_dispatcher_takes_every_admin_path_and_only_those():
    mounted = {
        route.path
        for route in handler.app.routes
        if isinstance(route, APIRoute) and route.endpoint is handler.admin
    }
    assert mounted == {"/admin", "/admin/{rest:any_path}"}
    assert all(path == "/admin" or path.startswith("/admin/") for _, path in admin_routes())
    assert not any(path.startswith("/admin") for _, path in code_routes())


def template_routes() -> tuple[set[tuple[str, str]], int]:
    """The HttpApi events' (method, path), and how many have no path (a catch-all)."""
    routes, catch_alls = set(), 0
    for resource in load_template()["Resources"].values():
        for event in (resource.get("Properties", {}).get("Events") or {}).values():
            if event["Type"] != "HttpApi":
                continue
            properties = event.get("Properties") or {}
            if "Path" in properties:
                routes.add((properties["Method"].upper(), properties["Path"]))
            else:
                catch_alls += 1
    return routes, catch_alls


def documented_routes() -> tuple[dict[tuple[str, str], str], int]:
    """docs/api.md's routes table: (method, path) -> its auth cell, and the catch-all rows."""
    documented, catch_alls = {}, 0
    for route, auth, *_ in table_rows(section("api.md", "Routes")):
        found = re.fullmatch(r"`([A-Z]+) (/[^`?\s]*)(?:\?[^`]*)?`", route)
        if found is None:
            assert "`$default`" in route, f"not a route: {route}"
            catch_alls += 1
        else:
            documented[(found.group(1), found.group(2))] = auth
        assert auth.split(";")[0].split()[0] in AUTH, f"{route}: auth {auth!r}"
    return documented, catch_alls


def test_the_routes_table_names_every_route_with_its_auth_and_nothing_else():
    documented, documented_catch_alls = documented_routes()
    template, catch_alls = template_routes()
    assert code_routes() | TEMPLATE_ADMIN_ROUTES == template, "handler.app and template.yaml"
    assert set(documented) == code_routes() | admin_routes()
    assert documented_catch_alls == catch_alls == 1


def test_the_openapi_section_names_exactly_the_paths_the_document_has():
    """docs/api.md's "The OpenAPI document" lists the paths the document covers: exactly
    those of `handler.app.openapi()`, each with the methods the routes table gives it; every
    web view route is in the routes table and none in the document."""
    document = handler.app.openapi()["paths"]
    listed = [
        path
        for line in section("api.md", "The OpenAPI document").splitlines()
        if line.startswith("- ")
        for path in re.findall(r"`(/[^`]*)`", line)
    ]
    assert sorted(listed) == sorted(document)
    documented, _ = documented_routes()
    covered = {(method, path) for method, path in documented if path in document}
    assert covered == {(m.upper(), path) for path, ops in document.items() for m in ops}
    for method, path in admin_routes():
        assert (method, path) in documented and path not in document, path


# ----------------------------------------------------------------- settings and parameters


def settings_read() -> set[str]:
    source = (ROOT / "handler.py").read_text()
    setting = r"(?:\.get|_int_setting|_bool_setting)\(\s*(?:env,\s*)?\"([A-Z][A-Z0-9_]+)\""
    return set(re.findall(setting, source)) | {"LOG_LEVEL"}  # read by Powertools' Logger


def rows_naming(name: str) -> list[str]:
    """The rows of the settings and parameters tables whose first cell names `name`."""
    found = []
    tables = (
        ("configuration.md", table_column((DOCS / "configuration.md").read_text(), "## Settings")),
        ("deploy.md", table_column((DOCS / "deploy.md").read_text(), "## Parameters")),
    )
    for page, cells in tables:
        for cell in cells:
            if name in {part.strip() for part in cell.split(",")}:
                found.append(page)
    return found


def test_every_setting_and_parameter_has_one_row():
    names = settings_read() | set(load_template()["Parameters"])
    assert {name: rows_naming(name) for name in names if len(rows_naming(name)) != 1} == {}


# Variables of other programs that the pages set: the tests' (tests/), Python's, Docker's
# and the SAM CLI's (tools/sam_local.py). The Makefile's come from the Makefile itself.
OTHER_PROGRAMS_VARIABLES = {
    "HYPOTHESIS_PROFILE",
    "WEB_VIEW_SCREENSHOTS",
    "PYTHONDONTWRITEBYTECODE",
    "DOCKER_HOST",
    "SAM_CLI_TELEMETRY",
}
# An ALL_CAPS name written as a setting: `NAME=value`, "`NAME` = value", "set `NAME`".
SETTING_FORMS = (
    r"(?<![\w$/-])([A-Z][A-Z0-9_]{2,})=(?!=)",
    r"`([A-Z][A-Z0-9_]{2,})` ?= ?\S",
    r"\b[Ss]et(?:s|ting)? `([A-Z][A-Z0-9_]{2,})`",
)


def shell_variables(text: str) -> set[str]:
    """The names a page's shell lines assign from a command or a quoted string
    (`TOKEN=$(...)`, `LOCAL="..."`): variables of that shell, not settings."""
    return set(re.findall(r"(?<![\w$])([A-Z][A-Z0-9_]*)=(?:\$\(|\")", text))


def test_no_page_writes_a_constant_as_a_setting():
    """A name written as a setting is one: an environment variable the service reads
    (docs/configuration.md's table), or another program's. The code's own constants
    (SERVE_WORKER_THREADS, REFETCH_BATCH, ...) are written as their value, "fixed in the
    code (`NAME`)"."""
    makefile = (ROOT / "Makefile").read_text()
    allowed = settings_read() | OTHER_PROGRAMS_VARIABLES
    allowed |= set(re.findall(r"^([A-Z][A-Z0-9_]+) \?=", makefile, re.MULTILINE))
    elsewhere = " ".join(
        path.read_text()
        for folder in ("tests", "tools", "bench")
        for path in (ROOT / folder).glob("*.py")
    )
    assert {name for name in OTHER_PROGRAMS_VARIABLES if name not in elsewhere} == set()
    written = {}
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        for form in SETTING_FORMS:
            for name in set(re.findall(form, text)) - allowed - shell_variables(text):
                written.setdefault(name, []).append(page.name)
    assert written == {}
    assert "SERVE_WORKER_THREADS" not in allowed and hasattr(handler, "SERVE_WORKER_THREADS")


# --------------------------------------------------------------------------- the CLI


def parser_words(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    """Every command and subcommand (as `COMMAND SUB`) and every option string."""
    words = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words.add(f"{prefix}{name}")
                words |= parser_words(sub, f"{prefix}{name} ")
        else:
            words |= set(action.option_strings)
            words |= {f"{prefix}{choice}" for choice in action.choices or ()}
    return words


def test_the_cli_page_names_every_command_and_flag_and_no_other():
    page = (DOCS / "cli.md").read_text()
    synopsis = section("cli.md", "Commands")
    words = parser_words(handler.cli_parser())
    missing = []
    for word in sorted(words):
        *command, last = word.split(" ")
        if last.startswith("-"):
            if not re.search(rf"(?<![\w-]){re.escape(last)}(?![\w-])", page):
                missing.append(word)
        elif command:  # a subcommand, e.g. `analysers rotate`, or an invoke target
            line = next(
                (line for line in synopsis.splitlines() if f"handler.py {command[0]} " in line),
                "",
            )
            if not re.search(rf"(?<![\w-]){re.escape(last)}(?![\w-])", line):
                missing.append(word)
        elif f"python3 handler.py {last}" not in synopsis:
            missing.append(word)
    assert missing == []
    flags = set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", synopsis))
    assert flags - {word.split(" ")[-1] for word in words} == set()


# --------------------------------------------------------------------------- events and alarms


def test_every_event_file_is_named_on_the_local_lambda_page():
    files = {path.name for path in (ROOT / "events").glob("*.json")}
    named = set()
    for cell in table_column((DOCS / "local-lambda.md").read_text(), "## The event files"):
        named |= {name.strip() for name in cell.split(",")}
    assert named == files


def test_every_alarm_is_named_on_the_monitoring_page():
    alarms = {
        name
        for name, resource in load_template()["Resources"].items()
        if resource["Type"] == "AWS::CloudWatch::Alarm"
    }
    named = set()
    for cell in table_column((DOCS / "monitoring.md").read_text(), "## The alarms"):
        named |= {name.strip() for name in cell.split(",")}
    assert named == alarms
