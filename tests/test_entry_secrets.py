"""Secrets, as the Lambda entry points read them: the API's tokens from Secrets Manager and
SSM through Powertools Parameters (moto), cached for SECRETS_MAX_AGE_SECONDS, the tokens
while the database holds none of its own (then the database's hash alone: sql/034,
tests/test_service_credentials.py), never logged by any entry point; the database's
credentials from Secrets Manager; boto3 imported only when a secret is read."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os

import pytest
from kit import SteppingClock, configure_function

import handler
from helpers import (
    EVENTS,
    LambdaContext,
    app_row,
    cfn_event,
    insert_app,
    invoke_api,
    invoke_migrate,
    json_answer,
    json_lines,
    load_event,
    one_record,
    run_python,
)
from live import TcpProxy

pytestmark = pytest.mark.usefixtures("lambda_container")


UPLOAD_SECRET = "sm-upload-8f3a1c9e77d2"


ADMIN_SECRET = "ssm-admin-5b60e4d21a9f"


@pytest.fixture
def secret_api(aws, database_url, monkeypatch):
    """The API with UPLOAD_PASSWORD in Secrets Manager and ADMIN_TOKEN in SSM."""
    aws.client("secretsmanager").create_secret(Name="queue/upload", SecretString=UPLOAD_SECRET)
    aws.client("ssm").put_parameter(Name="/queue/admin", Value=ADMIN_SECRET, Type="SecureString")
    configure_function(
        monkeypatch,
        "ApiFunction",
        database_url,
        UPLOAD_PASSWORD="",
        ADMIN_TOKEN="",
        UPLOAD_PASSWORD_SECRET="secretsmanager:queue/upload",
        ADMIN_TOKEN_SECRET="ssm:/queue/admin",
    )
    container_with_a_clock()

    def invoke(name: str, token: str | None) -> dict:
        return invoke_api(name, {"authorization": None if token is None else f"Bearer {token}"})

    return invoke


def container_with_a_clock() -> handler.Runtime:
    """A new container (Runtime) from the environment, with a clock the test advances
    (runtime().clock.advance) instead of waiting."""
    return handler.use_runtime(handler.Runtime(handler.load_settings(), clock=SteppingClock()))


@pytest.fixture
def secret_reads(aws, monkeypatch):
    """Every request any boto3 client sends (moto answers them): (operation, the secret
    or parameter, VersionStage) in order. Counted where every client makes its calls."""
    import botocore.client

    calls: list[tuple[str, str, str | None]] = []
    real = botocore.client.BaseClient._make_api_call

    def counting(client, operation, params):
        if operation in ("GetSecretValue", "GetParameter"):
            named = params.get("SecretId") or params.get("Name")
            calls.append((operation, named, params.get("VersionStage")))
        return real(client, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", counting)
    return calls


def reads_since(calls: list, start: int) -> collections.Counter:
    return collections.Counter(calls[start:])


# What one refresh reads: the Secrets Manager secret's current and previous versions, the
# SSM parameter's one value.
UPLOAD_CURRENT = ("GetSecretValue", "queue/upload", None)
UPLOAD_PREVIOUS = ("GetSecretValue", "queue/upload", "AWSPREVIOUS")
ADMIN_VALUE = ("GetParameter", "/queue/admin", None)


def test_tokens_from_secrets_manager_and_ssm(secret_api, sql):
    assert handler.settings().upload_password is None
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    assert secret_api("ping.json", "local-upload-password")["statusCode"] == 401
    assert secret_api("ping.json", ADMIN_SECRET)["statusCode"] == 401
    assert secret_api("ping.json", None)["statusCode"] == 401
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 201
    assert secret_api("add-app.json", UPLOAD_SECRET)["statusCode"] == 401
    assert secret_api("queue.json", UPLOAD_SECRET)["body"] == "com.example.app"
    assert app_row(sql, "com.example.app")["status"] == "processing"


def test_secrets_are_cached_for_max_age(secret_api, aws, secret_reads):
    """Within SECRETS_MAX_AGE_SECONDS (300) a token that matches is checked against the
    cached value, without asking AWS, even after the secrets are gone."""
    assert handler.settings().secrets_max_age_seconds == 300
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 201
    warm = len(secret_reads)
    for _ in range(5):
        assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
        assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 200
    aws.client("secretsmanager").delete_secret(
        SecretId="queue/upload", ForceDeleteWithoutRecovery=True
    )
    aws.client("ssm").delete_parameter(Name="/queue/admin")
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 200
    assert len(secret_reads) == warm


def test_a_rotated_secret_is_read_after_max_age_until_imported(secret_api, aws, monkeypatch):
    """While the database holds no credential, the secret's current value is the token
    (no previous version: the database's rotation has the overlap), read again once the
    cached value is SECRETS_MAX_AGE_SECONDS old; once imported, the secret changes nothing."""
    monkeypatch.setenv("SECRETS_MAX_AGE_SECONDS", "0")
    handler.use_runtime(None)
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 200
    aws.client("secretsmanager").put_secret_value(
        SecretId="queue/upload", SecretString="rotated-upload"
    )
    assert secret_api("ping.json", "rotated-upload")["statusCode"] == 200
    assert secret_api("ping.json", UPLOAD_SECRET)["statusCode"] == 401
    imported = handler.report(
        {"command": "credentials-import", "name": "upload-password"}, LambdaContext()
    )
    assert imported["from"] == "UPLOAD_PASSWORD_SECRET"
    aws.client("secretsmanager").put_secret_value(
        SecretId="queue/upload", SecretString="rotated-twice"
    )
    assert secret_api("ping.json", "rotated-twice")["statusCode"] == 401
    assert secret_api("ping.json", "rotated-upload")["statusCode"] == 200


def test_a_rotation_needs_no_secret_once_the_database_holds_the_credential(secret_api, aws):
    """The configured secret is read by a rotation only while the database holds none: a
    secret deleted since (the upgrade's last step, docs/deploy.md) must not stop the
    leaked-token runbook's rotation with --overlap 0."""
    operator = handler.Operator("t", "t")
    first = handler.rotate_credential(handler.api_connection(), operator, "upload-password", 0)
    aws.client("secretsmanager").delete_secret(
        SecretId="queue/upload", ForceDeleteWithoutRecovery=True
    )
    second = handler.rotate_credential(handler.api_connection(), operator, "upload-password", 0)
    assert secret_api("ping.json", second["token"])["statusCode"] == 200
    assert secret_api("ping.json", first["token"])["statusCode"] == 401


def test_unreadable_secret_answers_503(secret_api, aws, capsys):
    aws.client("secretsmanager").delete_secret(
        SecretId="queue/upload", ForceDeleteWithoutRecovery=True
    )
    answer = secret_api("ping.json", UPLOAD_SECRET)
    assert answer["statusCode"] == 503
    assert json_answer(answer) == {"detail": "the server cannot read its token for this route"}
    # The admin route's token (SSM) is still there.
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 201
    logs = json_lines(capsys.readouterr().err)
    record = one_record(logs, "secret unavailable")
    assert record["secret"] == "secretsmanager:queue/upload"
    assert record["level"] == "WARNING"
    # The report's import of the function's own value names the secret it could not read.
    unreadable = "cannot read the secret secretsmanager:queue/upload"
    with pytest.raises(handler.SecretUnavailable, match=unreadable):
        handler.report(
            {"command": "credentials-import", "name": "upload-password"}, LambdaContext()
        )


def test_a_public_route_stays_public_when_the_admin_secret_is_unreadable(secret_api, aws, sql):
    """GET /apps/{appId} takes the admin token as optional: a token the server cannot
    check (its secret gone) is no admin token, and the answer is the public one, not 503."""
    insert_app(sql, "com.example.app")
    aws.client("ssm").delete_parameter(Name="/queue/admin")
    answer = secret_api("get-app.json", ADMIN_SECRET)
    assert answer["statusCode"] == 200, answer
    assert json_answer(answer) == json_answer(secret_api("get-app.json", None))
    assert secret_api("add-app.json", ADMIN_SECRET)["statusCode"] == 503


def test_binary_secret_is_not_a_token(secret_api, aws):
    aws.client("secretsmanager").put_secret_value(SecretId="queue/upload", SecretBinary=b"x")
    answer = secret_api("ping.json", "x")
    assert answer["statusCode"] == 503
    assert json_answer(answer) == {"detail": "the server has no token configured for this route"}


def test_secret_values_are_never_logged(secret_api, database_url, caplog, capsys, response_url):
    caplog.set_level(logging.DEBUG)
    answers = [
        secret_api("ping.json", UPLOAD_SECRET),
        secret_api("ping.json", UPLOAD_SECRET + "x"),
        secret_api("ping.json", ADMIN_SECRET),
        secret_api("queue.json", "wrong"),
        secret_api("queue.json", None),
        secret_api("add-app.json", UPLOAD_SECRET),
        secret_api("add-app.json", ADMIN_SECRET),
        secret_api("upload-analysis.json", ADMIN_SECRET),
        secret_api("report-failure.json", UPLOAD_SECRET),
        secret_api("get-app.json", UPLOAD_SECRET),
    ]
    assert [a["statusCode"] for a in answers] == [200, 401, 401, 401, 401, 401, 201, 401, 200, 200]
    invoke_migrate(cfn_event("cfn-update.json", response_url))
    assert response_url.reply()["Status"] == "SUCCESS"
    handler.report(load_event("schedule.json"), LambdaContext())

    captured = capsys.readouterr()
    logged = captured.out + captured.err + caplog.text
    assert "queue status" in captured.err  # the capture works
    for record in caplog.records:
        logged += " ".join(str(arg) for arg in (record.args or ()))
    for secret in (UPLOAD_SECRET, ADMIN_SECRET):
        assert secret not in logged
        for answer in answers:
            assert secret not in answer["body"]
            assert secret not in json.dumps(answer["headers"])


def test_database_credentials_from_secrets_manager(aws, database_url, monkeypatch):
    with contextlib.ExitStack() as stack:
        check_database_credentials(aws, database_url, monkeypatch, stack)


def check_database_credentials(aws, database_url, monkeypatch, stack):
    aws.client("secretsmanager").create_secret(
        Name="queue/db", SecretString=json.dumps({"username": "postgres", "password": "pw-0x5e"})
    )
    aws.client("secretsmanager").create_secret(
        Name="queue/db-other",
        SecretString=json.dumps({"username": "no_such_role_7e2", "password": "pw-0x5f"}),
    )
    target = handler.connection_arguments(handler.load_settings({"DATABASE_URL": database_url}))
    # DB_HOST is a TCP address: a proxy gives the socket-only embedded server one.
    proxy = stack.enter_context(TcpProxy(target))
    env = {
        "DB_HOST": "127.0.0.1",
        "DB_PORT": str(proxy.port),
        "DB_NAME": target["database"],
        "DB_SECRET_ID": "queue/db",
        "DB_SSLMODE": "disable",
    }
    arguments = handler.connection_arguments(handler.load_settings(env))
    assert arguments == {
        "user": "postgres",
        "password": "pw-0x5e",
        "host": env["DB_HOST"],
        "port": int(env["DB_PORT"]),
        "database": env["DB_NAME"],
        "ssl_context": None,
    }
    missing = {k: v for k, v in env.items() if k != "DB_SECRET_ID"}
    with pytest.raises(handler.ConfigError, match="DB_SECRET_ID"):
        handler.connection_arguments(handler.load_settings(missing))

    # Over TCP, the service connects with the secret's user (trust auth ignores the
    # password): postgres works, a user that does not exist gets 503.
    for name in ("DATABASE_URL", "UPLOAD_PASSWORD", "ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    handler.use_runtime(None)
    healthz = handler.api(load_event("healthz.json"), LambdaContext())
    assert healthz["statusCode"] == 200
    assert json.loads(healthz["body"]) == {"status": "ok", "version": handler.package_version()}
    monkeypatch.setenv("DB_SECRET_ID", "queue/db-other")
    handler.use_runtime(None)
    denied = handler.api(load_event("healthz.json"), LambdaContext())
    assert denied["statusCode"] == 503
    assert "pw-0x5f" not in denied["body"]


IMPORT_PROBE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
event = json.load(open(sys.argv[2]))

import handler
answer = handler.api(event, handler.LocalContext(60, "probe"))
seen = {"status": answer["statusCode"], "body": answer["body"],
        "boto3": "boto3" in sys.modules,
        "parameters": "aws_lambda_powertools.utilities.parameters" in sys.modules}
# Now the token comes from Secrets Manager (a closed loopback port: the read fails).
os.environ.pop("UPLOAD_PASSWORD")
os.environ["UPLOAD_PASSWORD_SECRET"] = "secretsmanager:queue/upload"
handler.use_runtime(None)
answer = handler.api(event, handler.LocalContext(60, "probe"))
seen.update(after_status=answer["statusCode"], after_boto3="boto3" in sys.modules)
print(json.dumps(seen))
"""


def test_boto3_is_imported_only_when_a_secret_is_read(database_url, sql):
    insert_app(sql, "com.example.app")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "DATABASE_URL": database_url,
        "UPLOAD_PASSWORD": "local-upload-password",
        "ADMIN_TOKEN": "local-admin-token",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    probe = run_python(IMPORT_PROBE, str(handler.HERE), str(EVENTS / "queue.json"), env=env)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert (seen["status"], seen["body"]) == (200, "com.example.app")
    assert seen["boto3"] is False
    assert seen["parameters"] is False
    assert seen["after_status"] == 503
    assert seen["after_boto3"] is True


INIT_PROBE = """
import json, socket, sys, threading
listener = socket.socket()
listener.bind(("127.0.0.1", int(sys.argv[2])))
listener.listen()
listener.settimeout(0.5)
arrived = []
def accept():
    try:
        arrived.append(listener.accept())
    except OSError:
        pass
watcher = threading.Thread(target=accept)
watcher.start()
sys.path.insert(0, sys.argv[1])
import handler
from aws_lambda_powertools.utilities.parameters.constants import DEFAULT_PROVIDERS
watcher.join()
print(json.dumps({"boto3": "boto3" in sys.modules, "providers": sorted(DEFAULT_PROVIDERS),
                  "requests": len(arrived), "runtime": handler.use_runtime(None) is not None}))
"""


def free_loopback_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_lambda_init_builds_the_secret_clients_and_sends_nothing():
    """Lambda's Init (the import, with AWS_LAMBDA_FUNCTION_NAME set) builds the clients
    of the stores the secrets are in, so the first request only fetches (and SnapStart
    snapshots them); it sends no request, opens no connection, reads no secret."""
    port = free_loopback_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "AWS_LAMBDA_FUNCTION_NAME": "analysis-queue-ApiFunction",
        "DATABASE_URL": "postgresql://postgres@127.0.0.1:9/unreachable",
        "UPLOAD_PASSWORD_SECRET": "secretsmanager:queue/upload",
        "ADMIN_TOKEN_SECRET": "ssm:/queue/admin",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    probe = run_python(INIT_PROBE, str(handler.HERE), str(port), env=env)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert seen == {"boto3": True, "providers": ["secrets", "ssm"], "requests": 0, "runtime": False}
    # Outside Lambda (the CLI, the tests) the import builds none.
    del env["AWS_LAMBDA_FUNCTION_NAME"]
    probe = run_python(INIT_PROBE, str(handler.HERE), str(free_loopback_port()), env=env)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout.splitlines()[-1])["providers"] == []


def test_a_restored_snapshot_drops_the_connection_and_the_secrets(aws, database_url, monkeypatch):
    """SnapStart's after-restore hook: a container restored from the shared snapshot
    connects and reads its secrets afresh."""
    aws.client("secretsmanager").create_secret(Name="queue/upload", SecretString="pw-restore")
    configure_function(
        monkeypatch,
        "ApiFunction",
        database_url,
        UPLOAD_PASSWORD="",
        UPLOAD_PASSWORD_SECRET="secretsmanager:queue/upload",
    )
    assert invoke_api("ping.json", {"authorization": "Bearer pw-restore"})["statusCode"] == 200
    before = handler.runtime()
    aws.client("secretsmanager").put_secret_value(SecretId="queue/upload", SecretString="pw-new")
    handler.after_snapshot_restore()
    assert handler.runtime() is not before
    assert invoke_api("ping.json", {"authorization": "Bearer pw-new"})["statusCode"] == 200
