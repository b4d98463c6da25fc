"""`sam local` as a user runs it, on this machine, checking answers (docs/local-lambda.md).

    python3 tools/sam_local.py [--stand-in] [--port N]   (make sam-local: --stand-in)

1. Docker must answer (`docker info`, at DOCKER_HOST when that is set); the SAM CLI
   (tests/requirements-sam.txt) is installed in .local/sam-venv from PyPI when it is not
   there.
2. The image `sam local` runs, public.ecr.aws/lambda/python:3.12-x86_64: used as it is when
   Docker has it (pulled, or `docker load`ed). With --stand-in, when Docker has none, a TEST
   STAND-IN is built under that tag from local parts only (no registry): this machine's
   Python 3.12, awslambdaric and boto3 (tests/requirements-lambda-runtime.txt) at
   /var/runtime, the C libraries Python and pydantic-core link against, and busybox for the
   shell `sam local` runs in its image build. It is labelled as a stand-in; it is not
   Amazon Linux 2023, and its answers only show that the package runs under `sam local`.
3. Docker's default bridge at 172.30.241.1 (dockerd --bridge=sam0, docs/local-lambda.md),
   so the containers reach this machine at that address, and the database there: the embedded
   PostgreSQL of `python3 handler.py serve` listens on a Unix socket only, so this script
   starts a new one (in a temporary directory, not migrated: cfn-create.json does that)
   and forwards gateway:5432 to its socket.
   `--add-host host.docker.internal:<gateway>` makes events/env.json's DATABASE_URL point
   there (a host named host.docker.internal is local: no TLS; any other host at a bridge
   address would fall to DB_SSLMODE=verify-full).
4. `sam build` (ALLOW_MISSING_RDS_CA=1), then `sam local invoke` on every event of
   tests/expected_answers.py's EVENT_RUN, in its order, each answer checked against it
   (sam exits 0 even when the function fails to start); the custom resource events'
   ResponseURL points at a listener on the gateway (127.0.0.1 would be the container
   itself), whose reply must be the answer.
5. `sam local start-api` on 127.0.0.1 (--port; a free port by default) and the README's
   curl walkthrough run as written against it, on a second, new database (migrated
   here), each command printing what the README shows.
6. The secrets option, on a third new database: moto's server on the gateway (the
   containers reach it as host.docker.internal) holds events/env.json's UPLOAD_PASSWORD in
   Secrets Manager and its ADMIN_TOKEN in SSM Parameter Store; ApiFunction and
   ReportFunction get UPLOAD_PASSWORD="" and ADMIN_TOKEN="", the *_SECRET references and
   AWS_ENDPOINT_URL; the events that need a token (SECRETS_EVENTS) must answer as in
   EVENT_RUN, and moto's request log must show each secret read. `sam local` passes a
   function only the variables its template declares (--container-env-vars applies only
   with --debug-port), so this pass runs a copy of the built template that declares them.

The expected answers are the suite's (tests/expected_answers.py, the README): this script
keeps none of its own. Every step is bounded in time; traffic goes only to this machine
(loopback, and the containers on the bridge this machine made); the SAM CLI's telemetry
is turned off. Checks every answer, names each wrong one, and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import atexit
import http.server
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

IMAGE = "public.ecr.aws/lambda/python:3.12-x86_64"
# Docker's default bridge (dockerd --bridge=sam0): this machine's address on it.
GATEWAY = "172.30.241.1"
# This process's own log lines (the walkthrough database's migration) only when they warn.
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
LOCAL = REPO / ".local"
SAM = LOCAL / "sam-venv" / "bin" / "sam"
BUILD_DIR = LOCAL / "sam-build"
# No telemetry: the SAM CLI would otherwise send some to AWS.
SAM_ENV = {**os.environ, "SAM_CLI_TELEMETRY": "0"}
# Each sam local invoke starts a container and builds the layer's image (about 3 s).
INVOKE_TIMEOUT = 240


class Failed(Exception):
    pass


def run(args: list[str], timeout: float = 600, check: bool = True, **kwargs):
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs
    )
    if check and done.returncode != 0:
        raise Failed(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def step(text: str) -> None:
    print(f"--- {text}", flush=True)


# --- 1. Docker and the SAM CLI ----------------------------------------------------------


def check_docker() -> None:
    if not shutil.which("docker"):
        raise Failed("no docker client: `apt-get install docker.io` (docs/local-lambda.md)")
    done = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30, check=False)
    if done.returncode != 0:
        raise Failed(
            "Docker does not answer (is dockerd running? docs/local-lambda.md says how to"
            f" start it here):\n{done.stderr.strip()[-1000:]}"
        )
    print(f"docker server {done.stdout.strip()}")


def ensure_sam() -> None:
    if not SAM.exists():
        step("installing the SAM CLI in .local/sam-venv (tests/requirements-sam.txt)")
        run([sys.executable, "-m", "venv", LOCAL / "sam-venv"])
        pip = [LOCAL / "sam-venv" / "bin" / "pip", "install", "-q"]
        run([*pip, "-r", REPO / "tests" / "requirements-sam.txt"], timeout=900)
    print(run([SAM, "--version"], env=SAM_ENV).stdout.strip())


def sam_validate() -> str:
    """`sam validate --lint` of template.yaml (SAM's transform and cfn-lint's rules): a
    Failed when it finds anything. A region is needed to name the service endpoints it
    checks against; it asks AWS nothing."""
    env = {**SAM_ENV, "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    done = run(
        [SAM, "validate", "--lint", "--template-file", REPO / "template.yaml"],
        env=env,
        check=False,
        timeout=300,
    )
    if done.returncode != 0:
        raise Failed(f"sam validate --lint: {(done.stdout + done.stderr).strip()[-2000:]}")
    return done.stdout.strip()


# --- 2. the image -----------------------------------------------------------------------


def has_image() -> bool:
    return run(["docker", "image", "inspect", IMAGE], check=False).returncode == 0


def libraries_of(paths: list[Path]) -> set[Path]:
    """The shared libraries `paths` load (ldd), with the dynamic loader."""
    found = {Path("/lib64/ld-linux-x86-64.so.2")}
    for path in paths:
        for line in run(["ldd", path], check=False).stdout.splitlines():
            if "=>" in line and "/" in line.split("=>")[1]:
                found.add(Path(line.split("=>")[1].split("(")[0].strip()))
    return found


def build_stand_in() -> None:
    """The TEST STAND-IN for the Lambda python3.12 image, from local parts only."""
    from lambda_emulator import lambda_python, prepare_kit

    python = Path(lambda_python()).resolve()
    prefix = python.parent.parent
    kit = prepare_kit(str(python))
    busybox = shutil.which("busybox")
    if not busybox or "statically linked" not in run(["file", busybox], check=False).stdout:
        raise Failed("the stand-in needs a static busybox: `apt-get install busybox-static`")
    context = Path(tempfile.mkdtemp(prefix="lambda-stand-in-"))
    try:
        root = context / "rootfs"
        ignore = shutil.ignore_patterns("test", "tests", "idlelib", "tkinter", "turtledemo")
        shutil.copytree(prefix / "bin", root / "var/lang/bin", symlinks=True)
        shutil.copytree(prefix / "lib", root / "var/lang/lib", symlinks=True, ignore=ignore)
        shutil.copytree(kit["runtime"], root / "var/runtime")
        (root / "usr" / "local" / "bin").mkdir(parents=True)
        shutil.copy2(kit["rie"], root / "usr" / "local" / "bin" / "aws-lambda-rie")
        # C libraries: Python's, its extension modules', the runtime client's, and what the
        # layer's binary wheels (pydantic-core) link against.
        shared = [python, *(prefix / "lib").glob("libpython3*.so*")]
        shared += (prefix / "lib" / "python3.12" / "lib-dynload").glob("*.so")
        shared += kit["runtime"].glob("*.so")
        wanted = libraries_of(shared)
        for name in ("libgcc_s.so.1", "librt.so.1", "libpthread.so.0", "libdl.so.2"):
            wanted.add(Path("/lib/x86_64-linux-gnu") / name)
        for library in sorted(wanted):
            if library.is_relative_to(prefix):
                continue
            target = root / library.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(library.resolve(), target)
        (root / "bin").mkdir()
        shutil.copy2(busybox, root / "bin" / "busybox")
        for tool in ("sh", "mv", "chmod", "cp", "rm", "mkdir", "ls", "cat", "env"):
            (root / "bin" / tool).symlink_to("busybox")
        (root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
        for directory in ("tmp", "var/task", "opt", "etc"):
            (root / directory).mkdir(parents=True, exist_ok=True)
        (root / "tmp").chmod(0o1777)
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (root / "etc" / "localtime").symlink_to("/dev/null")
        # What the real image's /var/runtime/bootstrap does: the runtime client, on the
        # handler Lambda names, with the layer's directories on the path.
        bootstrap = root / "var" / "runtime" / "bootstrap"
        bootstrap.write_text(
            "#!/bin/sh\n"
            "export PYTHONPATH=/opt/python/lib/python3.12/site-packages:/opt/python:/var/runtime\n"
            'exec /var/lang/bin/python3.12 -m awslambdaric "$_HANDLER"\n'
        )
        bootstrap.chmod(0o755)
        entry = root / "lambda-entrypoint.sh"
        entry.write_text(
            "#!/bin/sh\n"
            'export _HANDLER="$1"\n'
            'if [ -z "${AWS_LAMBDA_RUNTIME_API:-}" ]; then\n'
            '  exec /usr/local/bin/aws-lambda-rie /var/runtime/bootstrap "$@"\n'
            "fi\n"
            "exec /var/runtime/bootstrap\n"
        )
        entry.chmod(0o755)
        (context / "Dockerfile").write_text(
            "FROM scratch\n"
            "COPY rootfs/ /\n"
            'LABEL org.opencontainers.image.description="TEST STAND-IN for the Lambda'
            " python3.12 image, built by tools/sam_local.py from local parts (this"
            " machine's Python 3.12, awslambdaric); not Amazon Linux 2023\"\n"
            "ENV LANG=en_US.UTF-8 TZ=:/etc/localtime"
            " PATH=/var/lang/bin:/usr/local/bin:/usr/bin/:/bin:/opt/bin"
            " LD_LIBRARY_PATH=/var/lang/lib:/lib64:/usr/lib64:/var/runtime:/var/runtime/lib"
            ":/var/task:/var/task/lib:/opt/lib"
            " LAMBDA_TASK_ROOT=/var/task LAMBDA_RUNTIME_DIR=/var/runtime\n"
            "WORKDIR /var/task\n"
            'ENTRYPOINT ["/lambda-entrypoint.sh"]\n'
        )
        run(
            ["docker", "build", "--network", "none", "-t", IMAGE, context],
            timeout=900,
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )
    finally:
        shutil.rmtree(context, ignore_errors=True)


# --- 3. the network and the database ----------------------------------------------------


def check_bridge() -> None:
    """Docker's default bridge must be up, at GATEWAY: dockerd started with a bridge of
    its own (docs/local-lambda.md). `sam local` creates its containers there; a network
    given with --docker-network is only connected after the container starts, and
    dockerd 20.10 without iptables then forwards the published port nowhere."""
    found = run(
        ["docker", "network", "inspect", "bridge", "-f", "{{(index .IPAM.Config 0).Gateway}}"],
        check=False,
    )
    if found.returncode != 0 or found.stdout.strip() != GATEWAY:
        raise Failed(
            f"Docker's default bridge is not at {GATEWAY} ({found.stdout.strip() or found.stderr}):"
            " start dockerd with --bridge=sam0 on a bridge sam0 at"
            f" {GATEWAY}/24 (docs/local-lambda.md)"
        )


class SocketForward:
    """TCP on (host, port) forwarded to a Unix socket: the embedded PostgreSQL, which
    listens on its socket only, reachable from the containers at the bridge's gateway."""

    def __init__(self, host: str, port: int, unix_path: str):
        self.unix_path = unix_path
        self.server = socket.create_server((host, port), reuse_port=False)
        self.server.settimeout(0.5)
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.unix_path)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.server.close()


def start_database() -> tuple[object, SocketForward, str]:
    import handler

    # A new database each run (known answers), outside the checkout (sam build copies it).
    data = Path(tempfile.mkdtemp(prefix="sam-local-pg-")) / "pgdata"
    atexit.register(shutil.rmtree, data.parent, ignore_errors=True)
    server = handler.embedded_postgres_server(data)
    url = server.get_uri()  # not migrated: the custom resource's Create does that
    arguments = handler.connection_arguments(handler.load_settings({"DATABASE_URL": url}))
    forward = SocketForward(GATEWAY, 5432, arguments["unix_sock"])
    return server, forward, url


class ReplyListener:
    """CloudFormation's ResponseURL, on the gateway (reachable from the container)."""

    def __init__(self):
        self.replies: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.replies.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.HTTPServer((GATEWAY, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{GATEWAY}:{self.server.server_address[1]}/cfn-response"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- 4. sam build and sam local invoke ----------------------------------------------------

SAM_LOCAL = ["--skip-pull-image", "--add-host", f"host.docker.internal:{GATEWAY}"]
ENV_VARS = REPO / "events" / "env.json"


def sam_build(python: str) -> None:
    """sam build in a scratch copy of the sources it builds from (it copies its whole
    source directory, and .local holds virtualenvs and sockets)."""
    source = Path(tempfile.mkdtemp(prefix="sam-local-src-"))
    try:
        for name in ("handler.py", "Makefile", "requirements.txt", "requirements.lock"):
            shutil.copy2(REPO / name, source / name)
        shutil.copy2(REPO / "template.yaml", source / "template.yaml")
        shutil.copytree(REPO / "sql", source / "sql")
        shutil.copytree(REPO / "web", source / "web")
        env = {**SAM_ENV, "ALLOW_MISSING_RDS_CA": "1", "LAMBDA_PYTHON": python}
        run(
            [SAM, "build", "--template-file", source / "template.yaml", "--build-dir", BUILD_DIR],
            cwd=source,
            env=env,
            timeout=900,
        )
    finally:
        shutil.rmtree(source, ignore_errors=True)


def sam_invoke(step, template: Path, env_vars: Path = ENV_VARS) -> list[str]:
    """`sam local invoke` on one step of EVENT_RUN: what is wrong with its answer (none:
    it is as expected)."""
    from expected_answers import mismatches

    event = json.loads((REPO / "events" / step.event).read_text())
    listener = ReplyListener() if "ResponseURL" in event else None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        if listener:
            event["ResponseURL"] = listener.url
        json.dump(event, file)
    try:
        started = time.monotonic()
        command = [SAM, "local", "invoke", step.function, "-t", template, "-e", file.name]
        done = run(
            [*command, *SAM_LOCAL, "--env-vars", env_vars],
            timeout=INVOKE_TIMEOUT,
            check=False,
            env=SAM_ENV,
        )
        seconds = time.monotonic() - started
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        try:
            answer = json.loads(lines[-1])
        except (IndexError, ValueError):
            answer = None
        wrong = [] if done.returncode == 0 else [f"sam exited {done.returncode}"]
        if isinstance(answer, dict) and "errorType" in answer:
            wrong.append(f"the function failed: {json.dumps(answer)[:1000]}")
        else:
            wrong += mismatches(step.expect, answer)
        if listener and listener.replies != [answer]:
            wrong.append(f"the reply to the ResponseURL {listener.replies} is not the answer")
        shown = json.dumps(answer)
        print(
            f"{'ok ' if not wrong else 'BAD'} {step.function:18} {step.event:24} {seconds:5.1f} s"
            f"  {shown[:110]}",
            flush=True,
        )
        if wrong:
            print("    " + "\n    ".join(wrong) + f"\n    sam's log:\n{done.stderr[-3000:]}")
        return [f"{step.event}: {problem}" for problem in wrong]
    finally:
        os.unlink(file.name)
        if listener:
            listener.close()


# --- 5. sam local start-api and the README's walkthrough ------------------------------------


def new_database(url: str, name: str) -> dict:
    """A new database `name` on the server of `url`, migrated (the README's walkthrough is
    a new checkout's), and events/env.json's variables with every function on it."""
    from helpers import connect, migrate, with_database

    connection = connect(url)
    try:
        connection.run(f"CREATE DATABASE {name}")
    finally:
        connection.close()
    migrate(with_database(url, name))
    variables = json.loads(ENV_VARS.read_text())
    for function in variables.values():
        function["DATABASE_URL"] = with_database(function["DATABASE_URL"], name)
    return variables


def scratch_file(name: str, text: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="sam-local-env-")) / name
    atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
    path.write_text(text)
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_api(template: Path, port: int, env_vars: Path) -> list[str]:
    """`sam local start-api` on 127.0.0.1:port, and the README's walkthrough against it:
    what it printed other than the README shows (none: as shown)."""
    from expected_answers import comparable, run_readme_walkthrough

    log = (LOCAL / "sam-start-api.log").open("w")
    command = [SAM, "local", "start-api", "-t", template, "--host", "127.0.0.1"]
    process = subprocess.Popen(
        [*command, "--port", str(port), *SAM_LOCAL, "--env-vars", env_vars],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=SAM_ENV,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise Failed(f"sam local start-api did not listen: see {log.name}") from None
                time.sleep(0.5)
        with tempfile.TemporaryDirectory(prefix="sam-local-walkthrough-") as cwd:
            try:
                ran = run_readme_walkthrough(port, Path(cwd), timeout=600)
            except AssertionError as error:
                raise Failed(f"the README's walkthrough under start-api: {error}") from None
        wrong = []
        for command, shown, printed in ran:
            first = command.splitlines()[0]
            right = comparable(printed) == comparable(shown)
            print(
                f"{'ok ' if right else 'BAD'} start-api $ {first[:70]:70}  {' '.join(printed)[:60]}"
            )
            if not right:
                wrong.append(f"start-api $ {command}\n  printed {printed}\n  README  {shown}")
        if wrong:
            print(f"    sam local start-api's log: {log.name}")
        return wrong
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
        log.close()


# --- 6. the secrets option ---------------------------------------------------------------

# Where the secrets option reads events/env.json's tokens from (handler.py, fetch_secret).
SECRET_REFERENCES = {
    "UPLOAD_PASSWORD": "secretsmanager:analysis-queue/upload-password",
    "ADMIN_TOKEN": "ssm:/analysis-queue/admin-token",
}
# The events that need a token, answering on a new database as in EVENT_RUN's order.
SECRETS_EVENTS = ("ping.json", "add-app.json", "queue.json", "analysers-add.json")
# The request each store's read is (moto's request log names it by X-Amz-Target).
READS = {"secretsmanager": "secretsmanager.GetSecretValue", "ssm": "AmazonSSM.GetParameter"}
# The AWS side of the functions' environment: moto takes any credentials; no instance
# metadata is asked for.
MOTO_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def start_secret_stores(values: dict[str, str]):
    """moto's server on the gateway, a free port, holding `values` at SECRET_REFERENCES;
    its request log (moto's recorder) started after they are written."""
    log = Path(tempfile.mkdtemp(prefix="sam-local-moto-")) / "requests.jsonl"
    atexit.register(shutil.rmtree, log.parent, ignore_errors=True)
    os.environ["MOTO_RECORDER_FILEPATH"] = str(log)  # read when moto is imported
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    import boto3
    from moto.moto_api import recorder
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=GATEWAY, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    aws = boto3.Session(
        aws_access_key_id=MOTO_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=MOTO_AWS["AWS_SECRET_ACCESS_KEY"],
        region_name=MOTO_AWS["AWS_REGION"],
    )
    for variable, reference in SECRET_REFERENCES.items():
        store, _, name = reference.partition(":")
        client = aws.client(store, endpoint_url=f"http://{host}:{port}")
        if store == "ssm":
            client.put_parameter(Name=name, Value=values[variable], Type="SecureString")
        else:
            client.create_secret(Name=name, SecretString=values[variable])
    recorder.reset_recording()
    recorder.start_recording()
    return server


def secret_reads() -> list[str]:
    """What moto's request log shows the functions asked for (X-Amz-Target), in order."""
    from moto.moto_api import recorder

    requests = [json.loads(line) for line in recorder.download_recording().splitlines()]
    return [request["headers"].get("X-Amz-Target", "") for request in requests]


def declaring(template: Path, variables: dict[str, dict]) -> Path:
    """A copy of the built template, beside it (its paths are relative), in which each
    function of `variables` declares every variable given there: `sam local` passes a
    function only the variables its template declares."""
    import yaml

    data = yaml.safe_load(template.read_text())
    for function, values in variables.items():
        properties = data["Resources"][function]["Properties"]
        declared = properties.setdefault("Environment", {}).setdefault("Variables", {})
        declared.update({name: declared.get(name, "") for name in values})
    copy = template.with_name("template-secrets-option.yaml")
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


def secrets_option(url: str, template: Path) -> list[str]:
    """The secrets option through `sam local invoke`, on a new database: the events of
    SECRETS_EVENTS answer as in EVENT_RUN, and moto served a read of each secret."""
    from expected_answers import EVENT_RUN

    variables = new_database(url, "secrets")
    plain = variables["ApiFunction"]
    server = start_secret_stores({name: plain[name] for name in SECRET_REFERENCES})
    try:
        _, port = server.get_host_and_port()
        for function in ("ApiFunction", "ReportFunction"):
            variables[function].update(
                {name: "" for name in SECRET_REFERENCES}
                | {f"{name}_SECRET": ref for name, ref in SECRET_REFERENCES.items()}
                | {"AWS_ENDPOINT_URL": f"http://host.docker.internal:{port}", **MOTO_AWS}
            )
        env_vars = scratch_file("env.json", json.dumps(variables))
        functions = {f: variables[f] for f in ("ApiFunction", "ReportFunction")}
        secrets_template = declaring(template, functions)
        wrong = []
        for event in SECRETS_EVENTS:
            first = next(s for s in EVENT_RUN if s.event == event)
            wrong += sam_invoke(first, secrets_template, env_vars)
        reads = secret_reads()
        for reference in SECRET_REFERENCES.values():
            store = reference.partition(":")[0]
            count = reads.count(READS[store])
            print(f"{'ok ' if count else 'BAD'} moto served {count} read(s) of {reference}")
            if not count:
                wrong.append(f"the secrets option: no function read {reference} ({reads})")
        return wrong
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help=f"build a TEST STAND-IN tagged {IMAGE} when Docker has no such image",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="sam local start-api's port on 127.0.0.1 (default 0: a free one)",
    )
    args = parser.parse_args()
    started = time.monotonic()
    wrong: list[str] = []
    try:
        from expected_answers import EVENT_RUN
        from lambda_emulator import lambda_python

        step("docker and the SAM CLI")
        check_docker()
        ensure_sam()
        # docs/monitoring.md's third check of the template, run here where the SAM CLI is.
        step("sam validate --lint")
        print(sam_validate())
        step(f"the image {IMAGE}")
        if has_image():
            print("present (pulled, loaded or built before): used as it is")
        elif args.stand_in:
            build_stand_in()
            print("built the TEST STAND-IN from local parts")
        else:
            raise Failed(
                f"Docker has no {IMAGE}: `docker pull {IMAGE}`, or `docker load` it"
                " (docs/local-lambda.md), or --stand-in to build the test stand-in"
            )
        step(f"Docker's bridge and the database at {GATEWAY}:5432")
        check_bridge()
        server, forward, url = start_database()
        print(f"embedded PostgreSQL {url} forwarded from {GATEWAY}:5432")
        try:
            step("sam build")
            sam_build(lambda_python())
            template = BUILD_DIR / "template.yaml"
            step("sam local invoke, every event of tests/expected_answers.py's EVENT_RUN")
            for event_step in EVENT_RUN:
                wrong += sam_invoke(event_step, template)
            port = args.port or free_port()
            step(f"sam local start-api on 127.0.0.1:{port} and the README's walkthrough")
            walkthrough = scratch_file("env.json", json.dumps(new_database(url, "walkthrough")))
            wrong += start_api(template, port, walkthrough)
            step("the secrets option: the tokens from Secrets Manager and SSM, moto on the gateway")
            wrong += secrets_option(url, template)
        finally:
            forward.close()
            server.cleanup()
    except (Failed, subprocess.TimeoutExpired) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    seconds = time.monotonic() - started
    if wrong:
        print(f"FAILED: {len(wrong)} answer(s) not as expected ({seconds:.0f} s):", file=sys.stderr)
        for problem in wrong:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"sam local: every answer as expected ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
