"""Offline checks of the SAM deployment: template.yaml, Makefile, events/.

* cfn-lint (with the SAM transform) passes on template.yaml.
* The transformed template has the structure the service relies on (routes,
  timeouts, concurrency, schedule, alarms, outputs, migration ordering).
* MigrationResource's properties change exactly when handler.py or sql/ change:
  the Makefile's function package (what `sam build` produces) is hashed the way
  `sam deploy` names its S3 object, and that S3 location is fed through the SAM
  translator to get MigrationResource's FunctionVersion.
* events/*.json are valid sam local events and env.json only sets variables the
  template declares (sam local ignores any others).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import parse_qsl

import pytest
from cfnlint.api import ManualArgs, lint, lint_file

import handler
from helpers import env_json, load_event
from sam_template import (
    ANALYSER_ROUTES,
    FUNCTIONS,
    LAMBDA_PYTHON,
    MAKEFILE,
    REPO,
    REQUIRED_PARAMETERS,
    TEMPLATE,
    deployed,
    load_template,
    make,
    resources_of_type,
    sam_dir_checksum,
    translate,
)

# Uses no PostgreSQL (conftest.py holds it to that): CI's second pass leaves it out.
pytestmark = pytest.mark.no_database

EVENTS = REPO / "events"

RUNTIME = "python3.12"
ROUTES = {
    ("GET", "/ping"),
    ("GET", "/queue"),
    ("POST", "/uploadAnalysis"),
    ("POST", "/reportAnalysisFailure"),
    ("POST", "/apps"),
    ("GET", "/apps/{appId}"),
    ("GET", "/healthz"),
    ("GET", "/healthz/analyser"),
    ("POST", "/analysers"),
    ("GET", "/analysers"),
    ("DELETE", "/analysers/{name}"),
    ("POST", "/analysers/{name}/rotate"),
}
API_EVENTS = {
    "ping.json": "GET /ping",
    "queue.json": "GET /queue",
    "queue-exact-app.json": "GET /queue",
    "upload-analysis.json": "POST /uploadAnalysis",
    "report-failure.json": "POST /reportAnalysisFailure",
    "add-app.json": "POST /apps",
    "get-app.json": "GET /apps/{appId}",
    "healthz.json": "GET /healthz",
    "healthz-analyser.json": "GET /healthz/analyser",
}
CFN_EVENTS = {
    "cfn-create.json": "Create",
    "cfn-update.json": "Update",
    "cfn-delete.json": "Delete",
}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def transformed() -> dict:
    return translate()


@pytest.fixture(scope="module")
def source_template() -> dict:
    return load_template()


@pytest.fixture
def source_copy(tmp_path: Path) -> Path:
    """A scratch copy of the repository, as `sam build` makes one. handler.py and sql/
    are copied when they exist; stand-ins are written where they do not (yet)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in (
        "handler.py",
        "README.md",
        "requirements.txt",
        "requirements.lock",
        "template.yaml",
        "Makefile",
    ):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    for name in ("sql", "web", "events", "docs"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    if not (src / "handler.py").exists():
        (src / "handler.py").write_text("def api(event, context):\n    return {}\n")
    sql = src / "sql"
    sql.mkdir(exist_ok=True)
    if not list(sql.glob("*.sql")):
        (sql / "000_apps.sql").write_text(
            "CREATE TABLE IF NOT EXISTS apps (appid text PRIMARY KEY);\n"
        )
        (sql / "001_app_analyses.sql").write_text("SELECT 1;\n")
    (src / "README.md").touch()
    (src / "requirements.txt").touch()
    (src / "tests").mkdir(exist_ok=True)
    (src / "tests" / "test_something.py").write_text("def test_x():\n    pass\n")
    return src


def build_function_hash(src: Path, out: Path, target: str = "build-MigrationFunction") -> str:
    result = make(target, src, out)
    assert result.returncode == 0, result.stderr
    return sam_dir_checksum(out)


# --------------------------------------------------------------------------- cfn-lint


def test_cfn_lint_passes_with_sam_transform():
    matches = lint_file(
        TEMPLATE, config=ManualArgs(regions=["us-east-1", "eu-west-1"], include_checks=["I"])
    )
    assert [str(m) for m in matches] == []


def test_cfn_lint_reports_a_broken_template():
    """The lint check above can fail: a dangling Ref and an unknown runtime are reported."""
    text = TEMPLATE.read_text()
    broken = text.replace("!Ref ApiReservedConcurrency", "!Ref NoSuchParameter").replace(
        f"Runtime: {RUNTIME}", "Runtime: python2.1"
    )
    assert broken != text
    rules = {m.rule.id for m in lint(broken, regions=["us-east-1"])}
    assert any(rule.startswith("E") for rule in rules), rules


# --------------------------------------------------------------------------- structure


def test_functions_handlers_runtime_and_build(source_template, transformed):
    lambdas = resources_of_type(transformed, "AWS::Lambda::Function")
    assert set(lambdas) == set(FUNCTIONS)
    for name, entry in FUNCTIONS.items():
        props = lambdas[name]["Properties"]
        assert props["Handler"] == entry
        assert props["Runtime"] == RUNTIME
        assert props["VpcConfig"] == {
            "SubnetIds": {"Ref": "SubnetIds"},
            "SecurityGroupIds": {"Ref": "SecurityGroupIds"},
        }
        assert source_template["Resources"][name]["Metadata"]["BuildMethod"] == "makefile"
    (layer,) = resources_of_type(transformed, "AWS::Lambda::LayerVersion").values()
    assert layer["Properties"]["CompatibleRuntimes"] == [RUNTIME]
    assert (
        source_template["Resources"]["DependenciesLayer"]["Metadata"]["BuildMethod"] == "makefile"
    )
    makefile = MAKEFILE.read_text()
    assert re.search(
        r"^LAMBDA_PYTHON_VERSION \?= " + re.escape(RUNTIME.removeprefix("python")) + "$",
        makefile,
        re.M,
    )
    for target in [*FUNCTIONS, "DependenciesLayer"]:
        assert re.search(rf"^(\S+ )*build-{target}( \S+)*:", makefile, re.M), target


def test_api_function_depends_on_migration(transformed):
    resources = transformed["Resources"]
    depends = resources["ApiFunction"].get("DependsOn", [])
    assert "MigrationResource" in ([depends] if isinstance(depends, str) else depends)
    migration = resources["MigrationResource"]
    assert migration["Type"] == "AWS::CloudFormation::CustomResource"
    props = migration["Properties"]
    assert props["ServiceToken"] == {"Fn::GetAtt": ["MigrationFunction", "Arn"]}
    lambda_timeout = resources["MigrationFunction"]["Properties"]["Timeout"]
    assert lambda_timeout < int(props["ServiceTimeout"]) < 3600
    # The version number ("1", "2", ...), which the handler compares to spot rollbacks.
    version_id, attribute = props["FunctionVersion"]["Fn::GetAtt"]
    assert attribute == "Version"
    version = resources[version_id]
    assert version["Type"] == "AWS::Lambda::Version"
    assert version["Properties"]["FunctionName"] == {"Ref": "MigrationFunction"}


def test_api_function_timeout_and_concurrency(source_template, transformed):
    props = transformed["Resources"]["ApiFunction"]["Properties"]
    assert props["Timeout"] <= 25  # the HTTP API gives up after 30 s
    # Optional: empty (the default) leaves the function unreserved.
    assert props["ReservedConcurrentExecutions"] == {
        "Fn::If": [
            "HasApiReservedConcurrency",
            {"Ref": "ApiReservedConcurrency"},
            {"Ref": "AWS::NoValue"},
        ]
    }
    param = source_template["Parameters"]["ApiReservedConcurrency"]
    assert param["Type"] == "String" and param["Default"] == ""
    assert transformed["Resources"]["ReportFunction"]["Properties"]["Timeout"] <= 300


def test_every_route_goes_to_the_api_function(transformed):
    (api,) = resources_of_type(transformed, "AWS::ApiGatewayV2::Api").values()
    paths = api["Properties"]["Body"]["paths"]
    routes = set()
    for path, methods in paths.items():
        for method, operation in methods.items():
            uri = operation["x-amazon-apigateway-integration"]["uri"]["Fn::Sub"]
            # The published alias (SnapStart restores published versions only).
            assert "${ApiFunctionAliaslive}" in uri, (path, method)
            assert operation["x-amazon-apigateway-integration"]["payloadFormatVersion"] == "2.0"
            routes.add((method.upper(), path))
    assert ROUTES <= routes, ROUTES - routes
    assert ("X-AMAZON-APIGATEWAY-ANY-METHOD", "/$default") in routes


def test_http_api_default_stage_is_throttled(transformed):
    (stage,) = resources_of_type(transformed, "AWS::ApiGatewayV2::Stage").values()
    props = stage["Properties"]
    assert props["StageName"] == "$default"
    assert props["AutoDeploy"] is True
    settings = props["DefaultRouteSettings"]
    assert settings["ThrottlingBurstLimit"] == {"Ref": "ApiThrottlingBurstLimit"}
    assert settings["ThrottlingRateLimit"] == {"Ref": "ApiThrottlingRateLimit"}


def test_report_schedule_parameter_defaults_to_hourly(source_template, transformed):
    assert source_template["Parameters"]["ReportSchedule"]["Default"] == "rate(1 hour)"
    (rule,) = resources_of_type(transformed, "AWS::Events::Rule").values()
    assert rule["Properties"]["ScheduleExpression"] == {"Ref": "ReportSchedule"}
    (target,) = rule["Properties"]["Targets"]
    assert target["Arn"] == {"Fn::GetAtt": ["ReportFunction", "Arn"]}


def test_the_alarms_on_report_metrics(transformed):
    # The other AnalysisQueue metrics the alarms read are counted from logs.
    from_logs = {"MigrationFailures", "Api5xx"}
    alarms = {
        a["Properties"]["MetricName"]: a["Properties"]
        for a in resources_of_type(transformed, "AWS::CloudWatch::Alarm").values()
        if a["Properties"]["Namespace"] == "AnalysisQueue"
        and a["Properties"]["MetricName"] not in from_logs
    }
    assert set(alarms) == {
        "MinutesSinceLastPing",
        "EtaHours",
        "ActiveAnalysers",
        "BrokenAnalysers",
        "FailureRatioLastHour",
    }
    assert set(alarms) <= set(handler.REPORT_METRICS)  # each one the report publishes
    for name, props in alarms.items():
        assert props["Namespace"] == "AnalysisQueue"
        assert props["Dimensions"] == [{"Name": "service", "Value": "analysis-queue"}]
        below = name == "ActiveAnalysers"
        assert props["ComparisonOperator"] == (
            "LessThanThreshold" if below else "GreaterThanThreshold"
        )
    ping = alarms["MinutesSinceLastPing"]
    assert int(ping["Threshold"]) == 60
    assert ping["TreatMissingData"] == "breaching"
    assert alarms["EtaHours"]["Threshold"] == {"Ref": "MaxBacklogEtaHours"}
    assert int(alarms["BrokenAnalysers"]["Threshold"]) == 0
    assert alarms["FailureRatioLastHour"]["Threshold"] == {"Ref": "MaxFleetFailureRatio"}


def test_environment_variables(source_template, transformed):
    lambdas = resources_of_type(transformed, "AWS::Lambda::Function")
    common = {
        "DATABASE_URL",
        "DB_HOST",
        "DB_PORT",
        "DB_NAME",
        "DB_USER",
        "DB_SECRET_ID",
        "DB_SSLMODE",
        "DB_SSLROOTCERT",
        "CURRENT_ANALYSIS_VERSION",
        "STALE_ANALYSIS_DAYS",
        "PROCESSING_TIMEOUT_MINUTES",
        "POWERTOOLS_SERVICE_NAME",
        "POWERTOOLS_METRICS_NAMESPACE",
        "LOG_LEVEL",
    }
    api_only = {"MAX_BODY_BYTES", "ACCEPT_SHARED_UPLOAD_PASSWORD", "UPLOAD_PASSWORD", "ADMIN_TOKEN"}
    # The import sources: the API's while the database holds no credential, the report's
    # for credentials-import.
    sources = {"UPLOAD_PASSWORD_SECRET", "ADMIN_TOKEN_SECRET"}
    for name, resource in lambdas.items():
        env = resource["Properties"]["Environment"]["Variables"]
        assert common <= set(env), (name, common - set(env))
        assert env["DB_SSLMODE"] == "verify-full"
        assert env["DB_HOST"] == {
            "Fn::If": ["HasDbProxy", {"Ref": "DbProxyEndpoint"}, {"Ref": "DbHost"}]
        }
        # One login or the other, by DbAuth (tests/test_template_production.py, both ways).
        assert env["DB_USER"] == {"Fn::If": ["UseIamAuth", {"Ref": "DbUser"}, ""]}
        assert env["DB_SECRET_ID"] == {"Fn::If": ["UseDbSecret", {"Ref": "DbSecretArn"}, ""]}
        assert env["POWERTOOLS_SERVICE_NAME"] == "analysis-queue"
        assert env["POWERTOOLS_METRICS_NAMESPACE"] == "AnalysisQueue"
        if name == "ApiFunction":
            assert api_only <= set(env)
        else:
            assert not api_only & set(env), name
        if name in ("ApiFunction", "ReportFunction"):
            assert sources <= set(env), name
        else:
            assert not sources & set(env), name
    api_env = lambdas["ApiFunction"]["Properties"]["Environment"]["Variables"]
    report_env = lambdas["ReportFunction"]["Properties"]["Environment"]["Variables"]
    assert {v: report_env[v] for v in sources} == {v: api_env[v] for v in sources}
    # The optional import sources: a secret, a parameter, or neither (empty).
    for var, arn_param, name_param, in_ssm in (
        (
            "UPLOAD_PASSWORD_SECRET",
            "UploadPasswordSecretArn",
            "UploadPasswordParameterName",
            "UploadPasswordInSsm",
        ),
        ("ADMIN_TOKEN_SECRET", "AdminTokenSecretArn", "AdminTokenParameterName", "AdminTokenInSsm"),
    ):
        _, if_sm, otherwise = api_env[var]["Fn::If"]
        assert if_sm == {"Fn::Sub": f"secretsmanager:${{{arn_param}}}"}
        assert otherwise == {"Fn::If": [in_ssm, {"Fn::Sub": f"ssm:${{{name_param}}}"}, ""]}
    params = source_template["Parameters"]
    for param, default in {
        "CurrentAnalysisVersion": 4,
        "StaleAnalysisDays": 180,
        "ProcessingTimeoutMinutes": 120,
        "MaxBodyBytes": handler.DEFAULT_MAX_BODY_BYTES,
    }.items():
        assert int(params[param]["Default"]) == default
    assert api_env["ACCEPT_SHARED_UPLOAD_PASSWORD"] == {"Ref": "AcceptSharedUploadPassword"}
    assert params["AcceptSharedUploadPassword"]["Default"] == "true"


def test_api_url_output(transformed):
    url = transformed["Outputs"]["ApiUrl"]["Value"]["Fn::Sub"]
    assert url.startswith("https://${HttpApi}.execute-api.${AWS::Region}.")


# --------------------------------------------------------------------------- migration re-run


def test_function_package_holds_only_handler_sql_and_web(source_copy, tmp_path):
    (source_copy / "sql" / "__pycache__").mkdir()
    (source_copy / "sql" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\0")
    (source_copy / "sql" / ".DS_Store").write_bytes(b"\0")
    (source_copy / "__pycache__").mkdir()
    (source_copy / "__pycache__" / "handler.cpython-312.pyc").write_bytes(b"\0")
    out = tmp_path / "out"
    result = make("build-MigrationFunction", source_copy, out)
    assert result.returncode == 0, result.stderr
    built = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    bytecode = {"__pycache__/handler.cpython-312.pyc"} if LAMBDA_PYTHON else set()
    expected = {"handler.py", *bytecode} | {
        p.relative_to(source_copy).as_posix()
        for folder in ("sql", "web")
        for p in (source_copy / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    }
    assert built == expected
    assert (out / "handler.py").read_bytes() == (source_copy / "handler.py").read_bytes()


def test_all_functions_build_the_same_package(source_copy, tmp_path):
    hashes = {
        name: build_function_hash(source_copy, tmp_path / name, f"build-{name}")
        for name in FUNCTIONS
    }
    assert len(set(hashes.values())) == 1, hashes


def _edit_readme(src: Path) -> None:
    (src / "README.md").write_text("# changed\n")


def _edit_docs(src: Path) -> None:
    """A page of docs/ changed and one added: documentation, not code."""
    (src / "docs").mkdir(exist_ok=True)
    with (src / "docs" / "queue.md").open("a") as f:
        f.write("\nOne more sentence.\n")
    (src / "docs" / "new-page.md").write_text("# New page\n")


def _add_test(src: Path) -> None:
    (src / "tests" / "test_new.py").write_text("def test_y():\n    pass\n")


def _edit_requirements(src: Path) -> None:
    with (src / "requirements.txt").open("a") as f:
        f.write("\nrequests==2.32.3\n")


def _edit_template(src: Path) -> None:
    with (src / "template.yaml").open("a") as f:
        f.write("\n# comment\n")


def _touch_handler(src: Path) -> None:
    os.utime(src / "handler.py", (1_000_000_000, 1_000_000_000))
    (src / "handler.py").chmod(0o600)


def _add_sql_cache(src: Path) -> None:
    (src / "sql" / "__pycache__").mkdir()
    (src / "sql" / "__pycache__" / "m.pyc").write_bytes(b"\0\1")


def _edit_handler(src: Path) -> None:
    with (src / "handler.py").open("a") as f:
        f.write("\n# changed\n")


def _edit_sql(src: Path) -> None:
    first = sorted((src / "sql").glob("*.sql"))[0]
    with first.open("a") as f:
        f.write("\n-- changed\n")


def _add_sql(src: Path) -> None:
    (src / "sql" / "999_new.sql").write_text("SELECT 1;\n")


def _edit_web(src: Path) -> None:
    with (src / "web" / "admin.js").open("a") as f:
        f.write("\n// changed\n")


def _rename_sql(src: Path) -> None:
    last = sorted((src / "sql").glob("*.sql"))[-1]
    last.rename(last.with_name("zz_" + last.name))


@pytest.mark.parametrize(
    ("change", "moves"),
    [
        (_edit_readme, False),
        (_edit_docs, False),
        (_add_test, False),
        (_edit_requirements, False),
        (_edit_template, False),
        (_touch_handler, False),
        (_add_sql_cache, False),
        (_edit_handler, True),
        (_edit_sql, True),
        (_add_sql, True),
        (_rename_sql, True),
        (_edit_web, True),
    ],
    ids=lambda v: v.__name__.lstrip("_") if callable(v) else str(v),
)
def test_package_hash_changes_exactly_with_handler_sql_or_web(source_copy, tmp_path, change, moves):
    before = build_function_hash(source_copy, tmp_path / "before")
    assert build_function_hash(source_copy, tmp_path / "again") == before  # deterministic
    change(source_copy)
    after = build_function_hash(source_copy, tmp_path / "after")
    assert (after != before) is moves


def _function_version_property(code_hash: str, parameters: dict | None = None):
    out = translate(f"s3://deploy-bucket/analysis-queue/{code_hash}", parameters)
    return out["Resources"]["MigrationResource"]["Properties"]["FunctionVersion"]


def test_migration_property_follows_the_package_hash(source_copy, tmp_path):
    """Package hash -> S3 key -> auto-published version -> MigrationResource.FunctionVersion."""
    before = build_function_hash(source_copy, tmp_path / "before")
    _edit_readme(source_copy)
    unchanged = build_function_hash(source_copy, tmp_path / "unchanged")
    _edit_sql(source_copy)
    changed = build_function_hash(source_copy, tmp_path / "changed")
    assert unchanged == before != changed

    prop_before = _function_version_property(before)
    assert _function_version_property(unchanged) == prop_before
    assert _function_version_property(changed) != prop_before
    # Parameter values (e.g. a new database host, more concurrency) are not code:
    other_values = {
        **REQUIRED_PARAMETERS,
        "DbHost": "elsewhere.example.internal",
        "ApiReservedConcurrency": 50,
    }
    assert _function_version_property(before, other_values) == prop_before


# --------------------------------------------------------------------------- Makefile: layer


@pytest.fixture
def fake_pip(tmp_path: Path) -> Path:
    script = tmp_path / "fakepip"
    script.write_text(
        "#!/bin/sh\n"
        'printf "%s\\n" "$@" > "$FAKE_PIP_DIR/argv"\n'
        "while [ $# -gt 0 ]; do\n"
        '  [ "$1" = --requirement ] && cp "$2" "$FAKE_PIP_DIR/requirements"\n'
        "  shift\n"
        "done\n"
        "exit 0\n"
    )
    script.chmod(0o755)
    return script


def test_layer_build_installs_the_lock_with_hashes_and_ca_bundle(
    source_copy, tmp_path, fake_pip, monkeypatch
):
    lock = (
        "fastapi==0.115.0 \\\n    --hash=sha256:" + "a" * 64 + "\n"
        "starlette==0.38.6 \\\n    --hash=sha256:" + "b" * 64 + "\n"
    )
    (source_copy / "requirements.lock").write_text(lock)
    (source_copy / "certs").mkdir()
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    (source_copy / "certs" / "rds-global-bundle.pem").write_text(pem)
    monkeypatch.setenv("FAKE_PIP_DIR", str(tmp_path))
    out = tmp_path / "layer"
    result = make("build-DependenciesLayer", source_copy, out, PIP=str(fake_pip))
    assert result.returncode == 0, result.stderr
    assert (out / "certs" / "rds-global-bundle.pem").read_text() == pem
    assert (tmp_path / "requirements").read_text() == lock
    argv = (tmp_path / "argv").read_text().splitlines()
    assert "--require-hashes" in argv and "--no-deps" in argv
    assert argv[argv.index("--target") + 1] == str(out / "python")
    assert argv[argv.index("--python-version") + 1] == RUNTIME.removeprefix("python")
    assert "manylinux2014_x86_64" in argv and "--only-binary=:all:" in argv


def test_layer_build_refuses_without_the_lock(source_copy, tmp_path, fake_pip, monkeypatch):
    (source_copy / "requirements.lock").unlink()
    (source_copy / "certs").mkdir()
    (source_copy / "certs" / "rds-global-bundle.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("FAKE_PIP_DIR", str(tmp_path))
    result = make("build-DependenciesLayer", source_copy, tmp_path / "layer", PIP=str(fake_pip))
    assert result.returncode != 0
    assert "requirements.lock not found; run make lock" in result.stderr


def test_layer_build_fails_without_ca_bundle(source_copy, tmp_path, fake_pip, monkeypatch):
    monkeypatch.setenv("FAKE_PIP_DIR", str(tmp_path))
    result = make("build-DependenciesLayer", source_copy, tmp_path / "layer", PIP=str(fake_pip))
    assert result.returncode != 0
    assert "rds-global-bundle.pem" in result.stderr
    (source_copy / "certs").mkdir()
    (source_copy / "certs" / "rds-global-bundle.pem").write_text("<html>not a certificate</html>\n")
    result = make("build-DependenciesLayer", source_copy, tmp_path / "layer2", PIP=str(fake_pip))
    assert result.returncode != 0
    assert "no PEM certificate" in result.stderr


# --------------------------------------------------------------------------- events


def test_every_event_file_parses():
    names = {p.name for p in EVENTS.glob("*.json")}
    assert names >= set(API_EVENTS) | set(CFN_EVENTS) | {"schedule.json", "env.json"}
    for name in names:
        assert isinstance(load_event(name), dict), name


@pytest.mark.parametrize("name", sorted(API_EVENTS))
def test_api_events_have_http_api_v2_shape(name):
    event = load_event(name)
    route = API_EVENTS[name]
    method, _, path_template = route.partition(" ")
    assert event["version"] == "2.0"
    assert event["routeKey"] == route
    assert (method, path_template) in ROUTES
    ctx = event["requestContext"]
    assert ctx["routeKey"] == route and ctx["stage"] == "$default"
    assert ctx["http"]["method"] == method
    assert ctx["http"]["path"] == event["rawPath"]
    assert ctx["http"]["sourceIp"]
    assert isinstance(event["isBase64Encoded"], bool)
    # The raw path matches the route template (path parameters filled in).
    pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path_template))
    match = re.fullmatch(pattern, event["rawPath"])
    assert match, (event["rawPath"], path_template)
    assert event.get("pathParameters", {}) == match.groupdict()
    assert dict(parse_qsl(event["rawQueryString"])) == event.get("queryStringParameters", {})
    headers = event["headers"]
    assert all(k == k.lower() for k in headers)
    if route in ANALYSER_ROUTES:
        assert headers["authorization"] == "Bearer local-upload-password"
    if route == "POST /apps":
        assert headers["authorization"] == "Bearer local-admin-token"
    if route.startswith("GET /healthz") or route == "GET /apps/{appId}":
        assert "authorization" not in headers  # public routes
    if method == "POST":
        body = event["body"]
        assert int(headers["content-length"]) == len(body.encode())
        if headers["content-type"] == "application/json":
            json.loads(body)
    else:
        assert "body" not in event


def test_analyser_events_match_the_contract():
    upload = load_event("upload-analysis.json")
    assert upload["queryStringParameters"] == {"appId": "com.example.app", "analysisVersion": "4"}
    assert json.loads(upload["body"])["bundleID"] == "com.example.app"
    failure = load_event("report-failure.json")
    assert failure["headers"]["content-type"] == "text/plain"
    assert "app not found" in failure["body"]
    assert load_event("queue-exact-app.json")["queryStringParameters"] == {
        "appId": "com.example.app"
    }
    app = json.loads(load_event("add-app.json")["body"])
    assert app == {"appId": "com.example.app", "details": {"title": "Example", "reviews": "1234"}}


def test_schedule_event():
    event = load_event("schedule.json")
    assert event["source"] == "aws.events"
    assert event["detail-type"] == "Scheduled Event"
    assert event["resources"] and event["detail"] == {}


@pytest.mark.parametrize("name", sorted(CFN_EVENTS))
def test_cloudformation_events(name):
    event = load_event(name)
    assert event["RequestType"] == CFN_EVENTS[name]
    for key in (
        "ServiceToken",
        "ResponseURL",
        "StackId",
        "RequestId",
        "LogicalResourceId",
        "ResourceType",
    ):
        assert event[key], key
    assert event["LogicalResourceId"] == "MigrationResource"
    assert event["ResourceType"] == "AWS::CloudFormation::CustomResource"
    props = event["ResourceProperties"]
    assert props["ServiceToken"] == event["ServiceToken"]
    assert props["FunctionVersion"].isdigit()
    if name == "cfn-create.json":
        assert "PhysicalResourceId" not in event
    else:
        assert event["PhysicalResourceId"] == "analysis-queue-migrations"
    if name == "cfn-update.json":
        old = event["OldResourceProperties"]["FunctionVersion"]
        assert int(old) < int(props["FunctionVersion"])  # a deploy, not a rollback
    else:
        assert "OldResourceProperties" not in event


def test_env_json_sets_only_declared_variables(transformed):
    """sam local --env-vars only overrides variables the template declares for the function."""
    env = load_event("env.json")
    lambdas = resources_of_type(transformed, "AWS::Lambda::Function")
    assert set(env) == set(FUNCTIONS)
    for name, values in env.items():
        declared = set(lambdas[name]["Properties"]["Environment"]["Variables"])
        assert set(values) <= declared, (name, set(values) - declared)
        assert values["DATABASE_URL"] == "postgresql://postgres@host.docker.internal:5432/postgres"
        assert values["DB_HOST"] == "" and values["DB_SECRET_ID"] == ""
    assert env["ApiFunction"]["UPLOAD_PASSWORD"] == "local-upload-password"
    assert env["ApiFunction"]["ADMIN_TOKEN"] == "local-admin-token"


def test_sam_local_logs_in_by_database_url_over_the_templates_iam_login(transformed, monkeypatch):
    """sam local gives a function the template's variables with env.json's on top. The
    template's default login (DbAuth iam: DB_USER, and the owner's DB_MIGRATION_USER)
    stays set there, and env.json's DATABASE_URL wins over it: no token is signed (there
    are no credentials to sign with here) and no AWS API is called."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    resources = deployed(transformed)
    for name in FUNCTIONS:
        template_env = resources[name]["Properties"]["Environment"]["Variables"]
        env = {**{k: str(v) for k, v in template_env.items()}, **env_json(name)}
        assert env["DB_USER"] == "queue_api", name
        settings = handler.load_settings(env)
        assert settings.db_secret_id is settings.upload_password_secret is None
        owner = name == "MigrationFunction"
        assert env.get("DB_MIGRATION_USER") == ("queue_owner" if owner else None)
        arguments = handler.connection_arguments(settings, owner=owner)
        assert (arguments["host"], arguments["user"]) == ("host.docker.internal", "postgres")
        assert arguments["password"] is None


def test_the_bench_runs_the_reports_on_the_report_functions_statement_timeout():
    """bench/claims.py measures the reports as ReportFunction runs them: on its statement
    timeout (a constant there, which this keeps equal to the template's)."""
    source = (REPO / "bench" / "claims.py").read_text()
    (bench,) = re.findall(r"^REPORT_STATEMENT_TIMEOUT_MS = ([\d_]+)", source, re.MULTILINE)
    report = load_template()["Resources"]["ReportFunction"]["Properties"]
    assert int(bench) == int(report["Environment"]["Variables"]["STATEMENT_TIMEOUT_MS"])
