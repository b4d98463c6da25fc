"""Cold start of the BUILT function package and layer: Lambda's Init, and `import handler`.

    python bench/cold_start.py [--runs 9] [--emulator-runs 5] [--memory 512,1024]
                               [--python /path/to/python3.12] [--build-dir DIR]
    python bench/cold_start.py --vs REF [--emulator-runs 9] [--runs 9] [--vs-name NAME]

Builds the function package and the layer with the real Makefile (`make
build-ApiFunction`, `make build-DependenciesLayer`, pip from PyPI; ALLOW_MISSING_RDS_CA=1)
unless --build-dir holds a build. Then, in one run:

1. Init as Lambda measures it: handler.api run by awslambdaric under the Runtime Interface
   Emulator, /var/task and /opt read-only (tests/lambda_emulator.py), one fresh emulator
   per run, its `INIT REPORT(durationMs: ...)` line; at full CPU, and under a cgroup CPU
   quota equal to the CPU Lambda gives the function: MemorySize/1769 of one vCPU, for the
   MemorySize template.yaml gives ApiFunction (and for each --memory size). Then its first
   requests (GET /ping, events/ping.json) on an embedded PostgreSQL: the first one's
   duration (the emulator's INVOKE RTDONE) less a warm one's. As deployed, the tokens are
   read from Secrets Manager (moto's server on 127.0.0.1); `share-plain` has them in the
   environment instead (as `sam local` does), for comparison. Prints
   `init_configured_share_ms` (target <= 1000), `init_configured_memory_mb`,
   `init_full_ms`, `first_secret_request_extra_ms` (target <= 150), and
   `init_configured_share_plain_ms` and `first_request_extra_ms` (tokens in the
   environment): medians, at the configured share unless named otherwise.
2. `import handler` in a fresh interpreter of the runtime's Python (3.12), one process per
   run, in three trees:
   * shipped: the build as it is, made read-only, PYTHONDONTWRITEBYTECODE=1 (what Lambda
     does with /var/task and /opt: nothing compiled at a cold start is kept);
   * warm: a writable copy without the shipped bytecode, imported once first so Python
     writes its own (the best case: every later process starts warm);
   * no_bytecode: a read-only copy without any bytecode (as layers were built before
     bytecode was shipped: every cold start compiles fastapi, pydantic and the rest).
   Runs alternate between the trees; medians are reported, then `name=value` lines:
   cold_import_vs_warm (shipped / warm, target <= 1.15) and no_bytecode_vs_shipped.

With --vs REF, instead, what a change costs a cold start: the function package of the
commit REF is built too, by REF's own Makefile (the layer is this tree's: REF must have
the same requirements.lock), and the two packages, `before` (REF) and `after` (this
tree), take turns (before first in even runs, after first in odd ones) at the CPU share
of the template's MemorySize, as deployed (tokens from Secrets Manager):
* Init, one new emulator per run (--emulator-runs per tree);
* `import handler` of each shipped tree, read-only, in a fresh interpreter in a cgroup
  with the same quota (--runs per tree).
Prints the medians of each and of the run-by-run differences (after less before), each
difference with a 95 % interval of its median:
`init_<NAME>_extra_ms` (target <= 10 for the web view), `init_cpu_<NAME>_extra_ms` (Init's
CPU time) and `init_<NAME>_extra_from_cpu_ms` (that over the share), and
`import_<NAME>_extra_ms`, `import_cpu_<NAME>_extra_ms`, and `import_<NAME>_new_modules`
(modules `import handler` loads in the after tree and not in the before one, named in
the lines above it); NAME is --vs-name (web_view).
Then handler.py's own part of `import handler`, which a change to handler.py alone
moves, with far less noise than a whole import: in --runs more fresh interpreters per
tree under the same quota, -X importtime's self time of handler (reading and running its
bytecode, without the libraries it imports): `import_self_<NAME>_extra_ms`. And the same
without the noise of new processes at all: the
two trees' bytecode of handler.py unmarshalled and run (its top level) in turn, at least
30 times each, in one interpreter that has imported the libraries once:
`module_cpu_<NAME>_extra_ms` and `module_<NAME>_extra_at_share_ms` (that over the share).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The build helpers of tests/ (test_template.py imports handler from the checkout).
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from lambda_emulator import (  # noqa: E402
    MB_PER_VCPU,
    CpuQuota,
    Emulator,
    build,
    free_port,
    prepare_kit,
)

PROBE = """
import importlib.machinery, json, sys, time
compiled = []
original = importlib.machinery.SourceFileLoader.source_to_code
def counting(self, data, path, *args, **kwargs):
    compiled.append(path)
    return original(self, data, path, *args, **kwargs)
importlib.machinery.SourceFileLoader.source_to_code = counting
sys.path[:0] = [sys.argv[1], sys.argv[2]]
started, cpu = time.perf_counter(), time.process_time()
import handler
print(json.dumps({"seconds": time.perf_counter() - started, "compiled": len(compiled),
                  "cpu_seconds": time.process_time() - cpu, "modules": sorted(sys.modules)}))
"""
# handler.py's own code, the bytecode of each of two shipped trees (argv 3 and 4), executed
# again and again in one interpreter in which the libraries are already imported: what a
# change to handler.py alone adds to `import handler` (unmarshalling its bytecode and
# running its top level), without the noise of starting an interpreter each time.
MODULE_PROBE = """
import json, marshal, re, sys, time, types
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import handler
code = {"before": sys.argv[3], "after": sys.argv[4]}
data = {tree: open(path + "/__pycache__/handler.cpython-312.pyc", "rb").read()
        for tree, path in code.items()}
seen = {tree: [] for tree in code}
for run in range(int(sys.argv[5]) + 1):
    for tree in list(code)[:: 1 if run % 2 == 0 else -1]:
        re.purge()
        module = types.ModuleType("handler")
        module.__file__ = code[tree] + "/handler.py"
        sys.modules["handler"] = module
        started = time.process_time()
        exec(marshal.loads(data[tree][16:]), module.__dict__)
        if run:
            seen[tree].append(time.process_time() - started)
print(json.dumps(seen))
"""
# Runs a command in the cgroups named by $CGROUP_PROCS (a CpuQuota's), from its start.
IN_CGROUP = 'for procs in $CGROUP_PROCS; do echo $$ > "$procs"; done; exec "$@"'


def find_python(explicit: str | None) -> str:
    from sam_template import find_lambda_python

    found = explicit or find_lambda_python()
    if not found:
        sys.exit("no Python 3.12 found: pass --python /path/to/python3.12")
    return found


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


# A line of `python -X importtime` for handler: its self time (µs), without the modules
# it imports.
HANDLER_SELF = re.compile(r"import time:\s+(\d+) \|\s+\d+ \|\s+handler$", re.MULTILINE)


def import_once(
    python: str,
    function: Path,
    layer: Path,
    write_bytecode: bool,
    quota: CpuQuota | None = None,
    importtime: bool = False,
) -> dict:
    """One fresh interpreter's `import handler`; with importtime, under -X importtime, and
    `handler_self_ms`: handler.py's own part of it (its bytecode read and run)."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    options = ["-X", "importtime"] if importtime else []
    command = [python, "-s", *options, "-c", PROBE, str(function), str(layer / "python")]
    if quota is not None:
        env["CGROUP_PROCS"] = " ".join(map(str, quota.procs))
        command = ["sh", "-c", IN_CGROUP, "import-probe", *command]
    done = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(done.stdout)
    if importtime:
        seen["handler_self_ms"] = int(HANDLER_SELF.findall(done.stderr)[-1]) / 1000
    return seen


RTDONE = re.compile(r"INVOKE RTDONE\(status: (\w+), produced bytes: \d+, duration: ([0-9.]+)ms")
SECRET_NAME = "analysis-queue/upload-password"


def template_memory_mb() -> int:
    """The MemorySize template.yaml gives ApiFunction (after Globals), as deployed."""
    from sam_template import translate

    (function,) = [
        r
        for name, r in translate()["Resources"].items()
        if r["Type"] == "AWS::Lambda::Function" and name.startswith("ApiFunction")
    ]
    return int(function["Properties"]["MemorySize"])


def cold_start_once(python, kit, function, layer, variables, memory_mb, quota, log_path) -> dict:
    """One new emulator: its Init, and its first request's duration less a warm one's."""
    with Emulator(
        kit,
        python,
        function,
        layer,
        "handler.api",
        variables,
        function_name="analysis-queue-ApiFunction",
        memory_mb=memory_mb,
        timeout_s=25,
        cpu_quota=quota,
        log_path=log_path,
    ) as emulator:
        ping = json.loads((REPO / "events" / "ping.json").read_text())
        # CPU time: before the first request (the emulator idle, the runtime not yet
        # started: Init runs at the first request), after it, after a warm one.
        cpu = [quota.cpu_ms()]
        answers = []
        for _ in range(2):
            answers.append(emulator.invoke(ping))
            cpu.append(quota.cpu_ms())
        answers += [emulator.invoke(ping) for _ in range(2)]
        log = emulator.log()
        inits = emulator.init_reports_ms()
    if any(a.get("statusCode") != 200 for a in answers) or len(inits) != 1:
        raise SystemExit(f"the function did not answer GET /ping with 200:\n{answers}\n{log}")
    durations = [float(ms) for status, ms in RTDONE.findall(log) if status == "success"]
    assert len(durations) == 4, log
    # Init's CPU time: the first request's interval less a warm request's.
    init_cpu = (cpu[1] - cpu[0]) - (cpu[2] - cpu[1])
    return {
        "init": inits[0],
        "extra": durations[0] - statistics.median(durations[1:]),
        "init_cpu": init_cpu,
    }


@contextmanager
def backing_services(work: Path) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """An embedded PostgreSQL at the head of the ledger and moto's Secrets Manager on
    127.0.0.1; yields the API function's variables with the tokens in the environment
    (`plain`, as `sam local` has them) and as deployed (`secret`: read from Secrets
    Manager)."""
    from moto.server import ThreadedMotoServer

    import handler
    from helpers import env_json, migrate

    server = handler.embedded_postgres_server(work / "pgdata")
    moto_port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
    moto.start()
    try:
        url = server.get_uri()
        migrate(url)
        import boto3

        boto3.client(
            "secretsmanager",
            region_name="us-east-1",
            endpoint_url=f"http://127.0.0.1:{moto_port}",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_secret(Name=SECRET_NAME, SecretString="local-upload-password")
        plain = {**env_json("ApiFunction"), "DATABASE_URL": url}
        secret = {
            **plain,
            "UPLOAD_PASSWORD": "",
            "UPLOAD_PASSWORD_SECRET": f"secretsmanager:{SECRET_NAME}",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        yield plain, secret
    finally:
        moto.stop()
        server.cleanup()


def emulator_figures(python, function, layer, runs, more_memory, work) -> None:
    kit = prepare_kit(python)
    configured = template_memory_mb()
    with backing_services(work) as (plain, secret):
        # As deployed, the API reads its tokens (and the database's) from Secrets Manager.
        settings = [("full", configured, secret, None), ("share", configured, secret, configured)]
        settings += [("share-plain", configured, plain, configured)]
        settings += [("share", m, secret, m) for m in more_memory]
        seen: dict[tuple, list[dict]] = {}
        for run in range(runs):
            for name, memory, variables, quota_mb in settings:
                quota = CpuQuota(quota_mb / MB_PER_VCPU if quota_mb else None)
                try:
                    figures = cold_start_once(
                        python,
                        kit,
                        function,
                        layer,
                        variables,
                        memory,
                        quota,
                        work / f"emulator-{name}-{memory}-{run}.log",
                    )
                finally:
                    quota.close()
                seen.setdefault((name, memory), []).append(figures)

    def median(key, field) -> float:
        return statistics.median(f[field] for f in seen[key])

    print(f"Init (the emulator's INIT REPORT) and first requests, {runs} emulators each:")
    for (name, memory), figures in seen.items():
        inits = [f["init"] for f in figures]
        share = "full CPU" if name == "full" else f"{memory / MB_PER_VCPU:.0%} of a CPU"
        print(
            f"  {name:12} {memory:5} MB ({share}): Init median {statistics.median(inits):.0f} ms"
            f" (range {min(inits):.0f}-{max(inits):.0f}), first request"
            f" +{median((name, memory), 'extra'):.0f} ms over a warm one;"
            f" Init's CPU time {median((name, memory), 'init_cpu'):.0f} ms"
        )
    print(f"init_configured_memory_mb={configured}")
    print(f"init_configured_share_ms={median(('share', configured), 'init'):.0f}")
    print(f"init_full_ms={median(('full', configured), 'init'):.0f}")
    # What Init takes at the configured share when nothing else competes for the CPU
    # (it is CPU-bound): its CPU time over the share. On a busy machine the wall-clock
    # figures above are longer than Lambda's; this one is not.
    cpu = median(("full", configured), "init_cpu")
    print(f"init_cpu_ms={cpu:.0f}")
    print(f"init_configured_share_from_cpu_ms={cpu / (configured / MB_PER_VCPU):.0f}")
    print(f"init_configured_share_plain_ms={median(('share-plain', configured), 'init'):.0f}")
    print(f"first_secret_request_extra_ms={median(('share', configured), 'extra'):.0f}")
    print(f"first_request_extra_ms={median(('share-plain', configured), 'extra'):.0f}")
    for memory in more_memory:
        print(f"init_{memory}mb_share_ms={median(('share', memory), 'init'):.0f}")


def build_function_at(ref: str, python: str, base: Path) -> Path:
    """The function package of the commit `ref`, built by that commit's own Makefile
    (`make build-ApiFunction`) from its handler.py and sql/, in `base`/fn."""
    checkout = base / "checkout"
    checkout.mkdir(parents=True)
    names = ["handler.py", "Makefile", "requirements.txt", "requirements.lock", "sql"]
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, *names],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True, timeout=60)
    done = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "build-ApiFunction",
            f"ARTIFACTS_DIR={base / 'fn'}",
            f"LAMBDA_PYTHON={python}",
        ],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"make build-ApiFunction at {ref} failed:\n{done.stderr[-3000:]}")
    return base / "fn"


def same_layer(ref: str) -> bool:
    """Whether `ref` builds the same layer as this tree (the same requirements.lock)."""
    theirs = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{ref}:requirements.lock"],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    return theirs == (REPO / "requirements.lock").read_bytes()


def paired(after: list[float], before: list[float]) -> float:
    """The median of the run-by-run differences (after less before)."""
    return statistics.median(a - b for a, b in zip(after, before, strict=True))


def paired_range(after: list[float], before: list[float]) -> str:
    """A 95 % confidence interval of that median, distribution-free (the order statistics
    k and n-1-k of the differences, k = n/2 - 0.98 sqrt(n)): how far apart the trees may be."""
    differences = sorted(a - b for a, b in zip(after, before, strict=True))
    k = max(0, int(len(differences) / 2 - 0.98 * len(differences) ** 0.5))
    return f"{differences[k]:+.1f} to {differences[-1 - k]:+.1f}"


def vs_figures(python, ref, trees, layer, runs, import_runs, name, work) -> None:
    """Init of two function packages on one layer, `before` (ref) and `after` (this tree),
    at the template's CPU share: one new emulator per run, the trees alternating (before
    first in even runs, after first in odd ones); then `import handler` of each shipped
    tree, read-only, in a fresh interpreter under the same quota, alternating too."""
    kit = prepare_kit(python)
    configured = template_memory_mb()
    share = configured / MB_PER_VCPU
    seen: dict[str, list[dict]] = {tree: [] for tree in trees}
    with backing_services(work) as (_, secret):
        for run in range(runs):
            for tree in list(trees)[:: 1 if run % 2 == 0 else -1]:
                quota = CpuQuota(share)
                try:
                    figures = cold_start_once(
                        python,
                        kit,
                        trees[tree],
                        layer,
                        secret,
                        configured,
                        quota,
                        work / f"emulator-vs-{tree}-{run}.log",
                    )
                finally:
                    quota.close()
                seen[tree].append(figures)

    def series(tree: str, field: str) -> list[float]:
        return [f[field] for f in seen[tree]]

    print(
        f"Init (the emulator's INIT REPORT) at {share:.0%} of a CPU (MemorySize {configured}),"
        f" {runs} emulators per tree, alternating; before = {ref}, after = this tree:"
    )
    for tree in trees:
        inits = series(tree, "init")
        print(
            f"  {tree:7} Init median {statistics.median(inits):.0f} ms"
            f" (range {min(inits):.0f}-{max(inits):.0f}), Init's CPU time"
            f" {statistics.median(series(tree, 'init_cpu')):.0f} ms"
        )
    for field, what in (("init", "Init"), ("init_cpu", "Init's CPU time")):
        after, before = series("after", field), series("before", field)
        print(
            f"  after less before, run by run: {what} median {paired(after, before):+.1f} ms,"
            f" 95 % interval of the median {paired_range(after, before)} ms"
        )
    extra_cpu = paired(series("after", "init_cpu"), series("before", "init_cpu"))
    print(f"init_before_ms={statistics.median(series('before', 'init')):.0f}")
    print(f"init_after_ms={statistics.median(series('after', 'init')):.0f}")
    print(f"init_{name}_extra_ms={paired(series('after', 'init'), series('before', 'init')):.1f}")
    print(f"init_cpu_{name}_extra_ms={extra_cpu:.1f}")
    print(f"init_{name}_extra_from_cpu_ms={extra_cpu / share:.1f}")

    # `import handler` of the shipped trees (bytecode as built), read-only, one layer.
    copies = work / "vs-imports"
    copies.mkdir()
    shipped = {tree: copies / tree for tree in trees}
    for tree, function in trees.items():
        shutil.copytree(function, shipped[tree])
    shutil.copytree(layer, copies / "layer")
    read_only(*shipped.values(), copies / "layer")
    before = files(copies)
    imports: dict[str, list[dict]] = {tree: [] for tree in trees}
    for run in range(import_runs):
        for tree in list(trees)[:: 1 if run % 2 == 0 else -1]:
            quota = CpuQuota(share)
            try:
                imports[tree].append(
                    import_once(python, shipped[tree], copies / "layer", False, quota)
                )
            finally:
                quota.close()
    # handler.py's own part of the import, cold: -X importtime's self time of handler in
    # each fresh interpreter (its own runs: -X importtime slows every import a little).
    own: dict[str, list[float]] = {tree: [] for tree in trees}
    for run in range(import_runs):
        for tree in list(trees)[:: 1 if run % 2 == 0 else -1]:
            quota = CpuQuota(share)
            try:
                seen = import_once(python, shipped[tree], copies / "layer", False, quota, True)
                own[tree].append(seen["handler_self_ms"])
            finally:
                quota.close()
    assert files(copies) == before, "a read-only tree was written"

    def ms(tree: str, field: str) -> list[float]:
        return [f[field] * 1000 for f in imports[tree]]

    print(
        f"`import handler`, shipped trees read-only, {share:.0%} of a CPU,"
        f" {import_runs} fresh interpreters per tree, alternating:"
    )
    for tree in trees:
        wall = ms(tree, "seconds")
        print(
            f"  {tree:7} median {statistics.median(wall):.0f} ms"
            f" (range {min(wall):.0f}-{max(wall):.0f}), CPU time"
            f" {statistics.median(ms(tree, 'cpu_seconds')):.0f} ms, modules compiled:"
            f" {sorted({f['compiled'] for f in imports[tree]})}"
        )
    for field, what in (("seconds", "import"), ("cpu_seconds", "its CPU time")):
        after, before = ms("after", field), ms("before", field)
        print(
            f"  after less before, run by run: {what} median {paired(after, before):+.1f} ms,"
            f" 95 % interval of the median {paired_range(after, before)} ms"
        )
    modules = {tree: set(imports[tree][0]["modules"]) for tree in trees}
    added = sorted(modules["after"] - modules["before"])
    print(
        f"  modules loaded by `import handler`: before {len(modules['before'])}, after"
        f" {len(modules['after'])}; only after: {added or 'none'}; only before:"
        f" {sorted(modules['before'] - modules['after']) or 'none'}"
    )
    print(f"import_before_ms={statistics.median(ms('before', 'seconds')):.0f}")
    print(f"import_after_ms={statistics.median(ms('after', 'seconds')):.0f}")
    print(f"import_{name}_extra_ms={paired(ms('after', 'seconds'), ms('before', 'seconds')):.1f}")
    cpu_extra = paired(ms("after", "cpu_seconds"), ms("before", "cpu_seconds"))
    print(f"import_cpu_{name}_extra_ms={cpu_extra:.1f}")
    print(f"import_{name}_new_modules={len(added)}")
    print(
        f"handler.py's own part of `import handler` (-X importtime's self time of handler),"
        f" {import_runs} more fresh interpreters per tree, alternating, same quota:"
    )
    for tree in trees:
        print(
            f"  {tree:7} median {statistics.median(own[tree]):.1f} ms"
            f" (range {min(own[tree]):.1f}-{max(own[tree]):.1f})"
        )
    print(
        f"  after less before, run by run: median {paired(own['after'], own['before']):+.1f}"
        f" ms, 95 % interval of the median {paired_range(own['after'], own['before'])} ms"
    )
    print(f"import_self_{name}_extra_ms={paired(own['after'], own['before']):.1f}")

    runs = max(30, import_runs)
    done = subprocess.run(
        [
            python,
            "-s",
            "-c",
            MODULE_PROBE,
            str(shipped["after"]),
            str(copies / "layer" / "python"),
            str(shipped["before"]),
            str(shipped["after"]),
            str(runs),
        ],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    body = {tree: [t * 1000 for t in times] for tree, times in json.loads(done.stdout).items()}
    print(
        f"handler.py's own bytecode (unmarshal and top level), {runs} times per tree in one"
        " interpreter with the libraries imported, alternating, CPU time:"
    )
    for tree in trees:
        print(
            f"  {tree:7} median {statistics.median(body[tree]):.1f} ms"
            f" (range {min(body[tree]):.1f}-{max(body[tree]):.1f})"
        )
    print(
        f"  after less before, run by run: median {paired(body['after'], body['before']):+.1f}"
        f" ms, 95 % interval of the median {paired_range(body['after'], body['before'])} ms"
    )
    module_extra = paired(body["after"], body["before"])
    print(f"module_cpu_{name}_extra_ms={module_extra:.1f}")
    print(f"module_{name}_extra_at_share_ms={module_extra / share:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="`import handler` runs per tree")
    parser.add_argument("--emulator-runs", type=int, default=5, help="emulators per setting")
    parser.add_argument(
        "--memory", default="", help="more MemorySize values to measure Init at, e.g. 1024,1769"
    )
    parser.add_argument("--python", help="the Lambda runtime's Python (3.12)")
    parser.add_argument("--build-dir", type=Path, help="reuse a build (fn/ and layer/ in it)")
    parser.add_argument("--emulator-only", action="store_true", help="skip `import handler`")
    parser.add_argument(
        "--vs",
        metavar="REF",
        help="instead: Init and `import handler` of this tree against the commit REF's,"
        " alternating, at the template's CPU share (the layer must be the same)",
    )
    parser.add_argument(
        "--vs-name",
        default="web_view",
        help="what --vs measures, in the names it prints (init_<NAME>_extra_ms)",
    )
    args = parser.parse_args()
    if args.vs and not same_layer(args.vs):
        sys.exit(f"{args.vs} has another requirements.lock: its layer differs from this tree's")
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
        if args.vs:
            print(f"building {args.vs}'s function package ...", file=sys.stderr)
            trees = {"before": build_function_at(args.vs, python, work / "vs"), "after": function}
            vs_figures(
                python, args.vs, trees, layer, args.emulator_runs, args.runs, args.vs_name, work
            )
            return 0
        emulator_figures(
            python,
            function,
            layer,
            args.emulator_runs,
            [int(m) for m in args.memory.split(",") if m.strip()],
            work,
        )
        if args.emulator_only:
            return 0
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
