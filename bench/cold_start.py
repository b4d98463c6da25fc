"""Cold start: `import handler` from the BUILT function package and layer.

    python bench/cold_start.py [--runs 9] [--python /path/to/python3.12] [--build-dir DIR]

Builds the function package and the layer with the real Makefile (`make
build-ApiFunction`, `make build-DependenciesLayer`, pip from PyPI; ALLOW_MISSING_RDS_CA=1)
unless --build-dir holds a build, then times `import handler` in a fresh interpreter of
the runtime's Python (3.12), one process per run, in three trees:

* shipped: the build as it is, made read-only, PYTHONDONTWRITEBYTECODE=1 (what Lambda
  does with /var/task and /opt: nothing compiled at a cold start is kept);
* warm: a writable copy without the shipped bytecode, imported once first so Python
  writes its own (the best case: every later process starts warm);
* no_bytecode: a read-only copy without any bytecode (as layers were built before
  bytecode was shipped: every cold start compiles fastapi, pydantic and the rest).

Runs alternate between the trees; medians are reported, then `name=value` lines:
cold_import_vs_warm (shipped / warm, target <= 1.15) and no_bytecode_vs_shipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The build helpers of tests/test_template.py, which imports handler from the checkout.
sys.path[:0] = [str(REPO), str(REPO / "tests")]

PROBE = """
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
print(json.dumps({"seconds": time.perf_counter() - started, "compiled": len(compiled)}))
"""


def find_python(explicit: str | None) -> str:
    from test_template import find_lambda_python

    found = explicit or find_lambda_python()
    if not found:
        sys.exit("no Python 3.12 found: pass --python /path/to/python3.12")
    return found


def build(python: str, base: Path) -> tuple[Path, Path]:
    checkout = base / "checkout"
    checkout.mkdir(parents=True)
    for name in ("handler.py", "Makefile", "requirements.txt", "requirements.lock"):
        shutil.copy2(REPO / name, checkout / name)
    shutil.copytree(REPO / "sql", checkout / "sql")
    for target, out in (("build-ApiFunction", "fn"), ("build-DependenciesLayer", "layer")):
        subprocess.run(
            [
                "make",
                "--no-print-directory",
                target,
                f"ARTIFACTS_DIR={base / out}",
                f"LAMBDA_PYTHON={python}",
                "ALLOW_MISSING_RDS_CA=1",
            ],
            cwd=checkout,
            check=True,
            capture_output=True,
        )
    return base / "fn", base / "layer"


def copy_tree(function: Path, layer: Path, destination: Path, bytecode: bool) -> tuple[Path, Path]:
    ignore = None if bytecode else shutil.ignore_patterns("__pycache__")
    shutil.copytree(function, destination / "fn", ignore=ignore)
    shutil.copytree(layer, destination / "layer", ignore=ignore)
    return destination / "fn", destination / "layer"


def read_only(*trees: Path) -> None:
    for tree in trees:
        for path in [tree, *tree.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)


def files(*trees: Path) -> list[str]:
    return sorted(str(p) for tree in trees for p in tree.rglob("*"))


def import_once(python: str, function: Path, layer: Path, write_bytecode: bool) -> dict:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    done = subprocess.run(
        [python, "-s", "-c", PROBE, str(function), str(layer / "python")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--python", help="the Lambda runtime's Python (3.12)")
    parser.add_argument("--build-dir", type=Path, help="reuse a build (fn/ and layer/ in it)")
    args = parser.parse_args()
    python = find_python(args.python)
    version = subprocess.run(
        [python, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    try:
        if args.build_dir:
            function, layer = args.build_dir / "fn", args.build_dir / "layer"
        else:
            print(f"building with the Makefile ({version}) ...", file=sys.stderr)
            function, layer = build(python, work / "build")
        trees = {
            "shipped": copy_tree(function, layer, work / "shipped", bytecode=True),
            "warm": copy_tree(function, layer, work / "warm", bytecode=False),
            "no_bytecode": copy_tree(function, layer, work / "no_bytecode", bytecode=False),
        }
        read_only(*trees["shipped"], *trees["no_bytecode"])
        before = files(*trees["shipped"], *trees["no_bytecode"])
        import_once(python, *trees["warm"], write_bytecode=True)  # Python writes its own
        seconds: dict[str, list[float]] = {name: [] for name in trees}
        compiled: dict[str, set[int]] = {name: set() for name in trees}
        for _ in range(args.runs):
            for name, (fn, lib) in trees.items():
                seen = import_once(python, fn, lib, write_bytecode=name == "warm")
                seconds[name].append(seen["seconds"])
                compiled[name].add(seen["compiled"])
        assert files(*trees["shipped"], *trees["no_bytecode"]) == before, "a tree was written"
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        print(f"{version}, {args.runs} fresh interpreters per tree, `import handler`:")
        for name, median in medians.items():
            spread = f"{min(seconds[name]):.3f}-{max(seconds[name]):.3f}"
            print(
                f"  {name:12} median {median:.3f} s (range {spread} s),"
                f" modules compiled from source per run: {sorted(compiled[name])}"
            )
        print(f"cold_import_vs_warm={medians['shipped'] / medians['warm']:.2f}")
        print(f"no_bytecode_vs_shipped={medians['no_bytecode'] / medians['shipped']:.2f}")
        print(f"import_shipped_s={medians['shipped']:.3f}")
        print(f"import_warm_s={medians['warm']:.3f}")
        print(f"import_no_bytecode_s={medians['no_bytecode']:.3f}")
    finally:
        for path in [work, *work.rglob("*")]:
            if path.exists() and not path.is_symlink():
                os.chmod(path, path.stat().st_mode | 0o200)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
