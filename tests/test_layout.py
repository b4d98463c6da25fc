"""handler.py reads top to bottom: its table of contents is its banners, and no section
uses a name defined by a later one. (A refactoring that moves code keeps these true, or
says where it did not.)"""

from __future__ import annotations

import ast
import re

from kit import ROOT

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
