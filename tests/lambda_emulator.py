"""The Lambda runtime without Docker: the BUILT function package and layer, run by
awslambdaric (the runtime interface client of Lambda's python3.12 images) under the
Runtime Interface Emulator that ships in the aws-sam-cli wheel, as Lambda lays them out:
the function read-only at /var/task, the layer read-only at /opt, the runtime client at
/var/runtime, in a private mount namespace (`unshare -m`, so the machine's own /var and
/opt are untouched), with Lambda's environment variables and Python 3.12.

No route to AWS (`no_route_to_aws`, on unless a caller turns it off): the function's
Python refuses every connection that would leave 127.0.0.1. tests/no_route_to_aws/
sitecustomize.py, bind-mounted read-only at /var/no-route-to-aws and put first on the
function's PYTHONPATH, installs an audit hook that raises PermissionError, naming the
host, for a look-up of any name but localhost and for a connect or datagram to any
address but loopback (a Unix socket is allowed), and writes each refusal to the log
(GUARD_REFUSAL). The emulator's own TCP port stays reachable, which a network namespace
would not allow; a refused call fails at once instead of succeeding or hanging. No
AWS_ENDPOINT_URL is set: an SDK that ignored it would still find its way out, and a
refusal by the guard is what a test sees. Before each emulator starts, the function's
Python is run once with the same mounts, environment and PYTHONPATH (GUARD_PROBE): a
connection to a Secrets Manager endpoint by name and to an AWS address must both be
refused by the guard, and one to 127.0.0.1 must not, or the emulator does not start
(about 45 ms). What the hook sees is Python's socket module (boto3/botocore, urllib,
http.client), not a C library's own sockets (libpq, the runtime client's curl to the
emulator): the tests give the function its database on 127.0.0.1.

Used by tests/test_lambda_runtime.py (answers against the in-process ones) and
bench/cold_start.py (the emulator's INIT REPORT, under a cgroup CPU quota).

Everything here fails with a message naming what is missing (no Python 3.12, no mount
namespaces, no cgroup CPU controller); nothing is skipped. The emulator listens on
127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KIT_REQUIREMENTS = REPO / "tests" / "requirements-lambda-runtime.txt"
SAM_REQUIREMENTS = REPO / "tests" / "requirements-sam.txt"
RIE_IN_WHEEL = "samcli/local/rapid/aws-lambda-rie-x86_64"
# Lambda gives a function one vCPU at 1,769 MB, and CPU in proportion below that.
MB_PER_VCPU = 1769
INVOKE_PATH = "/2015-03-31/functions/function/invocations"
# No route to AWS: tests/no_route_to_aws/sitecustomize.py, mounted read-only here and put
# first on the function's PYTHONPATH, refuses every socket that would leave 127.0.0.1.
GUARD_DIR = REPO / "tests" / "no_route_to_aws"
GUARD_DIR_IN = "/var/no-route-to-aws"
# What the guard writes to the function's log at each refusal (its REFUSAL).
GUARD_REFUSAL = "no-route-to-aws: refused"
# The direct check that the guard is active in the function's Python, with the function's
# environment and mounts: a look-up of an AWS endpoint and a connection to an AWS address
# must both fail with the guard's PermissionError, without a packet sent.
GUARD_PROBE = r"""
import socket, sys
where = getattr(sys.modules.get("sitecustomize"), "__file__", None)
assert where == sys.argv[1] + "/sitecustomize.py", f"sitecustomize from {where}"
for attempt in (
    lambda: socket.create_connection(("secretsmanager.us-east-1.amazonaws.com", 443), 5),
    lambda: socket.create_connection(("52.94.0.1", 443), 5),
):
    try:
        attempt().close()
    except PermissionError as refused:
        assert str(refused).startswith(sys.argv[2]), refused
    else:
        raise AssertionError("a connection to AWS was not refused")
socket.create_connection(("127.0.0.1", int(sys.argv[3])), 5).close()
print("guarded")
"""

# Inside the namespace: a tmpfs over /var (the machine's /var stays as it is outside),
# then read-only bind mounts; the cgroup first, so that the emulator and the runtime
# (its children) run under the CPU quota from their first instruction.
NAMESPACE_SCRIPT = r"""
set -eu
for procs in $CGROUP_PROCS; do echo $$ > "$procs"; done
mount --make-rprivate /
mount -t tmpfs -o size=1m,mode=755 lambda-var /var
mkdir /var/task /var/runtime
bind_ro() { mount --bind "$1" "$2" && mount -o remount,bind,ro "$2"; }
bind_ro "$FUNCTION_DIR" /var/task
bind_ro "$LAYER_DIR" /opt
bind_ro "$RUNTIME_DIR" /var/runtime
if [ -n "$GUARD_DIR" ]; then mkdir "$GUARD_DIR_IN"; bind_ro "$GUARD_DIR" "$GUARD_DIR_IN"; fi
cd /var/task
exec env -i "$@"
"""


class EmulatorUnavailable(AssertionError):
    """Something the emulator needs is not on this machine; the message says what."""


def lambda_python() -> str:
    from sam_template import find_lambda_python

    found = find_lambda_python()
    if not found:
        raise EmulatorUnavailable(
            "no Python 3.12 (the Lambda runtime's) on this machine: the emulator runs the"
            " function with it (`pyenv install 3.12`, or apt's python3.12)"
        )
    return found


def check_namespaces() -> None:
    """A private mount namespace with bind mounts: root, or unprivileged namespaces."""
    if not shutil.which("unshare"):
        raise EmulatorUnavailable("no `unshare` (util-linux): it gives /var/task and /opt")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs probe /mnt && mount --make-rprivate /"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if probe.returncode != 0:
        raise EmulatorUnavailable(
            "cannot make a private mount namespace here (`unshare -m` and mount, as root,"
            f" failed: {probe.stderr.strip()[-300:]}): it gives the function a read-only"
            " /var/task and /opt without touching the machine's"
        )


def prepare_kit(python: str, cache: Path = REPO / ".local" / "lambda-kit") -> dict[str, Path]:
    """The runtime client (tests/requirements-lambda-runtime.txt, installed by the
    runtime's Python) and the emulator binary (from the aws-sam-cli wheel named in
    tests/requirements-sam.txt), from PyPI, kept in `cache` under a name made of the pins
    and the Python, so a second run downloads nothing."""
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    key = hashlib.sha256(
        KIT_REQUIREMENTS.read_bytes() + SAM_REQUIREMENTS.read_bytes() + version.encode()
    ).hexdigest()[:16]
    kit = cache / key
    paths = {"runtime": kit / "runtime", "rie": kit / "aws-lambda-rie"}
    if (kit / "complete").exists():
        return paths
    shutil.rmtree(kit, ignore_errors=True)
    kit.mkdir(parents=True)
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    steps = [
        [
            *pip,
            "install",
            "--quiet",
            "--no-deps",
            "--no-compile",
            "--only-binary=:all:",
            "--target",
            str(paths["runtime"]),
            "--requirement",
            str(KIT_REQUIREMENTS),
        ],
        [
            *pip,
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(kit / "wheel"),
            "--requirement",
            str(SAM_REQUIREMENTS),
        ],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise EmulatorUnavailable(
                f"could not install the Lambda runtime kit ({' '.join(step[3:5])}):"
                f" {done.stderr.strip()[-1000:]}"
            )
    (wheel,) = (kit / "wheel").glob("aws_sam_cli-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        paths["rie"].write_bytes(archive.read(RIE_IN_WHEEL))
    paths["rie"].chmod(0o755)
    shutil.rmtree(kit / "wheel")
    # The runtime's Python compiles the client once, as the real image ships it compiled.
    subprocess.run(
        [python, "-m", "compileall", "-q", str(paths["runtime"])],
        capture_output=True,
        check=True,
        timeout=300,
    )
    (kit / "complete").write_text(key)
    return paths


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def lambda_environment(
    function_name: str, handler_name: str, memory_mb: int, timeout_s: int
) -> dict[str, str]:
    """The variables Lambda itself sets in a python3.12 function (the function's own, from
    the template or env.json, go on top)."""
    return {
        "PATH": "/var/lang/bin:/usr/local/bin:/usr/bin/:/bin:/opt/bin",
        "LD_LIBRARY_PATH": "/var/lang/lib:/lib64:/usr/lib64:/var/runtime:/var/runtime/lib"
        ":/var/task:/var/task/lib:/opt/lib",
        "LANG": "en_US.UTF-8",
        "TZ": ":UTC",
        "LAMBDA_TASK_ROOT": "/var/task",
        "LAMBDA_RUNTIME_DIR": "/var/runtime",
        # What the python3.12 runtime puts on sys.path after /var/task: the layer's two
        # directories, then the runtime's own packages (boto3, the runtime client).
        "PYTHONPATH": "/opt/python/lib/python3.12/site-packages:/opt/python:/var/runtime",
        "_HANDLER": handler_name,
        "AWS_EXECUTION_ENV": "AWS_Lambda_python3.12",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_LAMBDA_FUNCTION_NAME": function_name,
        "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(memory_mb),
        "AWS_LAMBDA_FUNCTION_TIMEOUT": str(timeout_s),
        "AWS_LAMBDA_LOG_GROUP_NAME": f"/aws/lambda/{function_name}",
        "AWS_LAMBDA_LOG_STREAM_NAME": "2026/01/01/[$LATEST]emulator",
        "AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand",
        # The execution role's credentials; never used unless a test points at moto.
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
    }


class CpuQuota:
    """A cgroup whose CPU quota is `share` of one CPU (None: no quota), and which counts
    the CPU time its processes use (cgroup v1's cpu and cpuacct controllers, or v2's
    cpu.max and cpu.stat); `procs` are the files a process writes its pid to, to join."""

    PERIOD_US = 100_000

    def __init__(self, share: float | None):
        quota = -1 if share is None else max(1000, round(share * self.PERIOD_US))
        name = f"lambda-emulator-{os.getpid()}-{time.monotonic_ns()}"
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        self.paths: list[Path] = []
        try:
            if (v1 / "cpu.cfs_quota_us").exists() and Path("/sys/fs/cgroup/cpuacct").is_dir():
                self.paths = [v1 / name, Path("/sys/fs/cgroup/cpuacct") / name]
                for path in self.paths:
                    path.mkdir()
                (self.paths[0] / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (self.paths[0] / "cpu.cfs_quota_us").write_text(str(quota))
                self._usage = lambda: int((self.paths[1] / "cpuacct.usage").read_text()) / 1e6
            elif "cpu" in (v2 / "cgroup.controllers").read_text().split():
                self.paths = [v2 / name]
                self.paths[0].mkdir()
                limit = "max" if quota < 0 else str(quota)
                (self.paths[0] / "cpu.max").write_text(f"{limit} {self.PERIOD_US}")
                self._usage = lambda: self._v2_usage_ms()
            else:
                raise OSError("no cgroup cpu controller is mounted")
        except OSError as error:
            self.close()
            raise EmulatorUnavailable(
                f"cannot make a cgroup with a CPU quota here ({error}): the cold-start"
                " figure at a function's CPU share needs one (root, cgroup cpu controller)"
            ) from None
        self.procs = [path / "cgroup.procs" for path in self.paths]

    def _v2_usage_ms(self) -> float:
        stat = dict(line.split() for line in (self.paths[0] / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1000

    def cpu_ms(self) -> float:
        """The CPU time the cgroup's processes have used so far, in milliseconds."""
        return self._usage()

    def close(self) -> None:
        for path in reversed(self.paths):
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # its processes are still leaving
                    time.sleep(0.1)


def check_no_route_to_aws(namespace: list[str], namespace_env: dict[str, str], python: str):
    """Run GUARD_PROBE with the function's Python in a namespace like the function's (the
    same mounts, environment and PYTHONPATH): it must say the guard refused both ways to
    AWS, and still reach a listener on 127.0.0.1."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        probe = subprocess.run(
            [*namespace, python, "-c", GUARD_PROBE, GUARD_DIR_IN, GUARD_REFUSAL, str(port)],
            env=namespace_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    if probe.returncode != 0 or probe.stdout.strip() != "guarded":
        raise AssertionError(
            "the no-route-to-aws guard is not active in the function's Python"
            f" ({GUARD_DIR / 'sitecustomize.py'}):\n{probe.stdout}{probe.stderr[-3000:]}"
        )


class Emulator:
    """One function in the emulator: `invoke(event)` answers as Lambda would; `log()` is
    what the emulator and the function printed (INIT REPORT and REPORT lines among it).
    Use as a context manager: the namespace and everything in it end at its close."""

    def __init__(
        self,
        kit: dict[str, Path],
        python: str,
        function_dir: Path,
        layer_dir: Path,
        handler_name: str,
        variables: dict[str, str],
        *,
        function_name: str = "analysis-queue-Function",
        memory_mb: int = 512,
        timeout_s: int = 60,
        cpu_quota: CpuQuota | None = None,
        log_path: Path,
        no_route_to_aws: bool = True,
    ):
        for tree in (function_dir, layer_dir, kit["runtime"]):
            if Path(tree).resolve().is_relative_to("/var"):
                raise ValueError(f"{tree} is under /var, which the namespace covers")
        self.port = free_port()
        self.log_path = log_path
        environment = {
            **lambda_environment(function_name, handler_name, memory_mb, timeout_s),
            **variables,
        }
        namespace_env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "FUNCTION_DIR": str(function_dir),
            "LAYER_DIR": str(layer_dir),
            "RUNTIME_DIR": str(kit["runtime"]),
            "CGROUP_PROCS": "",
            "GUARD_DIR": "",
            "GUARD_DIR_IN": GUARD_DIR_IN,
        }
        if no_route_to_aws:
            environment["PYTHONPATH"] = f"{GUARD_DIR_IN}:{environment['PYTHONPATH']}"
            namespace_env["GUARD_DIR"] = str(GUARD_DIR)
        namespace = [
            "unshare",
            "-m",
            "sh",
            "-c",
            NAMESPACE_SCRIPT,
            "lambda-namespace",
            *(f"{name}={value}" for name, value in environment.items()),
        ]
        if no_route_to_aws:
            check_no_route_to_aws(namespace, namespace_env, python)
        command = [
            *namespace,
            str(kit["rie"]),
            "--runtime-interface-emulator-address",
            f"127.0.0.1:{self.port}",
            "--runtime-api-address",
            f"127.0.0.1:{free_port()}",
            python,
            "-m",
            "awslambdaric",
            handler_name,
        ]
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            command,
            env={
                **namespace_env,
                "CGROUP_PROCS": " ".join(map(str, cpu_quota.procs)) if cpu_quota else "",
            },
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._wait_listening(20)
        except BaseException:
            self.close()
            raise

    def _wait_listening(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the emulator exited at start:\n{self.log()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"the emulator did not listen within {seconds} s:\n{self.log()}")

    def invoke(self, event: object, timeout: float = 90) -> object:
        """The function's answer to event (JSON), or its error as Lambda reports it."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{INVOKE_PATH}",
            data=json.dumps(event).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - loopback
            return json.loads(response.read())

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_bytes().decode(errors="replace")

    def init_reports_ms(self) -> list[float]:
        """The Init durations of the emulator's INIT REPORT lines (its on-demand init,
        then one per re-init after a failed one)."""
        return [float(ms) for ms in re.findall(r"INIT REPORT\(durationMs: ([0-9.]+)\)", self.log())]

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(10)
        self._log.close()

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build(python: str, base: Path) -> tuple[Path, Path]:
    """The function package and the layer, built by the real Makefile in `base` (fn/,
    layer/) from a copy of the checkout's sources (ALLOW_MISSING_RDS_CA=1)."""
    checkout = base / "checkout"
    checkout.mkdir(parents=True)
    for name in ("handler.py", "Makefile", "requirements.txt", "requirements.lock"):
        shutil.copy2(REPO / name, checkout / name)
    shutil.copytree(REPO / "sql", checkout / "sql")
    shutil.copytree(REPO / "web", checkout / "web")
    for target, out in (("build-ApiFunction", "fn"), ("build-DependenciesLayer", "layer")):
        done = subprocess.run(
            [
                "make",
                "--no-print-directory",
                target,
                f"ARTIFACTS_DIR={base / out}",
                f"LAMBDA_PYTHON={python}",
                "ALLOW_MISSING_RDS_CA=1",
            ],
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"make {target} failed:\n{done.stderr[-3000:]}")
    return base / "fn", base / "layer"
