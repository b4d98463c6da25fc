"""Cold start of the BUILT function package and layer: Lambda's Init, at the function's CPU share.

    python3 bench/cold_start.py [--emulator-runs 5] [--memory 512,1024,1769]
    python3 bench/cold_start.py --vs REF [--emulator-runs 9] [--runs 31]

Builds the function package and the layer with the real Makefile (`make
build-ApiFunction`, `make build-DependenciesLayer`; ALLOW_MISSING_RDS_CA=1) unless
--build-dir holds a build. Each run starts a new Runtime Interface Emulator with
handler.api under awslambdaric, /var/task and /opt read-only (tests/lambda_emulator.py),
in a cgroup whose CPU quota is what Lambda gives the function: MemorySize/1769 of one
vCPU, for the MemorySize template.yaml gives ApiFunction (and each --memory size); `full`
has no quota. Init is the emulator's `INIT REPORT(durationMs: ...)`; Init's CPU time is
the cgroup's CPU time over the first request less a warm request's. The first request
(GET /ping, events/ping.json) reads the database (an embedded PostgreSQL) and, with the
shared password in Secrets Manager (moto's server on 127.0.0.1), that secret: its
duration less a warm one's is first_secret_request_extra_ms; with the defaults (the
password from the environment until imported, then its hash in the database: no AWS API
asked), first_request_extra_ms. Medians over the runs.

With --vs REF, instead: what a change costs a cold start. REF's function package is
built by REF's own Makefile (the layer is this tree's: REF must have the same
requirements.lock); the two packages, before (REF) and after (this tree), take turns,
one new emulator each, at the template's CPU share. Printed: the median of the
run-by-run differences of Init and of Init's CPU time, each with a 95 % interval of that
median; then handler.py's own part (its bytecode unmarshalled and its top level run, the
two trees in turn, --runs times each in one interpreter that has the libraries): the
figure that resolves a few milliseconds, where a whole Init cannot.
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


def find_python(explicit: str | None) -> str:
    from sam_template import find_lambda_python

    found = explicit or find_lambda_python()
    if not found:
        sys.exit("no Python 3.12 found: pass --python /path/to/python3.12")
    return found


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
def backing_services(work: Path) -> Iterator[dict[str, str]]:
    """An embedded PostgreSQL at the head of the ledger and moto's Secrets Manager on
    127.0.0.1; yields the API function's variables as deployed (the tokens read from
    Secrets Manager)."""
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
        secret = {
            **env_json("ApiFunction"),
            "DATABASE_URL": url,
            "UPLOAD_PASSWORD": "",
            "UPLOAD_PASSWORD_SECRET": f"secretsmanager:{SECRET_NAME}",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        # The defaults: the shared password from the environment while the database holds
        # none (then its hash, sql/034), so the first request asks no AWS API.
        default = {**env_json("ApiFunction"), "DATABASE_URL": url}
        yield {"secret": secret, "default": default}
    finally:
        moto.stop()
        server.cleanup()


def run_emulators(python, settings, runs, work) -> dict[tuple, list[dict]]:
    """One new emulator per setting (name, function, memory, quota MB or None, and the
    environment: "secret", the shared password from Secrets Manager, or "default") per
    run, the settings in turn (reversed in odd runs)."""
    kit = prepare_kit(python)
    seen: dict[tuple, list[dict]] = {}
    with backing_services(work) as environments:
        for run in range(runs):
            for name, function, layer, memory, quota_mb, env in settings[
                :: 1 if run % 2 == 0 else -1
            ]:
                quota = CpuQuota(quota_mb / MB_PER_VCPU if quota_mb else None)
                try:
                    figures = cold_start_once(
                        python, kit, function, layer, environments[env], memory, quota,
                        work / f"emulator-{name}-{memory}-{run}.log",
                    )  # fmt: skip
                finally:
                    quota.close()
                seen.setdefault((name, memory), []).append(figures)
    return seen


def emulator_figures(python, function, layer, runs, more_memory, work) -> None:
    configured = template_memory_mb()
    settings = [("full", function, layer, configured, None, "secret")]
    settings += [("share", function, layer, m, m, "secret") for m in [configured, *more_memory]]
    settings += [("default", function, layer, configured, configured, "default")]
    seen = run_emulators(python, settings, runs, work)

    def median(key, field) -> float:
        return statistics.median(f[field] for f in seen[key])

    print(f"Init (the emulator's INIT REPORT) and first requests, {runs} emulators each:")
    for (name, memory), figures in seen.items():
        inits = [f["init"] for f in figures]
        share = "full CPU" if name == "full" else f"{memory / MB_PER_VCPU:.0%} of a CPU"
        print(
            f"  {name:6} {memory:5} MB ({share}): Init median {statistics.median(inits):.0f} ms"
            f" (range {min(inits):.0f}-{max(inits):.0f}), first request"
            f" +{median((name, memory), 'extra'):.0f} ms over a warm one;"
            f" Init's CPU time {median((name, memory), 'init_cpu'):.0f} ms"
        )
    # Init is CPU-bound: its CPU time over the share is what it takes when nothing else
    # competes for the CPU, as on Lambda; the wall-clock figures are longer on a busy machine.
    cpu = median(("full", configured), "init_cpu")
    print(f"init_configured_memory_mb={configured}")
    print(f"init_configured_share_ms={median(('share', configured), 'init'):.0f} target<=1000")
    print(f"init_configured_share_from_cpu_ms={cpu / (configured / MB_PER_VCPU):.0f} target<=1000")
    print(f"init_cpu_ms={cpu:.0f} reported")
    print(f"init_full_ms={median(('full', configured), 'init'):.0f} reported")
    extra = median(("share", configured), "extra")
    print(f"first_secret_request_extra_ms={extra:.0f} target<=150")
    # The defaults: no secret store asked (the in-region call is not measured here: moto
    # on loopback is not Secrets Manager; docs/benchmarks.md says what it is assumed to cost).
    default = median(("default", configured), "extra")
    print(f"first_request_extra_ms={default:.0f} reported")
    for memory in more_memory:
        print(f"init_{memory}mb_share_ms={median(('share', memory), 'init'):.0f} reported")


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
    return f"{differences[k]:+.1f}..{differences[-1 - k]:+.1f}"


def vs_figures(python, ref, trees, layer, runs, module_runs, work) -> None:
    """Init of two function packages on one layer, before (ref) and after (this tree),
    at the template's CPU share, in turn; then handler.py's own bytecode of each."""
    configured = template_memory_mb()
    share = configured / MB_PER_VCPU
    settings = [
        (tree, function, layer, configured, configured, "secret")
        for tree, function in trees.items()
    ]
    seen = run_emulators(python, settings, runs, work)

    def series(tree: str, field: str) -> list[float]:
        return [f[field] for f in seen[(tree, configured)]]

    print(
        f"Init at {share:.0%} of a CPU (MemorySize {configured}), {runs} emulators per tree"
        f" in turn; before = {ref}, after = this tree:"
    )
    for tree in trees:
        inits = series(tree, "init")
        print(
            f"  {tree:7} Init median {statistics.median(inits):.0f} ms (range"
            f" {min(inits):.0f}-{max(inits):.0f}), Init's CPU time"
            f" {statistics.median(series(tree, 'init_cpu')):.0f} ms"
        )
    print(f"init_before_ms={statistics.median(series('before', 'init')):.0f} reported")
    print(f"init_after_ms={statistics.median(series('after', 'init')):.0f} reported")
    for field, name in (("init", "init_extra_ms"), ("init_cpu", "init_cpu_extra_ms")):
        after, before = series("after", field), series("before", field)
        print(
            f"{name}={paired(after, before):.1f} interval={paired_range(after, before)} target<=0"
        )

    # handler.py's bytecode as each build ships it, in one interpreter with the libraries.
    done = subprocess.run(
        [
            python, "-s", "-c", MODULE_PROBE, str(trees["after"]), str(layer / "python"),
            str(trees["before"]), str(trees["after"]), str(module_runs),
        ],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    body = {tree: [t * 1000 for t in times] for tree, times in json.loads(done.stdout).items()}
    print(f"handler.py's own bytecode run {module_runs} times per tree in turn, CPU time:")
    for tree in trees:
        print(f"  {tree:7} median {statistics.median(body[tree]):.1f} ms")
    extra = paired(body["after"], body["before"])
    interval = paired_range(body["after"], body["before"])
    print(f"module_cpu_extra_ms={extra:.1f} interval={interval} target<=0")
    print(f"module_extra_at_share_ms={extra / share:.1f} reported")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--emulator-runs", type=int, default=5, help="emulators per setting")
    parser.add_argument("--memory", default="", help="more MemorySize values, e.g. 512,1024")
    parser.add_argument("--runs", type=int, default=31, help="--vs: runs of handler.py's body")
    parser.add_argument("--python", help="the Lambda runtime's Python (3.12)")
    parser.add_argument("--build-dir", type=Path, help="reuse a build (fn/ and layer/ in it)")
    parser.add_argument("--vs", metavar="REF", help="instead: this tree against REF's package")
    args = parser.parse_args()
    if args.vs and not same_layer(args.vs):
        sys.exit(f"{args.vs} has another requirements.lock: its layer differs from this tree's")
    python = find_python(args.python)
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    try:
        if args.build_dir:
            function, layer = args.build_dir / "fn", args.build_dir / "layer"
        else:
            print("building with the Makefile ...", file=sys.stderr)
            function, layer = build(python, work / "build")
        if args.vs:
            print(f"building {args.vs}'s function package ...", file=sys.stderr)
            trees = {"before": build_function_at(args.vs, python, work / "vs"), "after": function}
            vs_figures(python, args.vs, trees, layer, args.emulator_runs, args.runs, work)
        else:
            memory = [int(m) for m in args.memory.split(",") if m.strip()]
            emulator_figures(python, function, layer, args.emulator_runs, memory, work)
    finally:
        for path in [work, *work.rglob("*")]:
            if path.exists() and not path.is_symlink():
                os.chmod(path, path.stat().st_mode | 0o200)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
