"""handler.py reads top to bottom: its table of contents is its banners, and no chapter
uses a name defined by a later one. A chapter is one operation through every layer, at
most 500 lines, its SQL at its head (each statement in the chapter of its first caller).
(A refactoring that moves code keeps these true, or says where it did not.)"""

from __future__ import annotations

import ast
import importlib.metadata
import re

import pytest
from kit import ROOT

from handler_sql import sql_statements, string_constants

# Uses no PostgreSQL (conftest.py holds it to that): CI's second pass leaves it out.
pytestmark = pytest.mark.no_database

SOURCE = (ROOT / "handler.py").read_text()
BANNER = re.compile(r"^# == (.+?) =+$")
MODULE = ast.parse(SOURCE)


def banners(source: str = SOURCE) -> list[tuple[int, str]]:
    return [
        (number, match.group(1))
        for number, line in enumerate(source.splitlines(), start=1)
        if (match := BANNER.match(line))
    ]


def contents() -> list[str]:
    """The section names the module docstring lists, in order."""
    docstring = ast.get_docstring(MODULE)
    listing = docstring.split("\n\n")[3]
    return [re.split(r"\s{2,}", line.strip())[0] for line in listing.splitlines()]


def test_the_table_of_contents_is_the_banners():
    assert [name for _, name in banners()] == contents()


def test_every_banner_has_the_one_form():
    """No other kind of banner (a ruled box, a sub-banner of another shape) hides from
    `grep '^# == '`."""
    lines = SOURCE.splitlines()
    other = [
        (number, line)
        for number, line in enumerate(lines, start=1)
        if re.match(r"^# ?(-{3,}|={3,}|\*{3,})", line) and not BANNER.match(line)
    ]
    assert other == []
    assert all(len(line) == 89 for line in lines if BANNER.match(line))


# A chapter's named part: `# -- <part>`, the one shape (any other heading-like comment, a
# `# ~~ name`, a `# ** name`, a `## name`, is refused).
PART = re.compile(r"^# -- (\S(?:.*\S)?)$")
HEADING_LIKE = re.compile(r"^(#{2,}|# ?([-=~*+_])\2+(\s|$))")
CHAPTER_LIMIT = 500


def test_every_part_has_the_one_form():
    """Inside a chapter, parts are named by `# -- <part>` lines, each alone after a blank
    line; no other heading shape hides from `grep -n '^# == \\|^# -- '`. A chapter with
    parts has two or more."""
    lines = SOURCE.splitlines()
    other = [
        (number, line)
        for number, line in enumerate(lines, start=1)
        if HEADING_LIKE.match(line) and not BANNER.match(line) and not PART.match(line)
    ]
    assert other == []
    parts = [(number, line) for number, line in enumerate(lines, start=1) if PART.match(line)]
    assert [(number, line) for number, line in parts if lines[number - 2] != ""] == []
    assert [(n, line) for n, line in parts if re.search(r"[-=~*]{2,}$", line)] == []
    starts = banners()
    count: dict[int, int] = {}
    for number, _ in parts:
        index = section_of(number, starts)
        count[index] = count.get(index, 0) + 1
    assert [starts[index][1] for index, parts_in in count.items() if parts_in < 2] == []


def chapters(source: str = SOURCE) -> list[tuple[str, int, int]]:
    """(name, first line, length in lines) of each chapter, its banner to the next one's."""
    starts = banners(source)
    ends = [start for start, _ in starts[1:]] + [len(source.splitlines()) + 1]
    return [(name, start, end - start) for (start, name), end in zip(starts, ends, strict=True)]


def test_no_chapter_is_over_500_lines():
    """A chapter is read in one sitting: one that grows past the limit is split into two
    adjacent chapters with honest names (as the CLI's and the analysers' are)."""
    assert [(name, length) for name, _, length in chapters() if length > CHAPTER_LIMIT] == []


def test_the_service_errors_are_one_family_in_one_chapter():
    """Every exception handler.py defines is a ServiceError that says in its docstring what
    went wrong, and is defined in "The service's errors"."""
    import handler

    starts = banners()
    found = []
    for node in MODULE.body:
        value = getattr(handler, getattr(node, "name", ""), None)
        if isinstance(value, type) and issubclass(value, BaseException):
            chapter = starts[section_of(node.lineno, starts)][1]
            found.append(
                (
                    node.name,
                    issubclass(value, handler.ServiceError),
                    bool(vars(value).get("__doc__")),
                )
            )
            assert chapter == "The service's errors", node.name
    assert len(found) > 10
    assert [name for name, family, _ in found if not family] == []
    assert [name for name, _, documented in found if not documented] == []


def section_of(line: int, starts: list[tuple[int, str]]) -> int:
    index = -1
    for position, (start, _) in enumerate(starts):
        if start <= line:
            index = position
    return index


def defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    return {
        name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)
    }


def local_names(node: ast.stmt) -> set[str]:
    """Names a definition binds for itself (arguments, assignments, loop variables),
    which shadow a module name of the same spelling."""
    return {
        part.id
        for part in ast.walk(node)
        if isinstance(part, ast.Name) and isinstance(part.ctx, (ast.Store, ast.Del))
    } | {part.arg for part in ast.walk(node) if isinstance(part, ast.arg)}


def forward_uses(source: str) -> list[str]:
    """Where a top-level definition refers to a module name that a later section
    defines."""
    starts = banners(source)
    module = ast.parse(source)
    home: dict[str, int] = {}
    for node in module.body:
        for name in defined_names(node):
            home.setdefault(name, section_of(node.lineno, starts))
    found = []
    for node in module.body:
        section = section_of(node.lineno, starts)
        own = defined_names(node) | local_names(node)
        for used in ast.walk(node):
            if isinstance(used, ast.Name) and used.id in home and used.id not in own:
                if home[used.id] > section:
                    found.append(
                        f"line {used.lineno} ({starts[section][1]}) uses {used.id}"
                        f" from {starts[home[used.id]][1]}"
                    )
    return found


def test_no_section_uses_a_later_one():
    """Each top-level definition refers only to module names defined in its own section
    or an earlier one: a reader meets everything before its first use."""
    assert forward_uses(SOURCE) == []


def test_a_forward_use_is_caught():
    example = """
# == First =====
def early():
    return late()


# == Second ====
def late():
    return early()
"""
    assert forward_uses(example) == ["line 4 (First) uses late from Second"]


# The chapter of the fragments several operations' statements share.
SHARED_SQL = "SQL: the queue's rule"


def sql_constants(source: str = SOURCE) -> dict[str, ast.Assign]:
    """The module's SQL constants: the statements (sql_statements), and the fragments
    they are composed of (UPPER_CASE string constants their values name), transitively."""
    strings, _ = string_constants(source)
    found = sql_statements(source)
    pending = list(found.values())
    while pending:
        for used in ast.walk(pending.pop().value):
            if isinstance(used, ast.Name) and used.id in strings and used.id not in found:
                found[used.id] = strings[used.id]
                pending.append(strings[used.id])
    return found


def sql_first_callers(source: str = SOURCE) -> dict[str, tuple[int, int]]:
    """Each SQL constant's line and the line of its first use by another top-level
    statement (a function, a class, another constant)."""
    constants = sql_constants(source)
    first: dict[str, tuple[int, int]] = {}
    for node in ast.parse(source).body:
        own = defined_names(node)
        for used in ast.walk(node):
            if isinstance(used, ast.Name) and used.id in constants and used.id not in own:
                if used.id not in first:
                    first[used.id] = (constants[used.id].lineno, used.lineno)
    return first


def test_every_sql_constant_sits_with_its_first_caller():
    """A statement is at the head of its operation's chapter: in the chapter of the first
    code that runs it (a fragment, of the first statement made of it). Only the fragments
    several operations share sit apart, in the queue's rule, and they are shared: used
    by two chapters or more."""
    starts = banners()
    constants = sql_constants()
    assert {"CLAIM_NEXT_APP", "CANDIDATE", "LEDGER_CREATE", "REFETCH_LOCK_NAMED"} <= set(constants)
    misplaced = []
    for name, (defined, called) in sql_first_callers().items():
        home, caller = section_of(defined, starts), section_of(called, starts)
        if starts[home][1] != SHARED_SQL and home != caller:
            misplaced.append(f"{name} ({starts[home][1]}) first used in {starts[caller][1]}")
    assert misplaced == []
    assert sorted(set(constants) - set(sql_first_callers())) == []  # none unused
    users: dict[str, set[int]] = {}
    for node in MODULE.body:
        for used in ast.walk(node):
            if isinstance(used, ast.Name) and used.id in constants:
                users.setdefault(used.id, set()).add(section_of(node.lineno, starts))
    shared = [
        name
        for name, node in constants.items()
        if starts[section_of(node.lineno, starts)][1] == SHARED_SQL
    ]
    assert shared
    assert [
        name
        for name in shared
        if len(users[name] - {section_of(constants[name].lineno, starts)}) < 2
    ] == []


def test_sql_constants_are_near_their_first_callers():
    """The median distance, in lines, from an SQL constant to its first use is under 300
    (some 2,000 when the SQL sat in sections of its own at the top)."""
    import statistics

    distances = [called - defined for defined, called in sql_first_callers().values()]
    assert statistics.median(distances) < 300


def test_the_failure_table_of_the_api_page_is_the_code():
    """docs/api.md's "Failures: retry or not" lists FAILURE_CLASSES, in order, phrase by
    phrase."""
    import handler

    page = (ROOT / "docs" / "api.md").read_text()
    section = page.split("\n## Failures: retry or not\n")[1].split("\n## ")[0]
    table = next(block for block in section.split("\n\n") if block.startswith("| the log"))
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    documented = [
        (reason.strip("` "), retryable.strip(" |") == "true", re.findall(r"`([^`]+)`", phrases))
        for phrases, reason, retryable in rows
    ]
    expected = [
        (reason, retryable, [phrase.lower() for phrase in phrases])
        for reason, retryable, phrases in handler.FAILURE_CLASSES
    ]
    assert [(r, t, [p.lower() for p in ps]) for r, t, ps in documented[:-1]] == expected
    assert documented[-1][:2] == (handler.ANALYSIS_FAILED, True)
    for reason, retryable, phrases in expected:
        for phrase in phrases:
            assert handler.classify_analysis_failure(f"x {phrase.upper()} y") == (reason, retryable)


def test_rows_are_read_by_name():
    """No positional reading of a row (`rows[0][3]`, `row[2]`): a multi-column result is
    read through Session.records, by the names its SQL gives."""
    positional = re.findall(r".*(?:\]\[\d+\]|\brow\[\d*:?\d*\]).*", SOURCE)
    assert positional == []


def test_no_test_or_benchmark_touches_a_private_name_of_handler():
    """Tests and benchmarks use handler.py's public names only (a Runtime, time_passes),
    so its internals can change without them."""
    touched = []
    for path in sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "handler":
                    names.append(node.attr)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "setattr",
                "getattr",
            ):
                target, *rest = node.args
                if isinstance(target, ast.Name) and target.id == "handler" and rest:
                    if isinstance(rest[0], ast.Constant):
                        names.append(rest[0].value)
            touched += [
                f"{path.name}:{node.lineno} {name}"
                for name in names
                if name.startswith("_") and not name.startswith("__")
            ]
    assert touched == []


def test_no_test_file_imports_conftest():
    """Test files import the kit (tests/kit.py) and the helpers; conftest.py only hands
    fixtures to pytest, which loads it itself."""
    importing = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if "conftest" in names:
                importing.append(f"{path.name}:{node.lineno}")
    assert importing == []


def imported_modules(path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth (a function's included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_no_test_module_imports_another():
    """A test file shows its own cases; what several share is in the kit (kit.py,
    helpers.py and the other modules of tests/ not named test_*), so a test file can be
    renamed, split or deleted without breaking another, and a reader finds what it uses
    where shared things live. (bench/ and tools/ import the support modules too.)"""
    importing = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(
            [
                *(ROOT / "tests").glob("*.py"),
                *(ROOT / "bench").glob("*.py"),
                *(ROOT / "tools").glob("*.py"),
            ]
        )
        for line, module in imported_modules(path)
        if module.split(".")[0].startswith("test_")
    ]
    assert importing == []


# --- the seams: where a framework is reached past its public API ------------------------

SEAMS_PART = "# -- seams: the frameworks reached past their public API"


def seams_lines(source: str = SOURCE) -> range:
    """The lines of the HTTP scaffolding's seams part: its `# -- ` line to the next part's."""
    lines = source.splitlines()
    start = lines.index(SEAMS_PART) + 1
    end = next(
        number
        for number, line in enumerate(lines[start:], start=start + 1)
        if PART.match(line) or BANNER.match(line)
    )
    return range(start, end)


def own_names(module: ast.Module) -> set[str]:
    """Every name handler.py defines: functions, classes, and attributes it assigns."""
    names = set()
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def private_names_reached(source: str, allowed: range) -> list[str]:
    """`module._name`, `object._name` or `from module._part import ...` outside `allowed`
    (lines), where _name is not one of the file's own: a private name of the standard
    library or of a dependency."""
    module = ast.parse(source)
    own = own_names(module)
    found = []
    for node in ast.walk(module):
        if getattr(node, "lineno", None) in allowed:
            continue
        names = []
        if isinstance(node, ast.Attribute) and node.attr not in own:
            names.append(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names += [*(node.module or "").split("."), *(alias.name for alias in node.names)]
        elif isinstance(node, ast.Import):
            names += [part for alias in node.names for part in alias.name.split(".")]
        found += [
            f"{node.lineno}: {name}"
            for name in names
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
        ]
    return found


def test_no_private_name_of_a_dependency_outside_the_seams():
    assert private_names_reached(SOURCE, seams_lines()) == []


def test_a_private_name_reached_outside_the_seams_is_caught():
    source = """
import asyncio
from uvicorn.protocols.http import _helpers
from starlette.routing import _private

class Mine:
    def _own(self):
        self._state = asyncio._get_running_loop()
        return self._own, self._state
"""
    assert private_names_reached(source, range(0)) == [
        "3: _helpers",
        "4: _private",
        "8: _get_running_loop",
    ]
    assert private_names_reached(source, range(3, 9)) == []


def pins() -> dict[str, str]:
    """Every `name==version` of the service's lock, serve's and the tests' requirements."""
    files = ("requirements.lock", "requirements-serve.txt", "tests/requirements.txt")
    text = "".join((ROOT / name).read_text() for name in files)
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", text, re.MULTILINE))


def test_the_seams_were_checked_against_the_pinned_versions():
    """handler.SEAMS_CHECKED_AGAINST names the versions the seams part was read against:
    a pin or an install of another version fails here, so an upgrade rereads the seams
    (and changes SEAMS_CHECKED_AGAINST) on purpose."""
    import handler

    pinned = pins()
    for name, checked in handler.SEAMS_CHECKED_AGAINST.items():
        assert (name, pinned.get(name)) == (name, checked), "the pin differs: reread the seams"
        assert (name, importlib.metadata.version(name)) == (name, checked), "installed differs"
