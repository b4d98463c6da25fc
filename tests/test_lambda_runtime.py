"""The BUILT package (the Makefile's function package and layer) run by the real Lambda
runtime client, awslambdaric, under the Runtime Interface Emulator, with Lambda's layout
(/var/task and /opt read-only), Lambda's environment variables and Python 3.12
(tests/lambda_emulator.py): handler.api, handler.migrate and handler.report answer every
event of events/ exactly as they answer it in-process, the custom resource's reply
reaching a listener on 127.0.0.1 in both cases, and as tests/expected_answers.py says
(EVENT_RUN, which `make sam-local` checks `sam local` against too).

Each side gets a new, unmigrated database of its own and the events of EVENT_RUN in its
order. Then the route walk (tests/route_walk.py) goes through the built package: every
route of the table answers on Python 3.12, the runtime's version, without a 5xx, an
undocumented status or an error in the function's log. Where the machine lacks something
this needs (Python 3.12, mount namespaces), the test fails saying so.

All of it runs with no route to AWS (lambda_emulator's guard: any look-up of a name
other than localhost, or connection off 127.0.0.1, from the function's Python is refused
and logged). So the event run and the route walk, with events/env.json's defaults (the
shared password and the admin token in the environment, the database on 127.0.0.1, no
secret store), show that no default calls an AWS API at run time: every answer is as
expected and no function's log holds a refusal. And the guard catches a default that
would: with the shared password read from Secrets Manager and no row for it, /ping's
answer is the 503 "the server cannot read its token for this route", within the function's
timeout, its log naming the refused Secrets Manager host (botocore retries the refused
look-up with its backoff first: a few seconds, at most about 15).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import time
from urllib.parse import urlencode

import pytest
from expected_answers import EVENT_RUN, mismatches
from kit import ADMIN_TOKEN, UPLOAD_PASSWORD, configure_function, configure_service
from lambda_emulator import (
    GUARD_REFUSAL,
    KIT_REQUIREMENTS,
    SAM_REQUIREMENTS,
    Emulator,
    build,
    check_namespaces,
    lambda_python,
    prepare_kit,
)
from route_walk import APP_ID, Values, calls_for, route_table, routes_walked, status_problem

import handler
from helpers import (
    EVENTS,
    LambdaContext,
    ResponseURL,
    connect,
    env_json,
    gateway_event,
    insert_app,
    load_event,
)

pytestmark = [
    pytest.mark.usefixtures("lambda_container"),
    pytest.mark.timeout(900),
    pytest.mark.slow,
]

# Each function as template.yaml gives it: name, handler, memory, timeout.
FUNCTIONS = {
    "ApiFunction": ("handler.api", 512, 25),
    "MigrationFunction": ("handler.migrate", 512, 600),
    "ReportFunction": ("handler.report", 512, 60),
}
# What legitimately differs between two runs of the same event a moment apart: times,
# and what is random (the claim token, an analyser's or an operator's token); only these
# are replaced before comparing.
VOLATILE = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?"), "<time>"),
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<uuid>"),
    (re.compile(r"aqa_[A-Za-z0-9_-]{43}"), "<analyser token>"),
    (re.compile(r"aqo_[A-Za-z0-9_-]{43}"), "<operator token>"),
]
# ... and how long ago something happened (the in-process side runs a moment later).
VOLATILE_KEYS = {"age_minutes", "minutesSinceLastPing", "minutes_since_last_ping"}


def normalised(answer: object) -> object:
    if isinstance(answer, dict):
        return {
            key: "<age>" if key in VOLATILE_KEYS else normalised(value)
            for key, value in answer.items()
        }
    if isinstance(answer, list | tuple):
        return [normalised(value) for value in answer]
    if isinstance(answer, str):
        for pattern, placeholder in VOLATILE:
            answer = pattern.sub(placeholder, answer)
    return answer


@pytest.fixture(scope="module")
def runtime_parts(tmp_path_factory):
    """Python 3.12, a mount namespace, the built package and layer, and the runtime kit."""
    python = lambda_python()
    check_namespaces()
    function_dir, layer_dir = build(python, tmp_path_factory.mktemp("lambda-build"))
    return python, prepare_kit(python), function_dir, layer_dir


def answers(invoke, events: list[str]) -> list[tuple]:
    """(event, answer) for each of `events` in order, through `invoke`; a custom resource
    event answers a listener on 127.0.0.1, whose reply is added: (event, answer, reply)."""
    results = []
    for name in events:
        event = copy.deepcopy(load_event(name))
        if "ResponseURL" in event:
            listener = ResponseURL()
            try:
                event["ResponseURL"] = listener.url
                results.append((name, invoke(event), listener.reply()))
            finally:
                listener.close()
        else:
            results.append((name, invoke(event)))
    return results


def by_function() -> list[tuple[str, list[str]]]:
    """EVENT_RUN as (function, its events) for each run of steps of one function."""
    return [
        (function, [step.event for step in steps])
        for function, steps in itertools.groupby(EVENT_RUN, key=lambda step: step.function)
    ]


def emulated(runtime_parts, function: str, variables: dict[str, str], log_path) -> Emulator:
    """`function` of FUNCTIONS in an emulator of its own, as template.yaml gives it."""
    python, kit, function_dir, layer_dir = runtime_parts
    handler_name, memory_mb, timeout_s = FUNCTIONS[function]
    return Emulator(
        kit,
        python,
        function_dir,
        layer_dir,
        handler_name,
        variables,
        function_name=f"analysis-queue-{function}",
        memory_mb=memory_mb,
        timeout_s=timeout_s,
        log_path=log_path,
    )


def emulated_answers(runtime_parts, tmp_path, url) -> tuple[list[tuple], dict[str, str]]:
    """EVENT_RUN's answers from the built package, each function in an emulator of its own
    on `url`, one after the other; and each function's emulator log."""
    results, logs = [], {}
    for function, events in by_function():
        variables = {**env_json(function), "DATABASE_URL": url}
        with emulated(runtime_parts, function, variables, tmp_path / f"{function}.log") as emulator:
            results += answers(emulator.invoke, events)
            logs[function] = logs.get(function, "") + emulator.log()
    return results, logs


def in_process_answers(monkeypatch, url) -> list[tuple]:
    """EVENT_RUN's answers from the entry points in this process, on `url`, each function
    configured as its Lambda container would be."""
    results = []
    for function, events in by_function():
        handler_name, _, timeout_s = FUNCTIONS[function]
        entry = getattr(handler, handler_name.split(".")[1])
        configure_function(monkeypatch, function, url)
        context = LambdaContext(f"analysis-queue-{function}", timeout_s * 1000)

        def invoke(event, entry=entry, context=context):
            return entry(event, context)

        results += answers(invoke, events)
    return results


def test_every_event_file_runs_in_the_emulator():
    names = {path.name for path in EVENTS.glob("*.json")} - {"env.json"}
    assert {step.event for step in EVENT_RUN} == names


def test_every_event_answers_in_the_emulator_as_in_process_and_as_expected(
    runtime_parts, databases, tmp_path, monkeypatch
):
    urls = [databases.create(migrated=False), databases.create(migrated=False)]
    emulated, logs = emulated_answers(runtime_parts, tmp_path, urls[0])
    in_process = in_process_answers(monkeypatch, urls[1])
    for step, ours, theirs in zip(EVENT_RUN, emulated, in_process, strict=True):
        log = logs[step.function]
        assert normalised(ours) == normalised(theirs), f"{step.event}: the emulator's log:\n{log}"
        wrong = mismatches(step.expect, ours[1])
        assert not wrong, f"{step.event}: {wrong}; the emulator's log:\n{log}"
        if len(ours) == 3:  # a custom resource: the reply CloudFormation gets is the answer
            assert ours[1] == ours[2], (step.event, log)
    # And Lambda's init ran the shipped bytecode read-only: nothing could be written.
    assert "Read-only file system" not in logs["ApiFunction"]
    # With no route to AWS, nothing so much as tried: no default calls an AWS API.
    assert {function: GUARD_REFUSAL in log for function, log in logs.items()} == dict.fromkeys(
        FUNCTIONS, False
    )


# What the function's log shows of an error: Powertools' JSON lines, the runtime client's
# and Python's own.
LOGGED_ERROR = re.compile(r'"level": ?"(ERROR|CRITICAL)"|\[ERROR\]|Traceback \(most recent call')


def test_every_route_answers_on_the_runtimes_python(
    runtime_parts, databases, tmp_path, monkeypatch
):
    url = databases.create()
    configure_service(monkeypatch, url, ADMIN_WEB="full")  # the walk signs in, in process
    sql = connect(url)
    try:
        insert_app(sql, APP_ID)
        calls = calls_for(handler.app, Values(sql))
    finally:
        sql.close()
    variables = {
        **env_json("ApiFunction"),
        "DATABASE_URL": url,
        "UPLOAD_PASSWORD": UPLOAD_PASSWORD,
        "ADMIN_TOKEN": ADMIN_TOKEN,
        "ADMIN_WEB": "full",
    }
    problems = []
    with emulated(runtime_parts, "ApiFunction", variables, tmp_path / "walk.log") as emulator:
        for call in calls:
            headers = {name.lower(): value for name, value in call.headers.items()}
            query = urlencode(call.params)
            event = gateway_event(call.method, call.path, query, headers, call.body, True)
            answer = emulator.invoke(event)
            problems += status_problem(call, answer["statusCode"], str(answer.get("body")))
        log = emulator.log()
    assert routes_walked(calls) == route_table(handler.app)
    assert problems == [], log[-3000:]
    assert [line for line in log.splitlines() if LOGGED_ERROR.search(line)] == []
    assert GUARD_REFUSAL not in log


SECRETS_MANAGER = "secretsmanager.us-east-1.amazonaws.com"


def test_a_default_that_reads_a_secret_store_is_refused_a_route_to_aws(
    runtime_parts, databases, tmp_path
):
    """The guard catches a default that would reach an AWS API at run time: the API
    function with its shared password in Secrets Manager (UPLOAD_PASSWORD empty,
    UPLOAD_PASSWORD_SECRET set) and no row for it in a new database reads the secret at
    /ping; under the emulator the look-up of the Secrets Manager endpoint is refused, so
    the answer is the route's 503, within the function's timeout, and the log names the
    refused host."""
    variables = {
        **env_json("ApiFunction"),
        "DATABASE_URL": databases.create(),
        "UPLOAD_PASSWORD": "",
        "UPLOAD_PASSWORD_SECRET": "secretsmanager:queue/upload",
    }
    _, _, timeout_s = FUNCTIONS["ApiFunction"]
    with emulated(runtime_parts, "ApiFunction", variables, tmp_path / "aws.log") as emulator:
        started = time.monotonic()
        answer = emulator.invoke(load_event("ping.json"))
        took = time.monotonic() - started
        log = emulator.log()
    assert answer["statusCode"] == 503, log[-3000:]
    assert json.loads(answer["body"]) == {
        "detail": "the server cannot read its token for this route"
    }
    # The guard refused the look-up (botocore tried again, and was refused again) ...
    refused = f"{GUARD_REFUSAL} socket.getaddrinfo to {SECRETS_MANAGER}:443"
    assert refused in log, log[-3000:]
    # ... so the secret read failed for want of a connection, and the handler said so.
    (warning,) = [json.loads(line) for line in log.splitlines() if '"secret unavailable"' in line]
    assert warning["secret"] == variables["UPLOAD_PASSWORD_SECRET"]
    assert warning["error"].startswith("GetParameterError: Could not connect to the endpoint")
    assert SECRETS_MANAGER in warning["error"]
    assert took < timeout_s, f"the refused read took {took:.1f} s: {log[-3000:]}"


def dockerd_flags(text: str) -> set[str]:
    """The flags of the first `dockerd` command in `text` (continued over lines ending in
    a backslash): `--name`, or `--name=value` where the value is written so."""
    start = re.search(r"^\s*dockerd --", text, re.MULTILINE).start()
    command = re.match(r"(?:.*\\\n)*.*", text[start:]).group(0)
    return set(re.findall(r"--[a-z0-9-]+(?:=[^\s\"']+)?", command))


def test_the_sam_local_page_names_what_make_sam_local_uses():
    """docs/local-lambda.md's bridge address, image tag, requirement files, Docker daemon
    and port option are those of tools/sam_local.py, tests/lambda_emulator.py, .ci/run
    and the Makefile."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "sam_local", handler.HERE / "tools" / "sam_local.py"
    )
    sam_local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sam_local)
    page = (handler.HERE / "docs" / "local-lambda.md").read_text()
    ci = (handler.HERE / ".ci" / "run").read_text()
    makefile = (handler.HERE / "Makefile").read_text()
    for text in (page, ci):
        assert f"ip addr add {sam_local.GATEWAY}/24 dev sam0" in text
        assert "export DOCKER_HOST=" in text
        assert "make sam-local" in text
    # The daemon the page starts is the one CI starts: its own roots, pidfile and socket.
    flags = dockerd_flags(ci)
    assert {"--data-root", "--exec-root", "--pidfile", "--host", "--bridge=sam0"} <= flags
    assert dockerd_flags(page) == flags
    assert f"--add-host host.docker.internal:{sam_local.GATEWAY}" in page
    assert f"`{sam_local.GATEWAY}:5432`" in page
    assert page.count(sam_local.IMAGE) >= 4
    for path in (KIT_REQUIREMENTS, SAM_REQUIREMENTS):
        assert f"`{path.relative_to(handler.HERE)}`" in page
    recipe = "python3 tools/sam_local.py --stand-in --port $(SAM_LOCAL_PORT)"
    assert recipe in makefile and recipe in page
    assert "SAM_LOCAL_PORT ?= 0" in makefile and "make sam-local SAM_LOCAL_PORT=" in page
    assert "--port" in page and "tests/expected_answers.py" in page


def test_the_cold_start_page_states_the_template_memory():
    """docs/benchmarks.md's figures are for the MemorySize the template gives
    the API function; the migration and report functions keep 512 MB."""
    from sam_template import translate

    memory = {
        name: resource["Properties"]["MemorySize"]
        for name, resource in translate()["Resources"].items()
        if resource["Type"] == "AWS::Lambda::Function"
    }
    (api,) = [size for name, size in memory.items() if name.startswith("ApiFunction")]
    others = {size for name, size in memory.items() if not name.startswith("ApiFunction")}
    page = (handler.HERE / "docs" / "benchmarks.md").read_text()
    assert f"init_configured_memory_mb={api}" in page
    assert f"(one run, template MemorySize {api})" in page
    assert others == {512}
