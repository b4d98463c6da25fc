"""Reproducible builds and cold-start bytecode.

* requirements.lock pins every transitive dependency of requirements.txt, with hashes.
* The minimum Python is checked with a clear message.
* The real Makefile builds the layer (real pip, from PyPI) and the function package:
  bytecode compiled by Python 3.12, hash-based and unchecked; no python/bin scripts;
  two builds from two checkouts in different places are identical; importing handler
  from the built tree, read-only, compiles nothing.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess

import kit
import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import handler
from sam_template import LAMBDA_PYTHON, make, sam_dir_checksum

# Uses no PostgreSQL (conftest.py holds it to that): CI's second pass leaves it out.
pytestmark = pytest.mark.no_database

REPO = handler.HERE
# Markers as the Lambda runtime evaluates them.
LAMBDA_ENVIRONMENT = {
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def locked() -> dict[str, tuple[str, list[str]]]:
    """requirements.lock as {name: (version, hashes)}."""
    text = (REPO / "requirements.lock").read_text()
    entries = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = re.match(r"([A-Za-z0-9_.\-\[\]]+)==([^\s\\;]+)", block)
        if head:
            entries[canonicalize_name(head.group(1))] = (
                head.group(2),
                re.findall(r"--hash=sha256:([0-9a-f]{64})", block),
            )
    return entries


def test_the_lock_pins_requirements_txt_and_hashes_everything():
    lock = locked()
    assert len(lock) >= 10
    for name, (version, hashes) in lock.items():
        assert hashes, name
        assert re.fullmatch(r"[0-9A-Za-z.+!-]+", version), name
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", line
        assert lock[canonicalize_name(requirement.name)][0] == specifier.version, line


@pytest.mark.slow  # the `builds` fixture: the real Makefile and pip
def test_the_lock_holds_every_transitive_dependency(builds):
    """Each locked package's own requirements (from the metadata of the version the
    layer installed) are locked too."""
    lock = locked()
    layer, _ = builds[0]
    installed = {
        canonicalize_name(d.metadata["Name"]): d
        for d in (
            importlib.metadata.PathDistribution(path)
            for path in (layer / "python").glob("*.dist-info")
        )
    }
    assert set(installed) == set(lock)
    missing = set()
    for name, distribution in installed.items():
        assert distribution.version == lock[name][0], name
        for text in distribution.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker or Marker("python_version >= '0'")
            if marker.evaluate(LAMBDA_ENVIRONMENT):
                if canonicalize_name(requirement.name) not in lock:
                    missing.add(f"{requirement.name} (for {name})")
    assert not missing


def test_minimum_python_is_checked_with_a_clear_message():
    with pytest.raises(SystemExit, match=r"need Python 3\.11 or newer; this is Python 3\.10\.4"):
        kit.check_python((3, 10, 4, "final", 0))
    kit.check_python((3, 11, 0))
    # Said once, where a reader starts; the other pages link to it.
    assert "Python 3.11 or newer" in (REPO / "README.md").read_text()
    for page in ("docs/testing.md", "docs/deploy.md"):
        assert "../README.md#the-two-commands" in (REPO / page).read_text(), page


# --------------------------------------------------------------------------- the real build


def checkout(destination) -> None:
    """What the build reads, and the documentation beside it (which it must leave out)."""
    destination.mkdir(parents=True)
    for name in ("handler.py", "Makefile", "requirements.txt", "requirements.lock", "README.md"):
        shutil.copy2(REPO / name, destination / name)
    for name in ("sql", "web", "docs"):
        shutil.copytree(REPO / name, destination / name)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The layer and the function package, built twice by the real Makefile from two
    checkouts in different directories."""
    assert LAMBDA_PYTHON, (
        "no Python 3.12 on this machine: the bytecode check needs the Lambda runtime's"
        " Python (e.g. `pyenv install 3.12`, or apt's python3.12)"
    )
    built = []
    for n in (1, 2):
        base = tmp_path_factory.mktemp(f"build{n}")
        checkout(base / f"checkout-{n}")
        for target, out in (("build-DependenciesLayer", "layer"), ("build-ApiFunction", "fn")):
            result = make(target, base / f"checkout-{n}", base / out, ALLOW_MISSING_RDS_CA="1")
            assert result.returncode == 0, result.stderr[-3000:]
        built.append((base / "layer", base / "fn"))
    return built


def pyc_header(path) -> tuple[bytes, int]:
    data = path.read_bytes()
    return data[:4], int.from_bytes(data[4:8], "little")


@pytest.mark.slow  # the `builds` fixture: the real Makefile and pip
def test_layer_and_function_ship_unchecked_hash_bytecode_for_3_12(builds):
    layer, function = builds[0]
    magic = subprocess.run(
        [LAMBDA_PYTHON, "-c", "import importlib.util; print(importlib.util.MAGIC_NUMBER.hex())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    sources = [
        *(layer / "python").rglob("*.py"),
        function / "handler.py",
    ]
    assert len(sources) > 100
    for source in sources:
        pyc = source.parent / "__pycache__" / f"{source.stem}.cpython-312.pyc"
        assert pyc.is_file(), source
        file_magic, flags = pyc_header(pyc)
        assert file_magic.hex() == magic, source
        assert flags == 0b01, source  # hash-based, not checked against the source
    assert not (layer / "python" / "bin").exists()


@pytest.mark.slow  # the `builds` fixture: the real Makefile and pip
def test_the_function_package_is_handler_sql_and_web_only(builds):
    """The real build of a checkout with README.md and docs/ ships neither: editing the
    documentation never changes the deployed package (nor re-runs migrations)."""
    _, function = builds[0]
    shipped = {p.relative_to(function).as_posix() for p in function.rglob("*") if p.is_file()}
    ledger = {f"sql/{p.name}" for p in (REPO / "sql").glob("*.sql")}
    page = {f"web/{p.relative_to(REPO / 'web').as_posix()}" for p in (REPO / "web").rglob("*")}
    page = {name for name in page if (REPO / name).is_file()}
    assert shipped == {"handler.py", "__pycache__/handler.cpython-312.pyc"} | ledger | page
    assert not any(name.endswith(".md") for name in shipped)


@pytest.mark.slow  # the `builds` fixture: the real Makefile and pip
def test_two_builds_in_two_places_are_identical(builds):
    (layer1, function1), (layer2, function2) = builds
    assert sam_dir_checksum(layer1) == sam_dir_checksum(layer2)
    assert sam_dir_checksum(function1) == sam_dir_checksum(function2)
    # No build path got into either (pip's RECORD files, bytecode file names).
    for path in [*layer1.rglob("*"), *function1.rglob("*")]:
        if path.is_file():
            assert str(layer1.parent).encode() not in path.read_bytes(), path


IMPORT_PROBE = """
import importlib.machinery, json, sys, time
compiled = []
original = importlib.machinery.SourceFileLoader.source_to_code
def counting(self, data, path, *args, **kwargs):
    compiled.append(path)
    return original(self, data, path, *args, **kwargs)
importlib.machinery.SourceFileLoader.source_to_code = counting
sys.path[:0] = [sys.argv[1], sys.argv[2]]
started = time.perf_counter()
import handler
elapsed = time.perf_counter() - started
tree = [p for p in compiled if p.startswith((sys.argv[1], sys.argv[2]))]
print(json.dumps({"compiled": tree, "seconds": elapsed, "boto3": "boto3" in sys.modules}))
"""


@pytest.mark.slow  # the `builds` fixture: the real Makefile and pip
def test_importing_the_built_tree_read_only_compiles_nothing(builds):
    layer, function = builds[0]
    before = sorted(str(p) for p in [*layer.rglob("*"), *function.rglob("*")])
    probe = subprocess.run(
        [LAMBDA_PYTHON, "-s", "-c", IMPORT_PROBE, str(function), str(layer / "python")],
        env={"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert seen["compiled"] == []
    assert seen["boto3"] is False  # not in the layer: the runtime's copy, when a secret is read
    after = sorted(str(p) for p in [*layer.rglob("*"), *function.rglob("*")])
    assert after == before
