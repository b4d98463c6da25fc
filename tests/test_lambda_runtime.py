"""The BUILT package (the Makefile's function package and layer) run by the real Lambda
runtime client, awslambdaric, under the Runtime Interface Emulator, with Lambda's layout
(/var/task and /opt read-only), Lambda's environment variables and Python 3.12
(tests/lambda_emulator.py): handler.api, handler.migrate and handler.report answer every
event of events/ exactly as they answer it in-process, the custom resource's reply
reaching a listener on 127.0.0.1 in both cases.

Each side gets a database of its own, in the same state, and the same events in the same
order. Where the machine lacks something this needs (Python 3.12, mount namespaces), the
test fails saying so.
"""

from __future__ import annotations

import copy
import re

import pytest
from kit import configure_function
from lambda_emulator import (
    KIT_REQUIREMENTS,
    SAM_REQUIREMENTS,
    Emulator,
    build,
    check_namespaces,
    lambda_python,
    prepare_kit,
)

import handler
from helpers import EVENTS, LambdaContext, ResponseURL, env_json, load_event

pytestmark = [pytest.mark.usefixtures("lambda_container"), pytest.mark.timeout(900)]

API_EVENTS = [
    "healthz.json",
    "ping.json",
    "healthz-analyser.json",
    "add-app.json",
    "get-app.json",
    "queue.json",
    # A failure, then a success replacing it: a failure after the claim's success would be
    # refused (docs/queue.md, "Results"), and every route should answer 2xx here.
    "report-failure.json",
    "queue-exact-app.json",
    "upload-analysis.json",
    "get-app.json",
]
MIGRATION_EVENTS = ["cfn-create.json", "cfn-update.json", "cfn-delete.json"]
REPORT_EVENTS = ["schedule.json"]
# Each function as template.yaml gives it: name, handler, memory, timeout.
FUNCTIONS = {
    "ApiFunction": ("handler.api", 512, 25),
    "MigrationFunction": ("handler.migrate", 512, 600),
    "ReportFunction": ("handler.report", 512, 60),
}
# What legitimately differs between two runs of the same event a moment apart: times,
# and what is random (the claim token); only these are replaced before comparing.
VOLATILE = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?"), "<time>"),
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<uuid>"),
]
# ... and how long ago something happened (the in-process side runs a moment later).
VOLATILE_KEYS = {"age_minutes"}


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


def run_both(runtime_parts, tmp_path, monkeypatch, function, events, urls, arrange=None):
    """(emulator's answers, in-process answers) to `events` in order, each side on its
    own database (urls: emulator's, in-process's); custom resource events answer a
    listener on 127.0.0.1, whose reply is part of the answer."""
    python, kit, function_dir, layer_dir = runtime_parts
    handler_name, memory_mb, timeout_s = FUNCTIONS[function]
    entry = getattr(handler, handler_name.split(".")[1])

    def answers(invoke, url) -> list:
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

    variables = {**env_json(function), "DATABASE_URL": urls[0]}
    with Emulator(
        kit,
        python,
        function_dir,
        layer_dir,
        handler_name,
        variables,
        function_name=f"analysis-queue-{function}",
        memory_mb=memory_mb,
        timeout_s=timeout_s,
        log_path=tmp_path / f"{function}.log",
    ) as emulator:
        emulated = answers(emulator.invoke, urls[0])
        log = emulator.log()
    configure_function(monkeypatch, function, urls[1])
    context = LambdaContext(f"analysis-queue-{function}", timeout_s * 1000)
    in_process = answers(lambda event: entry(event, context), urls[1])
    return emulated, in_process, log


def assert_same(emulated, in_process, log) -> None:
    for ours, theirs in zip(emulated, in_process, strict=True):
        assert normalised(ours) == normalised(theirs), f"{ours[0]}: the emulator's log:\n{log}"


def test_every_event_file_runs_in_the_emulator():
    names = {path.name for path in EVENTS.glob("*.json")} - {"env.json"}
    assert set(API_EVENTS) | set(MIGRATION_EVENTS) | set(REPORT_EVENTS) == names


def test_the_api_function_answers_every_api_event_as_in_process(
    runtime_parts, databases, tmp_path, monkeypatch
):
    urls = [databases.create(), databases.create()]
    emulated, in_process, log = run_both(
        runtime_parts, tmp_path, monkeypatch, "ApiFunction", API_EVENTS, urls
    )
    assert_same(emulated, in_process, log)
    # The events did what they are for (a queue that handed out the app, a result kept).
    statuses = [answer["statusCode"] for _, answer in emulated]
    assert statuses == [200, 200, 200, 201, 200, 200, 200, 200, 200, 200], log
    assert emulated[5][1]["body"] == "com.example.app"
    # And Lambda's init ran the shipped bytecode read-only: nothing could be written.
    assert "Read-only file system" not in log


def test_the_migration_function_answers_every_custom_resource_event_as_in_process(
    runtime_parts, databases, tmp_path, monkeypatch
):
    urls = [databases.create(migrated=False), databases.create(migrated=False)]
    emulated, in_process, log = run_both(
        runtime_parts, tmp_path, monkeypatch, "MigrationFunction", MIGRATION_EVENTS, urls
    )
    assert_same(emulated, in_process, log)
    for name, answer, reply in emulated:
        assert answer == reply and reply["Status"] == "SUCCESS", (name, log)
    assert emulated[0][2]["Data"]["Applied"] != "none"


def test_the_report_function_answers_the_schedule_as_in_process(
    runtime_parts, databases, tmp_path, monkeypatch
):
    urls = [databases.create(), databases.create()]
    for url in urls:  # the same queue on both sides: an app added, one claimed
        configure_function(monkeypatch, "ApiFunction", url)
        for name in ("add-app.json", "queue.json"):
            handler.api(load_event(name), LambdaContext("analysis-queue-ApiFunction"))
        handler.use_runtime(None)
    emulated, in_process, log = run_both(
        runtime_parts, tmp_path, monkeypatch, "ReportFunction", REPORT_EVENTS, urls
    )
    assert_same(emulated, in_process, log)
    (_, status) = emulated[0]
    assert status["total"] == 1 and status["counts"]["processing"] == 1, log


def test_the_sam_local_page_names_what_make_sam_local_uses():
    """docs/local-lambda.md's bridge address, image tag and requirement files are those of
    tools/sam_local.py and tests/lambda_emulator.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "sam_local", handler.HERE / "tools" / "sam_local.py"
    )
    sam_local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sam_local)
    page = (handler.HERE / "docs" / "local-lambda.md").read_text()
    assert f"ip addr add {sam_local.GATEWAY}/24 dev sam0" in page
    assert f"--add-host host.docker.internal:{sam_local.GATEWAY}" in page
    assert f"`{sam_local.GATEWAY}:5432`" in page
    assert page.count(sam_local.IMAGE) >= 4
    for path in (KIT_REQUIREMENTS, SAM_REQUIREMENTS):
        assert f"`{path.relative_to(handler.HERE)}`" in page
    assert "python3 tools/sam_local.py --stand-in" in (handler.HERE / "Makefile").read_text()


def test_the_cold_start_page_states_the_template_memory():
    """docs/benchmarks-cold-start.md's figures are for the MemorySize the template gives
    the API function; the migration and report functions keep 512 MB."""
    from test_template import translate

    memory = {
        name: resource["Properties"]["MemorySize"]
        for name, resource in translate()["Resources"].items()
        if resource["Type"] == "AWS::Lambda::Function"
    }
    (api,) = [size for name, size in memory.items() if name.startswith("ApiFunction")]
    others = {size for name, size in memory.items() if not name.startswith("ApiFunction")}
    page = (handler.HERE / "docs" / "benchmarks-cold-start.md").read_text()
    assert f"init_configured_memory_mb={api}" in page
    assert f"(one run, template MemorySize {api})" in page
    assert others == {512}
