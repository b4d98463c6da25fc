"""The stack an operator looks at, on the template as SAM translates it (and with its
conditions resolved as CloudFormation would): the few custom metrics and who reads each,
the optional dashboard, throttling per route, the 5xx alarm that leaves GET
/healthz/analyser out, the latency alarms, the optional ActiveAnalysers alarm, the
report's asynchronous retries; cfn-lint-serverless's rules; and docs/monitoring.md
against all of it.
"""

from __future__ import annotations

import json
import re

import pytest
from cfnlint.api import ManualArgs, lint, lint_file
from hypothesis import given
from hypothesis import strategies as st

import handler
from sam_template import (
    ANALYSER_ROUTES,
    FUNCTIONS,
    REQUIRED_PARAMETERS,
    TEMPLATE,
    deployed,
    load_template,
    resolve,
    resources_of_type,
    translate,
)

# Uses no PostgreSQL (conftest.py holds it to that): CI's second pass leaves it out.
pytestmark = pytest.mark.no_database

DOCS = handler.HERE / "docs" / "monitoring.md"
PUBLIC_ROUTES = {"GET /apps/{appId}", "GET /healthz", "GET /healthz/analyser", "$default"}
WEB_VIEW_ROUTES = {"ANY /admin", "ANY /admin/{proxy+}"}
SERVERLESS_RULES = ManualArgs(
    regions=["us-east-1", "eu-west-1"], append_rules=["cfn_lint_serverless.rules"]
)
TRANSFORMED = translate(parameters=REQUIRED_PARAMETERS)


@pytest.fixture(scope="module")
def transformed() -> dict:
    return TRANSFORMED


@pytest.fixture(scope="module")
def source() -> dict:
    return load_template()


# --------------------------------------------------------------------------- cfn-lint-serverless


def test_cfn_lint_serverless_rules_pass():
    assert [str(m) for m in lint_file(TEMPLATE, config=SERVERLESS_RULES)] == []


def test_cfn_lint_serverless_rules_are_loaded_and_the_ignores_are_narrow():
    """Without the functions' ignores, or without the report's invoke settings, the rules
    speak: the check above can fail, and each ignore names only the rules it must."""
    text = TEMPLATE.read_text()
    unignored = text.replace("ignore_checks: [WS1000, WS1004]", "ignore_checks: []")
    assert unignored != text
    rules = {m.rule.id for m in lint(unignored, config=SERVERLESS_RULES)}
    assert rules == {"WS1000", "WS1004"}
    no_destination = re.sub(r"      DestinationConfig:\n(        .*\n)+", "", text)
    assert no_destination != text
    assert {m.rule.id for m in lint(no_destination, config=SERVERLESS_RULES)} == {"ES1007"}


# --------------------------------------------------------------------------- metrics

# The report's metrics (issue 37: what the alarms and the dashboard read, at most 8);
# handler.REPORT_METRICS is the set the report publishes, and must be these.
REPORT_METRICS = {
    "Backlog",
    "EtaHours",
    "MinutesSinceLastPing",
    "ActiveAnalysers",
    "BrokenAnalysers",
    "FailureRatioLastHour",
    "OldestLeaseMinutes",
    "AnalysedLastHour",
}
# The custom metrics the stack counts from logs, each read by an alarm.
LOG_METRICS = {"Api5xx", "MigrationFailures"}
# AWS's own metrics, free: the functions' and the API's.
AWS_NAMESPACES = {"AWS/Lambda", "AWS/ApiGateway"}


def report_metric_names() -> set[str]:
    """Every metric the report publishes (its ping metric only once an analyser pinged)."""
    return set(handler.REPORT_METRICS)


def log_metric_names(transformed: dict) -> set[str]:
    return {
        t["MetricName"]
        for f in resources_of_type(transformed, "AWS::Logs::MetricFilter").values()
        for t in f["Properties"]["MetricTransformations"]
        if t["MetricNamespace"] == "AnalysisQueue"
    }


def alarm_metrics(transformed: dict) -> set[tuple[str, str]]:
    """(namespace, metric) of every alarm, the optional ones included."""
    return {
        (a["Properties"]["Namespace"], a["Properties"]["MetricName"])
        for a in resources_of_type(transformed, "AWS::CloudWatch::Alarm").values()
    }


def test_the_report_publishes_exactly_the_few_metrics_that_are_read():
    assert report_metric_names() == REPORT_METRICS
    assert len(handler.REPORT_METRICS) == len(REPORT_METRICS) <= 8


def test_every_custom_metric_is_read_by_an_alarm_or_the_dashboard(transformed):
    """Each custom metric is billed by the month: the report's and the log filters' are
    exactly those the alarms and the dashboard read, and nothing else is read."""
    from_logs = log_metric_names(transformed)
    assert from_logs == LOG_METRICS
    alarms = alarm_metrics(transformed)
    assert {namespace for namespace, _ in alarms} <= {"AnalysisQueue"} | AWS_NAMESPACES
    alarmed = {name for namespace, name in alarms if namespace == "AnalysisQueue"}
    # Every log metric has its alarm (a filter no alarm reads is a metric billed for nothing).
    assert from_logs <= alarmed
    shown = {
        name
        for metrics in widget_metrics(dashboard(transformed)).values()
        for namespace, name, *_ in metrics
        if namespace == "AnalysisQueue"
    }
    assert alarmed | shown == REPORT_METRICS | LOG_METRICS
    # The alarms keep reading what they read before the metrics were cut.
    assert alarmed == {
        "MinutesSinceLastPing",
        "EtaHours",
        "ActiveAnalysers",
        "BrokenAnalysers",
        "FailureRatioLastHour",
        "Api5xx",
        "MigrationFailures",
    }


# --------------------------------------------------------------------------- dashboard

SUB_VALUES = {
    "AWS::Region": "us-east-1",
    "AWS::StackName": "queue",
    "HttpApi": "a1b2c3",
    "MaxBacklogEtaHours": "48",
    "MinActiveAnalysers": "2",
    "ProcessingTimeoutMinutes": "120",
    "ApiLatencyAlarmMs": "3000",
    "MaxFleetFailureRatio": "0.5",
    **{name: f"fn-{name}" for name in FUNCTIONS},
}


def dashboard(transformed: dict) -> dict:
    body = transformed["Resources"]["QueueDashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    names = set(re.findall(r"\$\{([^}]+)\}", body))
    parameters, resources = transformed["Parameters"], transformed["Resources"]
    for name in names:  # every variable is a parameter, a resource or a pseudo parameter
        assert name in parameters or name in resources or name.startswith("AWS::"), name
    return json.loads(re.sub(r"\$\{([^}]+)\}", lambda m: SUB_VALUES[m.group(1)], body))


def widget_metrics(board: dict) -> dict[str, list[list]]:
    """Each widget's title -> its metrics, each as [namespace, name, dimensions...]."""
    return {
        w["properties"]["title"]: [
            [item for item in metric if not isinstance(item, dict)]
            for metric in w["properties"]["metrics"]
        ]
        for w in board["widgets"]
    }


def test_the_dashboard_is_optional_and_off_by_default(source, transformed):
    parameter = source["Parameters"]["Dashboard"]
    assert parameter["AllowedValues"] == ["true", "false"] and parameter["Default"] == "false"
    assert source["Resources"]["QueueDashboard"]["Condition"] == "CreateDashboard"
    assert source["Outputs"]["DashboardUrl"]["Condition"] == "CreateDashboard"
    default = resolve(transformed)
    assert "QueueDashboard" not in default["Resources"]
    assert "DashboardUrl" not in default["Outputs"]
    assert not resources_of_type(default, "AWS::CloudWatch::Dashboard")
    wanted = resolve(transformed, {"Dashboard": "true"})
    assert wanted["Resources"]["QueueDashboard"]["Type"] == "AWS::CloudWatch::Dashboard"
    url = wanted["Outputs"]["DashboardUrl"]["Value"]["Fn::Sub"]
    assert url.endswith("#dashboards:name=${QueueDashboard}")
    # The alarms do not depend on it.
    alarms = resources_of_type(default, "AWS::CloudWatch::Alarm")
    assert alarms.keys() == resources_of_type(wanted, "AWS::CloudWatch::Alarm").keys()


def test_the_dashboard_shows_only_metrics_that_are_published(transformed):
    board = dashboard(transformed)
    from_report, from_logs = report_metric_names(), log_metric_names(transformed)
    shown = set()
    for metrics in widget_metrics(board).values():
        for namespace, name, *dimensions in metrics:
            assert namespace in {"AnalysisQueue"} | AWS_NAMESPACES, namespace
            if namespace != "AnalysisQueue":
                continue
            shown.add(name)
            if name in from_logs:  # the metric filters publish no dimensions
                assert dimensions == [], name
            else:  # the report's (Powertools): the service's dimension
                assert dimensions == ["service", "analysis-queue"], name
    assert shown <= from_report | {"Api5xx"}
    assert from_report <= shown  # each of the report's metrics is on the page


def test_the_dashboard_has_the_operators_widgets(transformed):
    widgets = widget_metrics(dashboard(transformed))
    names = {title: {m[1] for m in metrics} for title, metrics in widgets.items()}
    assert names == {
        "Backlog and its ETA (hourly report)": {"Backlog", "EtaHours"},
        "Analysed per hour (hourly report)": {"AnalysedLastHour"},
        "Active analysers (hourly report)": {"ActiveAnalysers", "MinutesSinceLastPing"},
        "Fleet health (hourly report)": {"BrokenAnalysers", "FailureRatioLastHour"},
        "Oldest lease, minutes (hourly report)": {"OldestLeaseMinutes"},
        "Lambda errors": {"Errors", "Throttles"},
        "Lambda duration (p95, ms)": {"Duration"},
        "Lambda concurrency (max)": {"ConcurrentExecutions"},
        "API 4xx and 5xx": {"4xx", "5xx", "Api5xx"},
        "API latency (ms)": {"Latency", "IntegrationLatency"},
    }
    # The functions' metrics, for each of the three functions.
    for title, metric in (
        ("Lambda errors", "Errors"),
        ("Lambda duration (p95, ms)", "Duration"),
        ("Lambda concurrency (max)", "ConcurrentExecutions"),
    ):
        functions = {m[3] for m in widgets[title] if m[:2] == ["AWS/Lambda", metric]}
        assert functions == {f"fn-{name}" for name in FUNCTIONS}, title
    # The API's, on this API.
    api = {
        (m[1], m[3])
        for title in ("API 4xx and 5xx", "API latency (ms)")
        for m in widgets[title]
        if m[0] == "AWS/ApiGateway"
    }
    assert {("4xx", "a1b2c3"), ("5xx", "a1b2c3"), ("Latency", "a1b2c3")} <= api


def test_the_dashboard_marks_the_thresholds(transformed):
    board = dashboard(transformed)
    lines = {
        w["properties"]["title"]: [a["value"] for a in w["properties"]["annotations"]["horizontal"]]
        for w in board["widgets"]
        if "annotations" in w["properties"]
    }
    assert lines == {
        "Backlog and its ETA (hourly report)": [48],  # MaxBacklogEtaHours
        "Active analysers (hourly report)": [2],  # MinActiveAnalysers
        "Oldest lease, minutes (hourly report)": [120],  # ProcessingTimeoutMinutes
        "API latency (ms)": [3000],  # ApiLatencyAlarmMs
        "Fleet health (hourly report)": [0.5],  # MaxFleetFailureRatio
    }


# --------------------------------------------------------------------------- throttling


def stage(transformed: dict, **overrides: str) -> dict:
    resources = {"Resources": deployed(transformed, **overrides)}
    (found,) = resources_of_type(resources, "AWS::ApiGatewayV2::Stage").values()
    return found["Properties"]


def route_keys(transformed: dict) -> set[str]:
    (api,) = resources_of_type(transformed, "AWS::ApiGatewayV2::Api").values()
    keys = set()
    for path, methods in api["Properties"]["Body"]["paths"].items():
        for method in methods:
            if method == "x-amazon-apigateway-any-method" and path == "/$default":
                keys.add("$default")
            elif method == "x-amazon-apigateway-any-method":
                keys.add(f"ANY {path}")
            else:
                keys.add(f"{method.upper()} {path}")
    return keys


def test_public_routes_have_their_own_lower_limits(transformed, source):
    settings = stage(transformed, PublicThrottlingBurstLimit="7", PublicThrottlingRateLimit="3")
    routes = settings["RouteSettings"]
    assert set(routes) == PUBLIC_ROUTES | WEB_VIEW_ROUTES
    assert set(routes) <= route_keys(transformed)  # a key no route has fails the deploy
    for key in PUBLIC_ROUTES:
        assert routes[key] == {"ThrottlingBurstLimit": "7", "ThrottlingRateLimit": "3"}, key
    # The web view's bucket is its own, smaller than the analysers' (its sign-in is also
    # limited per address by the app).
    for key in WEB_VIEW_ROUTES:
        assert routes[key] == {"ThrottlingBurstLimit": 10, "ThrottlingRateLimit": 5}, key
    # The authenticated routes keep the stage's default limits.
    assert not (ANALYSER_ROUTES | {"POST /apps"}) & set(routes)
    assert settings["DefaultRouteSettings"] == {
        "ThrottlingBurstLimit": 20,
        "ThrottlingRateLimit": 10,
    }
    parameters = source["Parameters"]
    for kind in ("BurstLimit", "RateLimit"):
        public = int(parameters[f"PublicThrottling{kind}"]["Default"])
        analysers = int(parameters[f"ApiThrottling{kind}"]["Default"])
        assert public < analysers, kind


def test_every_route_without_a_token_is_throttled_as_public(transformed):
    """The app's routes that need no token (its OpenAPI document says which) are exactly
    the public ones, so a new public route cannot be left on the analysers' limits."""
    document = handler.app.openapi()
    anonymous = {
        f"{method.upper()} {path}"
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        # no requirement, or an empty one among them (a token that only adds to the answer)
        if not operation.get("security") or {} in operation["security"]
    }
    assert anonymous == PUBLIC_ROUTES - {"$default"}
    assert anonymous <= route_keys(transformed)


# --------------------------------------------------------------------------- access-log metrics

FILTER_TERM = re.compile(r'\(\$\.(\w+) (=|!=) "([^"*]*)(\*?)"\)')


def matches(pattern: str, record: dict) -> bool:
    """CloudWatch Logs' JSON filter pattern, for the form the template uses: terms
    `($.field = "value")` or `!=`, a trailing * matching any rest, joined by &&. Any other
    form fails here, so the template cannot drift into what this does not evaluate."""
    inner = re.fullmatch(r"\{\s*(.*?)\s*\}", " ".join(pattern.split()))
    assert inner, pattern
    result = True
    for term in inner.group(1).split(" && "):
        found = FILTER_TERM.fullmatch(term.strip())
        assert found, term
        field, operator, value, wildcard = found.groups()
        actual = record.get(field)
        equal = isinstance(actual, str) and (
            actual.startswith(value) if wildcard else actual == value
        )
        result &= equal if operator == "=" else not equal
    return result


def access_log_record(transformed: dict, route: str, status: int, length: int | str) -> dict:
    """The access-log line API Gateway writes for a request, from the stage's Format."""
    values = {"routeKey": route, "status": str(status), "responseLength": str(length)}
    text = stage(transformed)["AccessLogSettings"]["Format"]
    return json.loads(re.sub(r"\$context\.([A-Za-z.]+)", lambda m: values.get(m[1], "-"), text))


def metric_filter(transformed: dict, metric: str) -> dict:
    (found,) = (
        f["Properties"]
        for f in deployed(transformed).values()
        if f["Type"] == "AWS::Logs::MetricFilter"
        and f["Properties"]["MetricTransformations"][0]["MetricName"] == metric
    )
    assert found["LogGroupName"] == {"Ref": "HttpApiAccessLogGroup"}
    return found


ROUTES = sorted(route_keys(TRANSFORMED))
STATUSES = [200, 201, 204, 400, 401, 404, 409, 413, 429, 500, 502, 503, 504]


@given(st.sampled_from(ROUTES), st.sampled_from(STATUSES))
def test_the_5xx_count_is_every_5xx_but_the_analyser_healthz(route, status):
    transformed = TRANSFORMED
    pattern = metric_filter(transformed, "Api5xx")["FilterPattern"]
    counted = matches(pattern, access_log_record(transformed, route, status, 20))
    assert counted == (status >= 500 and route != "GET /healthz/analyser"), (route, status)


def test_six_anonymous_analyser_healthz_503s_do_not_page(transformed):
    resources = deployed(transformed)
    alarm = resources["Api5xxAlarm"]["Properties"]
    (transformation,) = metric_filter(transformed, "Api5xx")["MetricTransformations"]
    assert (alarm["Namespace"], alarm["MetricName"]) == (
        transformation["MetricNamespace"],
        transformation["MetricName"],
    )
    pattern = metric_filter(transformed, "Api5xx")["FilterPattern"]

    def count(route: str, n: int) -> int:
        record = access_log_record(transformed, route, 503, 40)
        return n * int(matches(pattern, record))

    assert evaluate([count("GET /healthz/analyser", 6)], alarm) == "OK"
    assert evaluate([count("GET /queue", 6)], alarm) == "ALARM"
    assert evaluate([count("GET /healthz", 6)], alarm) == "ALARM"  # /healthz's 503 is news


# --------------------------------------------------------------------------- alarms


def evaluate(datapoints: list[float | None], props: dict) -> str:
    """CloudWatch's M-of-N evaluation of the last EvaluationPeriods periods, with missing
    data treated as the alarm says, for either comparison."""
    window = datapoints[-int(props["EvaluationPeriods"]) :]
    needed = int(props.get("DatapointsToAlarm", props["EvaluationPeriods"]))
    threshold = float(props["Threshold"])
    below = props["ComparisonOperator"] == "LessThanThreshold"
    assert below or props["ComparisonOperator"] == "GreaterThanThreshold"
    breaching = 0
    for point in window:
        if point is None:
            breaching += props["TreatMissingData"] == "breaching"
        else:
            breaching += point < threshold if below else point > threshold
    return "ALARM" if breaching >= needed else "OK"


def test_api_latency_alarm_waits_for_fifteen_slow_minutes(transformed):
    props = deployed(transformed, ApiLatencyAlarmMs="2500")["ApiLatencyAlarm"]["Properties"]
    assert (props["Namespace"], props["MetricName"]) == ("AWS/ApiGateway", "Latency")
    assert props["Dimensions"] == [{"Name": "ApiId", "Value": {"Ref": "HttpApi"}}]
    assert props["ExtendedStatistic"] == "p95" and "Statistic" not in props
    assert int(props["Period"]) * int(props["EvaluationPeriods"]) == 15 * 60
    assert props["Threshold"] == "2500"
    assert evaluate([100, 2600, 100], props) == "OK"  # a cold start, a slow minute
    assert evaluate([100, 2600, 2600], props) == "OK"
    assert evaluate([2600, 2600, 2600], props) == "ALARM"
    assert evaluate([None, None, None], props) == "OK"  # no traffic is not slow


def test_api_function_duration_alarm_fires_before_the_timeout(transformed):
    resources = deployed(transformed)
    props = resources["ApiFunctionDurationAlarm"]["Properties"]
    assert (props["Namespace"], props["MetricName"]) == ("AWS/Lambda", "Duration")
    assert props["Dimensions"] == [{"Name": "FunctionName", "Value": {"Ref": "ApiFunction"}}]
    assert props["ExtendedStatistic"] == "p99"
    timeout_ms = resources["ApiFunction"]["Properties"]["Timeout"] * 1000
    assert 0.5 * timeout_ms < props["Threshold"] < timeout_ms
    assert evaluate([21000, 100, 21000], props) == "ALARM"
    assert evaluate([100, 21000, 100], props) == "OK"


def test_active_analysers_alarm_is_off_by_default_and_on_below_the_minimum(source, transformed):
    assert source["Parameters"]["MinActiveAnalysers"]["Default"] == "0"
    assert "ActiveAnalysersAlarm" not in deployed(transformed)  # today's deploys: quiet
    resources = deployed(transformed, MinActiveAnalysers="3")
    props = resources["ActiveAnalysersAlarm"]["Properties"]
    # The report's namespace and dimension (Powertools, as for its other metrics).
    env = resources["ReportFunction"]["Properties"]["Environment"]["Variables"]
    assert props["Namespace"] == env["POWERTOOLS_METRICS_NAMESPACE"] == "AnalysisQueue"
    assert props["Dimensions"] == [{"Name": "service", "Value": env["POWERTOOLS_SERVICE_NAME"]}]
    assert props["MetricName"] == "ActiveAnalysers"
    assert props["Threshold"] == "3" and int(props["Period"]) == 3600
    assert props["AlarmActions"] == [{"Ref": "AlarmTopic"}]
    assert evaluate([4, 2, 2], props) == "ALARM"  # two hours short
    assert evaluate([4, 2, 3], props) == "OK"  # one hour short: an analyser rebooting
    assert evaluate([4, None, None], props) == "OK"  # no report: the ping alarm's job


def test_the_report_is_retried_once_and_failures_reach_the_operator(transformed):
    resources = deployed(transformed)
    (config,) = (
        r["Properties"]
        for r in resources.values()
        if r["Type"] == "AWS::Lambda::EventInvokeConfig"
        and r["Properties"]["FunctionName"] == {"Ref": "ReportFunction"}
    )
    assert config["MaximumRetryAttempts"] == 1
    # Dropped before the next hourly report is due; above Lambda's 60 s minimum.
    assert 60 <= config["MaximumEventAgeInSeconds"] < 3600
    # The schedule invokes the unqualified ARN: $LATEST, the qualifier configured.
    assert config["Qualifier"] == "$LATEST"
    (rule,) = resources_of_type({"Resources": resources}, "AWS::Events::Rule").values()
    (target,) = rule["Properties"]["Targets"]
    assert target["Arn"] == {"Fn::GetAtt": ["ReportFunction", "Arn"]}
    topic = {"Ref": "AlarmTopic"}
    assert config["DestinationConfig"] == {"OnFailure": {"Destination": topic}}
    statements = [
        s
        for policy in resources["ReportFunctionRole"]["Properties"]["Policies"]
        for s in policy["PolicyDocument"]["Statement"]
    ]
    publish = {"Sid": "PublishFailedReports", "Effect": "Allow", "Action": "sns:Publish"}
    assert {**publish, "Resource": topic} in statements
    other = "arn:aws:sns:us-east-1:123456789012:ops"
    config = deployed(transformed, AlarmTopicArn=other)["ReportInvokeConfig"]["Properties"]
    assert config["DestinationConfig"] == {"OnFailure": {"Destination": other}}


# --------------------------------------------------------------------------- docs


def test_the_docs_name_every_alarm_parameter_and_widget(transformed, source):
    text = DOCS.read_text()
    alarms = resources_of_type(transformed, "AWS::CloudWatch::Alarm")
    for name in alarms:
        assert f"`{name}`" in text, name
    for name in (
        "PublicThrottlingBurstLimit",
        "PublicThrottlingRateLimit",
        "ApiThrottlingBurstLimit",
        "ApiThrottlingRateLimit",
        "MinActiveAnalysers",
        "ApiLatencyAlarmMs",
    ):
        default = source["Parameters"][name]["Default"]
        assert f"`{name}` (default {default})" in text, name
    for title in widget_metrics(dashboard(transformed)):
        assert title in text, title


def test_the_docs_figures_match_the_template(transformed):
    text = " ".join(DOCS.read_text().split())
    access_log = [
        f
        for f in resources_of_type(transformed, "AWS::Logs::MetricFilter").values()
        if f["Properties"]["LogGroupName"] == {"Ref": "HttpApiAccessLogGroup"}
    ]
    assert f"the report publishes {len(report_metric_names())} " in text
    assert f"the access log's filters {len(access_log)}," in text
    config = deployed(transformed)["ReportInvokeConfig"]["Properties"]
    assert config["MaximumRetryAttempts"] == 1 and "is retried once" in text
    assert f"within {config['MaximumEventAgeInSeconds'] // 60} minutes" in text
