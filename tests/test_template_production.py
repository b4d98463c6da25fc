"""The stack's production settings, on the template as SAM translates it.

Conditions are evaluated (sam_template.deployed) for given parameter values
(CloudFormation does it on deploy; neither the SAM translator nor cfn-lint does), so each
optional piece is checked both ways: the database login (IAM authentication, the default,
or a password secret), the shared password's and admin token's import sources, reserved
concurrency, the alarm topic and its e-mail subscription, the S3 endpoint, the migration
secret, SnapStart; and the Rules, which refuse what cannot work before anything changes.
The alarm topic, subscription and alarms are then created in moto's SNS and CloudWatch
from the resolved properties.
"""

from __future__ import annotations

import json
import re

import pytest

import handler
from helpers import LambdaContext, json_lines, load_event
from sam_template import (
    FUNCTIONS,
    REQUIRED_PARAMETERS,
    SECRET_PARAMETERS,
    broken_rules,
    deployed,
    load_template,
    resources_of_type,
    translate,
)


@pytest.fixture(scope="module")
def transformed() -> dict:
    return translate(parameters=REQUIRED_PARAMETERS)


@pytest.fixture(scope="module")
def source() -> dict:
    return load_template()


# --------------------------------------------------------------------------- capacity


def test_reserved_concurrency_is_optional(transformed):
    unreserved = deployed(transformed)["ApiFunction"]["Properties"]
    assert "ReservedConcurrentExecutions" not in unreserved
    reserved = deployed(transformed, ApiReservedConcurrency="8")["ApiFunction"]["Properties"]
    assert reserved["ReservedConcurrentExecutions"] == "8"


def test_reserved_concurrency_parameter_accepts_empty_or_a_positive_number(source):
    pattern = source["Parameters"]["ApiReservedConcurrency"]["AllowedPattern"]
    for good in ("", "1", "25"):
        assert re.fullmatch(pattern, good)
    for bad in ("0", "-1", "ten", " 5"):
        assert not re.fullmatch(pattern, bad)


# --------------------------------------------------------------------------- deploys


def test_migration_invocation_is_not_retried_and_the_wait_is_bounded(transformed):
    resources = deployed(transformed)
    configs = resources_of_type({"Resources": resources}, "AWS::Lambda::EventInvokeConfig")
    (config,) = (
        c for c in configs.values() if c["Properties"]["FunctionName"]["Ref"] == "MigrationFunction"
    )
    props = config["Properties"]
    # CloudFormation invokes the unqualified ARN, i.e. $LATEST.
    assert props["FunctionName"] == {"Ref": "MigrationFunction"}
    assert props["Qualifier"] == "$LATEST"
    assert props["MaximumRetryAttempts"] == 0
    queued = props["MaximumEventAgeInSeconds"]
    assert queued == 60  # Lambda's minimum
    custom = resources["MigrationResource"]
    assert custom["DependsOn"] in ("MigrationInvokeConfig", ["MigrationInvokeConfig"])
    assert custom["Properties"]["ServiceToken"] == {"Fn::GetAtt": ["MigrationFunction", "Arn"]}
    timeout = resources["MigrationFunction"]["Properties"]["Timeout"]
    service_timeout = int(custom["Properties"]["ServiceTimeout"])
    # Long enough for the longest wait in the queue plus the function's whole run; no
    # more than 60 s beyond it.
    assert timeout + queued < service_timeout <= timeout + queued + 60
    # The handler answers before its own timeout, with the reply margin kept back.
    assert handler.CFN_REPLY_MARGIN_SECONDS < timeout


def test_s3_gateway_endpoint_is_optional(transformed):
    without = deployed(transformed)
    assert not resources_of_type({"Resources": without}, "AWS::EC2::VPCEndpoint")
    assert without["MigrationResource"]["Properties"]["ReplyEndpoint"] == "none"
    with_endpoint = deployed(
        transformed,
        S3EndpointRouteTableIds="rtb-0a1,rtb-0b2",
        S3EndpointVpcId="vpc-0123abcd",
    )
    (endpoint,) = resources_of_type({"Resources": with_endpoint}, "AWS::EC2::VPCEndpoint").values()
    props = endpoint["Properties"]
    assert props["VpcEndpointType"] == "Gateway"
    assert props["ServiceName"] == {"Fn::Sub": "com.amazonaws.${AWS::Region}.s3"}
    assert props["RouteTableIds"] == ["rtb-0a1", "rtb-0b2"]
    assert props["VpcId"] == "vpc-0123abcd"
    # The custom resource waits for the endpoint before it is first invoked.
    assert with_endpoint["MigrationResource"]["Properties"]["ReplyEndpoint"] == {
        "Ref": "ReplyS3Endpoint"
    }


def test_s3_endpoint_rule_asks_for_the_vpc(source):
    rule = source["Rules"]["S3EndpointNeedsTheVpc"]
    assert rule["RuleCondition"] == {
        "Fn::Not": [{"Fn::EachMemberEquals": [{"Ref": "S3EndpointRouteTableIds"}, ""]}]
    }
    (assertion,) = rule["Assertions"]
    assert assertion["Assert"] == {"Fn::Not": [{"Fn::Equals": [{"Ref": "S3EndpointVpcId"}, ""]}]}


# --------------------------------------------------------------------------- least privilege

RESOURCE_ID = REQUIRED_PARAMETERS["DbResourceId"]
DB_SECRET = SECRET_PARAMETERS["DbSecretArn"]
OWNER_SECRET = "arn:aws:secretsmanager:us-east-1:123456789012:secret:owner-AbCdEf"
# Every variable that names a secret store the handler would read.
SECRET_VARIABLES = (
    "DB_SECRET_ID",
    "DB_MIGRATION_SECRET_ID",
    "UPLOAD_PASSWORD_SECRET",
    "ADMIN_TOKEN_SECRET",
)


def dbuser(user: str, resource_id: str = RESOURCE_ID) -> dict:
    """The rds-db:connect resource of `user` (the partition, region and account are the
    stack's own)."""
    arn = "arn:${AWS::Partition}:rds-db:${AWS::Region}:${AWS::AccountId}:dbuser:"
    return {"Fn::Sub": f"{arn}{resource_id}/{user}"}


def statements(resources: dict, function: str) -> list[dict]:
    """The statements of the inline policies of `function`'s role."""
    return [
        statement
        for policy in resources[f"{function}Role"]["Properties"].get("Policies", [])
        for statement in policy["PolicyDocument"]["Statement"]
    ]


def grants(resources: dict, function: str) -> dict[str, list]:
    """action -> the resources the role grants it on (one list, every statement)."""
    found: dict[str, list] = {}
    for statement in statements(resources, function):
        assert statement["Effect"] == "Allow"
        actions = statement["Action"]
        targets = statement["Resource"]
        for action in [actions] if isinstance(actions, str) else actions:
            found.setdefault(action, []).extend(targets if isinstance(targets, list) else [targets])
    return found


def environment(resources: dict, function: str) -> dict:
    return resources[function]["Properties"]["Environment"]["Variables"]


def settings_of(resources: dict, function: str):
    """handler's Settings from the function's variables as Lambda would give them (it
    refuses, for one, DB_USER with DB_SECRET_ID)."""
    return handler.load_settings({k: str(v) for k, v in environment(resources, function).items()})


def test_the_default_stack_reads_no_secret_and_may_call_no_secret_store(transformed):
    """With the defaults no role may call Secrets Manager, SSM or KMS, and no variable
    names a secret: the functions call no AWS API at run time, so the VPC needs no
    interface endpoint. What each role may do is its database login (rds-db:connect,
    made in the function) and, for the report, publishing its failed runs to the topic."""
    resources = deployed(transformed)
    for name in FUNCTIONS:
        actions = set(grants(resources, name))
        assert not {a for a in actions if a.split(":")[0] in ("secretsmanager", "ssm", "kms")}
        expected = {"rds-db:connect"} | ({"sns:Publish"} if name == "ReportFunction" else set())
        assert actions == expected, name
        env = environment(resources, name)
        assert {var: env[var] for var in SECRET_VARIABLES if env.get(var)} == {}, name
        settings = settings_of(resources, name)
        assert settings.db_secret_id is settings.db_migration_secret_id is None
        assert settings.upload_password_secret is settings.admin_token_secret is None
        # Lambda's own: the logs, and the network interfaces in SubnetIds.
        assert resources[f"{name}Role"]["Properties"]["ManagedPolicyArns"] == [
            "arn:aws:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole",
            "arn:aws:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole",
        ]


@pytest.mark.parametrize(
    ("overrides", "api_user", "owner"),
    [
        ({}, "queue_api", "queue_owner"),
        ({"DbUser": "svc", "DbMigrationUser": "tables"}, "svc", "tables"),
        # No owner of its own: migrations log in as DbUser (the handler's fallback).
        ({"DbMigrationUser": ""}, "queue_api", None),
    ],
    ids=["defaults", "other-names", "one-user"],
)
def test_iam_auth_grants_connect_as_exactly_each_functions_user(
    transformed, overrides, api_user, owner
):
    resources = deployed(transformed, **overrides)
    for name in FUNCTIONS:
        env = environment(resources, name)
        assert env["DB_USER"] == api_user and env["DB_SECRET_ID"] == ""
        assert env["DB_SSLMODE"] == "verify-full"  # the token goes over TLS only
        login = owner or api_user if name == "MigrationFunction" else api_user
        assert grants(resources, name)["rds-db:connect"] == [dbuser(login)], name
        settings = settings_of(resources, name)
        assert settings.db_user == api_user
        if name == "MigrationFunction":
            # Migrations connect as the owner only (handler.migrate's owner_connection).
            assert env["DB_MIGRATION_USER"] == (owner or "")
            assert env["DB_MIGRATION_SECRET_ID"] == ""
            assert (settings.db_migration_user or settings.db_user) == login
        else:
            assert "DB_MIGRATION_USER" not in env


def test_iam_auth_through_rds_proxy_connects_to_the_proxy(transformed):
    resources = deployed(
        transformed,
        DbProxyEndpoint="queue.proxy-abc123.us-east-1.rds.amazonaws.com",
        DbResourceId="prx-0123456789abcdef0",
        DbSslRootCert="",
    )
    for name in FUNCTIONS:
        env = environment(resources, name)
        assert env["DB_HOST"] == "queue.proxy-abc123.us-east-1.rds.amazonaws.com"
        user = "queue_owner" if name == "MigrationFunction" else "queue_api"
        assert grants(resources, name)["rds-db:connect"] == [dbuser(user, "prx-0123456789abcdef0")]


def test_db_auth_secret_is_the_password_stack_of_before(transformed):
    """DbAuth secret: the database's password from DbSecretArn, the imports from their
    stores, and no IAM login anywhere."""
    resources = deployed(transformed, **SECRET_PARAMETERS)
    admin_parameter = (
        "arn:${AWS::Partition}:ssm:${AWS::Region}:${AWS::AccountId}:parameter"
        + SECRET_PARAMETERS["AdminTokenParameterName"]
    )
    expected = {
        "ApiFunction": {
            "secretsmanager:GetSecretValue": [
                DB_SECRET,
                SECRET_PARAMETERS["UploadPasswordSecretArn"],
            ],
            "ssm:GetParameter": [{"Fn::Sub": admin_parameter}],
        },
        "MigrationFunction": {"secretsmanager:GetSecretValue": [DB_SECRET]},
        # The report function reads the import sources too (credentials-import).
        "ReportFunction": {
            "secretsmanager:GetSecretValue": [
                DB_SECRET,
                SECRET_PARAMETERS["UploadPasswordSecretArn"],
            ],
            "ssm:GetParameter": [{"Fn::Sub": admin_parameter}],
            "sns:Publish": [{"Ref": "AlarmTopic"}],
        },
    }
    for name in FUNCTIONS:
        assert grants(resources, name) == expected[name], name
        env = environment(resources, name)
        assert env["DB_SECRET_ID"] == DB_SECRET
        assert env["DB_USER"] == ""  # never with DB_SECRET_ID (the handler refuses both)
        assert env.get("DB_MIGRATION_USER", "") == ""
        settings = settings_of(resources, name)
        assert settings.db_user is None and settings.db_secret_id == DB_SECRET
    for name in ("ApiFunction", "ReportFunction"):
        env = environment(resources, name)
        assert (
            env["UPLOAD_PASSWORD_SECRET"]
            == f"secretsmanager:{SECRET_PARAMETERS['UploadPasswordSecretArn']}"
        )
        assert env["ADMIN_TOKEN_SECRET"] == f"ssm:{SECRET_PARAMETERS['AdminTokenParameterName']}"


def test_migration_secret_goes_to_the_migration_function_only(transformed):
    resources = deployed(transformed, **SECRET_PARAMETERS, DbMigrationSecretArn=OWNER_SECRET)
    for name in FUNCTIONS:
        env = environment(resources, name)
        policies = json.dumps(resources[f"{name}Role"]["Properties"])
        if name == "MigrationFunction":
            assert env["DB_MIGRATION_SECRET_ID"] == OWNER_SECRET
            assert grants(resources, name)["secretsmanager:GetSecretValue"] == [
                DB_SECRET,
                OWNER_SECRET,
            ]
        else:
            assert "DB_MIGRATION_SECRET_ID" not in env
            assert OWNER_SECRET not in policies
    default = deployed(transformed, **SECRET_PARAMETERS)
    env = environment(default, "MigrationFunction")
    assert env["DB_MIGRATION_SECRET_ID"] == ""  # empty means unset: DB_SECRET_ID's user
    assert handler.load_settings({"DB_MIGRATION_SECRET_ID": ""}).db_migration_secret_id is None
    # With DbAuth iam the password secrets are not read, even when still given.
    iam = deployed(transformed, DbSecretArn=DB_SECRET, DbMigrationSecretArn=OWNER_SECRET)
    for name in FUNCTIONS:
        assert DB_SECRET not in json.dumps(iam[name]) + json.dumps(iam[f"{name}Role"])
        assert OWNER_SECRET not in json.dumps(iam[name]) + json.dumps(iam[f"{name}Role"])


@pytest.mark.parametrize(
    ("source", "variable", "action", "resource"),
    [
        (
            {"UploadPasswordSecretArn": SECRET_PARAMETERS["UploadPasswordSecretArn"]},
            "UPLOAD_PASSWORD_SECRET",
            "secretsmanager:GetSecretValue",
            SECRET_PARAMETERS["UploadPasswordSecretArn"],
        ),
        (
            {"UploadPasswordParameterName": "/queue/upload"},
            "UPLOAD_PASSWORD_SECRET",
            "ssm:GetParameter",
            {
                "Fn::Sub": "arn:${AWS::Partition}:ssm:${AWS::Region}:${AWS::AccountId}"
                ":parameter/queue/upload"
            },
        ),
        (
            {"AdminTokenSecretArn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:a-1"},
            "ADMIN_TOKEN_SECRET",
            "secretsmanager:GetSecretValue",
            "arn:aws:secretsmanager:us-east-1:123456789012:secret:a-1",
        ),
        (
            {"AdminTokenParameterName": "/queue/admin"},
            "ADMIN_TOKEN_SECRET",
            "ssm:GetParameter",
            {
                "Fn::Sub": "arn:${AWS::Partition}:ssm:${AWS::Region}:${AWS::AccountId}"
                ":parameter/queue/admin"
            },
        ),
    ],
    ids=["upload-secret", "upload-parameter", "admin-secret", "admin-parameter"],
)
def test_an_import_source_is_read_by_the_api_and_report_functions_alone(
    transformed, source, variable, action, resource
):
    """One import source set (with the IAM login): the API function (which checks its
    value while the database holds none) and the report function (credentials-import) may
    read exactly it, and with a KMS key decrypt with it; the migration function reads
    no store."""
    key = "arn:aws:kms:us-east-1:123456789012:key/0a1b2c3d-aaaa-bbbb-cccc-0123456789ab"
    resources = deployed(transformed, **source, SecretsKmsKeyArn=key)
    scheme = action.split(":")[0]
    value = next(iter(source.values()))
    for name in ("ApiFunction", "ReportFunction"):
        assert environment(resources, name)[variable] == f"{scheme}:{value}"
        granted = grants(resources, name)
        granted.pop("sns:Publish", None)  # the report's failure destination
        assert granted == {
            "rds-db:connect": [dbuser("queue_api")],
            action: [resource],
            "kms:Decrypt": [key],
        }, name
    migration = grants(resources, "MigrationFunction")
    assert not {a for a in migration if a.split(":")[0] in (scheme, "kms")}
    # The key alone, with nothing to read, grants nothing.
    assert "kms:Decrypt" not in grants(deployed(transformed, SecretsKmsKeyArn=key), "ApiFunction")


def test_the_rules_refuse_what_cannot_work(source):
    """CloudFormation refuses these parameter values before it changes anything."""
    assert broken_rules(source) == []  # the defaults, with the database's resource ID
    assert broken_rules(source, SECRET_PARAMETERS) == []
    assert broken_rules(source, {"DbResourceId": ""}) == ["IamAuthNeedsTheResourceId"]
    assert broken_rules(source, {"DbAuth": "secret"}) == ["SecretAuthNeedsTheSecret"]
    # A password login needs no resource ID.
    assert broken_rules(source, {**SECRET_PARAMETERS, "DbResourceId": ""}) == []
    both = {
        "UploadPasswordSecretArn": SECRET_PARAMETERS["UploadPasswordSecretArn"],
        "UploadPasswordParameterName": "/queue/upload",
    }
    assert broken_rules(source, both) == ["UploadPasswordHasAtMostOneSource"]
    both = {
        "AdminTokenSecretArn": SECRET_PARAMETERS["UploadPasswordSecretArn"],
        "AdminTokenParameterName": "/queue/admin",
    }
    assert broken_rules(source, both) == ["AdminTokenHasAtMostOneSource"]
    assert broken_rules(source, {"S3EndpointRouteTableIds": "rtb-0a1"}) == ["S3EndpointNeedsTheVpc"]
    # SnapStart restores containers with no AWS_* credential variables to sign an IAM
    # token with: it goes with a password login only.
    snap_start = {"ApiSnapStart": "PublishedVersions"}
    assert broken_rules(source, snap_start) == ["SnapStartNeedsSecretAuth"]
    assert broken_rules(source, {**SECRET_PARAMETERS, **snap_start}) == []


def test_the_database_login_parameters(source):
    parameters = source["Parameters"]
    assert parameters["DbAuth"]["AllowedValues"] == ["iam", "secret"]
    assert parameters["DbAuth"]["Default"] == "iam"
    assert parameters["DbUser"]["Default"] == "queue_api"
    assert parameters["DbMigrationUser"]["Default"] == "queue_owner"
    assert parameters["DbSecretArn"]["Default"] == parameters["DbResourceId"]["Default"] == ""
    pattern = parameters["DbResourceId"]["AllowedPattern"]
    for good in ("", "db-ABCDEFGHIJKLMNOPQRSTUVWXY0", "cluster-ABCDEFGHIJ0123", "prx-0123abcd"):
        assert re.fullmatch(pattern, good), good
    for bad in ("ABCDEF", "arn:aws:rds:us-east-1:123456789012:db:queue", "db-", "db-a/b"):
        assert not re.fullmatch(pattern, bad), bad
    for name in ("DbUser", "DbMigrationUser"):
        pattern = parameters[name]["AllowedPattern"]
        assert re.fullmatch(pattern, "queue_api")
        for bad in ("queue api", "a*", "1user", "x" * 64, "queue/api"):
            assert not re.fullmatch(pattern, bad), bad
    assert not re.fullmatch(parameters["DbUser"]["AllowedPattern"], "")  # iam needs a user


# --------------------------------------------------------------------------- logs


def test_functions_log_json_to_log_groups_with_retention(transformed):
    resources = deployed(transformed, LogRetentionDays="14")
    for name in FUNCTIONS:
        logging = resources[name]["Properties"]["LoggingConfig"]
        assert logging["LogFormat"] == "JSON"
        group = resources[logging["LogGroup"]["Ref"]]
        assert group["Type"] == "AWS::Logs::LogGroup"
        assert group["Properties"]["RetentionInDays"] == "14"
        assert group["DeletionPolicy"] == "Retain"


def test_http_api_access_logs(transformed):
    resources = deployed(transformed)
    (stage,) = resources_of_type({"Resources": resources}, "AWS::ApiGatewayV2::Stage").values()
    settings = stage["Properties"]["AccessLogSettings"]
    group = settings["DestinationArn"]["Fn::GetAtt"][0]
    assert resources[group]["Type"] == "AWS::Logs::LogGroup"
    assert resources[group]["Properties"]["RetentionInDays"] == 30
    # One JSON object per request once API Gateway fills in the $context variables.
    record = json.loads(re.sub(r"\$context\.[A-Za-z.]+", "x", settings["Format"]))
    assert {"requestId", "status", "lambdaRequestId", "integrationError"} <= set(record)


# --------------------------------------------------------------------------- alarms


def alarm_actions(resources: dict) -> dict[str, tuple]:
    return {
        name: (tuple(r["Properties"]["AlarmActions"]), tuple(r["Properties"]["OKActions"]))
        for name, r in resources.items()
        if r["Type"] == "AWS::CloudWatch::Alarm"
    }


def test_alarms_notify_a_topic_of_the_stack_by_default(transformed):
    resources = deployed(transformed)
    assert resources["AlarmTopic"]["Type"] == "AWS::SNS::Topic"
    assert "AlarmEmailSubscription" not in resources
    actions = alarm_actions(resources)
    # 3 functions x 2, the API's 5xx, ping, backlog, migration, the API's latency, the
    # API function's duration, a broken analyser and the fleet's failure ratio
    # (ActiveAnalysersAlarm is off by default).
    assert len(actions) == 14
    for name, (on_alarm, on_ok) in actions.items():
        assert on_alarm == on_ok == ({"Ref": "AlarmTopic"},), name


def test_an_existing_topic_and_an_email(transformed):
    topic = "arn:aws:sns:us-east-1:123456789012:ops"
    resources = deployed(transformed, AlarmTopicArn=topic, AlarmEmail="ops@example.org")
    assert "AlarmTopic" not in resources
    for on_alarm, on_ok in alarm_actions(resources).values():
        assert on_alarm == on_ok == (topic,)
    subscription = resources["AlarmEmailSubscription"]["Properties"]
    assert subscription == {"Protocol": "email", "Endpoint": "ops@example.org", "TopicArn": topic}


def test_every_function_has_error_and_throttle_alarms_and_the_api_5xx(transformed):
    resources = deployed(transformed)
    watched = set()
    for resource in resources.values():
        if resource["Type"] != "AWS::CloudWatch::Alarm":
            continue
        props = resource["Properties"]
        if props["Namespace"] == "AWS/Lambda" and props["MetricName"] != "Duration":
            (dimension,) = props["Dimensions"]
            assert dimension["Name"] == "FunctionName"
            watched.add((dimension["Value"]["Ref"], props["MetricName"]))
            assert props["Threshold"] == 0
            assert props["TreatMissingData"] == "notBreaching"
    assert watched == {(f, m) for f in FUNCTIONS for m in ("Errors", "Throttles")}
    # The API's 5xx, counted from its access log (tests/test_template_operations.py).
    api_5xx = resources["Api5xxAlarm"]["Properties"]
    assert (api_5xx["Namespace"], api_5xx["MetricName"]) == ("AnalysisQueue", "Api5xx")
    assert api_5xx["Statistic"] == "Sum"


def evaluate(datapoints: list[float | None], props: dict) -> str:
    """CloudWatch's M-of-N evaluation of the last EvaluationPeriods periods, with
    missing data treated as the alarm says."""
    window = datapoints[-int(props["EvaluationPeriods"]) :]
    needed = int(props.get("DatapointsToAlarm", props["EvaluationPeriods"]))
    threshold = float(props["Threshold"])
    breaching = 0
    for point in window:
        if point is None:
            breaching += props["TreatMissingData"] == "breaching"
        else:
            breaching += point > threshold
    return "ALARM" if breaching >= needed else "OK"


def test_analyser_offline_alarm_ignores_one_late_report(transformed):
    props = deployed(transformed)["NoAnalyserPingAlarm"]["Properties"]
    assert props["MetricName"] == "MinutesSinceLastPing"
    assert int(props["Period"]) == 3600
    online = 5.0
    assert evaluate([online, online, None], props) == "OK"  # one report late or lost
    assert evaluate([online, None, online], props) == "OK"
    assert evaluate([online, None, None], props) == "ALARM"  # the report stopped
    assert evaluate([online, 90.0, 150.0], props) == "ALARM"  # analysers offline
    assert evaluate([online, 30.0, 90.0], props) == "OK"  # one hour without a ping


def test_failed_migration_alarm_counts_the_handlers_log_record(transformed, monkeypatch, capsys):
    resources = deployed(transformed)
    metric_filter = resources["MigrationFailedMetricFilter"]["Properties"]
    assert metric_filter["LogGroupName"] == {"Ref": "MigrationLogGroup"}
    (transformation,) = metric_filter["MetricTransformations"]
    alarm = resources["MigrationFailedAlarm"]["Properties"]
    assert (alarm["Namespace"], alarm["MetricName"]) == (
        transformation["MetricNamespace"],
        transformation["MetricName"],
    )
    assert alarm["Threshold"] == 0 and alarm["Statistic"] == "Sum"
    # The filter `{ $.message = "..." }` selects the record a failed migration logs.
    field, expected = re.fullmatch(
        r'\{ \$\.(\w+) = "([^"]+)" \}', metric_filter["FilterPattern"]
    ).groups()
    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1:9/unreachable")
    handler.use_runtime(None)
    failed = handler.migrate(load_event("cfn-create.json") | {"ResponseURL": ""}, LambdaContext())
    assert failed["Status"] == "FAILED"
    passed = handler.migrate(load_event("cfn-delete.json") | {"ResponseURL": ""}, LambdaContext())
    assert passed["Status"] == "SUCCESS"
    handler.use_runtime(None)
    records = json_lines(capsys.readouterr().err)
    matching = [r for r in records if r.get(field) == expected]
    assert len(matching) == 1
    assert matching[0]["level"] == "ERROR"


def test_alarm_resources_are_accepted_by_sns_and_cloudwatch(transformed, monkeypatch):
    """The resolved topic, subscription and alarms, created through the AWS APIs (moto):
    each alarm's properties are valid PutMetricAlarm input and notify the topic."""
    from moto import mock_aws

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    resources = deployed(transformed, AlarmEmail="ops@example.org")
    with mock_aws():
        import boto3

        sns = boto3.client("sns", region_name="us-east-1")
        cloudwatch = boto3.client("cloudwatch", region_name="us-east-1")
        topic = sns.create_topic(Name="AlarmTopic")["TopicArn"]
        names = {"AlarmTopic": topic, "HttpApi": "a1b2c3", **{f: f"fn-{f}" for f in FUNCTIONS}}

        def physical(node):
            if isinstance(node, dict) and set(node) == {"Ref"}:
                return names[node["Ref"]]
            if isinstance(node, dict):
                return {k: physical(v) for k, v in node.items()}
            if isinstance(node, list):
                return [physical(v) for v in node]
            return node

        subscription = physical(resources["AlarmEmailSubscription"]["Properties"])
        sns.subscribe(
            TopicArn=subscription["TopicArn"],
            Protocol=subscription["Protocol"],
            Endpoint=subscription["Endpoint"],
        )
        alarms = {n: r for n, r in resources.items() if r["Type"] == "AWS::CloudWatch::Alarm"}
        for name, alarm in alarms.items():
            props = physical(alarm["Properties"])
            for key in ("Period", "EvaluationPeriods", "DatapointsToAlarm"):
                if key in props:
                    props[key] = int(props[key])
            props["Threshold"] = float(props["Threshold"])
            cloudwatch.put_metric_alarm(AlarmName=name, **props)
        described = cloudwatch.describe_alarms()["MetricAlarms"]
        assert {a["AlarmName"] for a in described} == set(alarms)
        assert all(a["AlarmActions"] == [topic] == a["OKActions"] for a in described)
        (subscribed,) = sns.list_subscriptions_by_topic(TopicArn=topic)["Subscriptions"]
        assert (subscribed["Protocol"], subscribed["Endpoint"]) == ("email", "ops@example.org")


# --------------------------------------------------------------------------- cold start


def test_snapstart_is_an_optional_parameter_on_a_published_version(source, transformed):
    param = source["Parameters"]["ApiSnapStart"]
    assert param["AllowedValues"] == ["None", "PublishedVersions"]
    assert param["Default"] == "None"
    for value in ("None", "PublishedVersions"):
        props = deployed(transformed, ApiSnapStart=value)["ApiFunction"]["Properties"]
        assert props["SnapStart"] == {"ApplyOn": value}
    resources = deployed(transformed)
    alias = resources["ApiFunctionAliaslive"]
    assert alias["Type"] == "AWS::Lambda::Alias"
    version = alias["Properties"]["FunctionVersion"]["Fn::GetAtt"][0]
    assert resources[version]["Type"] == "AWS::Lambda::Version"
    permissions = resources_of_type({"Resources": resources}, "AWS::Lambda::Permission")
    api_permissions = [p for n, p in permissions.items() if n.startswith("ApiFunction")]
    assert api_permissions
    assert all(
        p["Properties"]["FunctionName"] == {"Ref": "ApiFunctionAliaslive"} for p in api_permissions
    )


# --------------------------------------------------------------------------- README and docs/


def test_the_docs_point_nowhere_outside_the_repository():
    """README.md and docs/*.md name only files of this repository, and never the team's
    design note, which is not in it: the pages state its rules. (That every link and
    anchor resolves is tests/test_docs.py.)"""
    pages = [handler.HERE / "README.md", *sorted((handler.HERE / "docs").glob("*.md"))]
    assert len(pages) > 1
    for page in pages:
        text = page.read_text()
        # A page in docs/ reaches the README and the code through ../, and only so.
        for target in re.findall(r"\]\((\.\./[^)#\s]*)", text):
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(handler.HERE) and resolved.exists(), (page, target)
        outside = re.sub(r"\]\(\.\./[^)]*\)", "]()", text)
        assert "../" not in outside, page
        for path in set(re.findall(r"`((?:tests|bench|sql|events|docs)/[\w./-]+\.\w+)`", text)):
            assert (handler.HERE / path).is_file(), (page, path)
    for text in [*(page.read_text() for page in pages), (handler.HERE / "handler.py").read_text()]:
        assert "design note" not in text.lower()
        assert "shared/reference" not in text
