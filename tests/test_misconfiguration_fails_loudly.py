"""Misconfiguration fails loudly and names the variable.

* `serve` and the CLI refuse to start: exit status 1, the variable on stderr, no server.
* On Lambda the API answers 503 saying the service is misconfigured; the variable is in
  the log record, not in the body.
* The migration custom resource answers FAILED with a reason naming the variable.
"""

from __future__ import annotations

import json
import os

import pytest
from kit import configure_service

import handler
from helpers import (
    LambdaContext,
    ResponseURL,
    call_cli,
    cfn_event,
    load_event,
    output_records,
    run_cli,
)
from live import free_port

# (variable, bad value, what the message must say)
MISCONFIGURATIONS = [
    ("STALE_ANALYSIS_DAYS", "0", "STALE_ANALYSIS_DAYS must be at least 1"),
    ("PROCESSING_TIMEOUT_MINUTES", "two hours", "PROCESSING_TIMEOUT_MINUTES must be an integer"),
    ("CURRENT_ANALYSIS_VERSION", "-4", "CURRENT_ANALYSIS_VERSION must be at least 1"),
    ("MAX_BODY_BYTES", "5MB", "MAX_BODY_BYTES must be an integer"),
    ("DB_SSLMODE", "prefer", "DB_SSLMODE must be one of"),
    ("MIGRATION_LOCK_TIMEOUT", "ten seconds", "MIGRATION_LOCK_TIMEOUT must be a duration"),
    ("UPLOAD_PASSWORD_SECRET", "vault:queue/upload", "UPLOAD_PASSWORD_SECRET must be"),
    ("ADMIN_TOKEN_SECRET", "ssm:", "ADMIN_TOKEN_SECRET must be"),
    ("RETRY_BACKOFF", "1h,soon", "RETRY_BACKOFF must be off or durations such as 1h,6h,24h"),
    ("BROKEN_ANALYSER_FAILURES", "0", "BROKEN_ANALYSER_FAILURES must be at least 1"),
    ("PAUSE_BROKEN_ANALYSERS", "yes", "PAUSE_BROKEN_ANALYSERS must be true or false"),
]
IDS = [name for name, _, _ in MISCONFIGURATIONS]


@pytest.mark.parametrize(("name", "value", "message"), MISCONFIGURATIONS, ids=IDS)
def test_load_settings_names_the_variable(name, value, message):
    with pytest.raises(handler.ConfigError, match=message):
        handler.load_settings({"DATABASE_URL": "postgresql://u@127.0.0.1/q", name: value})


# RETRY_BACKOFF as an operator might mistype it: each refused, none read as "off" or as
# fewer steps than written.
BAD_RETRY_BACKOFFS = [
    "soon",
    "0",
    "0s",
    "367d",
    "1h,",
    ",1h",
    "1h,,6h",
    "1h 6h",
    "1h;6h",
    "-1h",
    "1.5h",
    "1w",
    "never",
    "offf",
    ",".join(["1h"] * 21),
]


@pytest.mark.parametrize("value", BAD_RETRY_BACKOFFS)
def test_a_retry_backoff_it_cannot_read_is_refused(value):
    with pytest.raises(handler.ConfigError, match="RETRY_BACKOFF"):
        handler.load_settings(
            {"DATABASE_URL": "postgresql://u@127.0.0.1/q", "RETRY_BACKOFF": value}
        )


@pytest.mark.parametrize(
    ("value", "steps"),
    [
        ("", (3600, 6 * 3600, 86400)),  # the default: 1h,6h,1d
        ("off", ()),
        (" OFF ", ()),
        ("30m", (1800,)),
        ("90s, 2h ,1d", (90, 7200, 86400)),
        ("366d", (366 * 86400,)),
        (",".join(["1h"] * 20), (3600,) * 20),
    ],
)
def test_a_retry_backoff_is_read_as_written(value, steps):
    config = handler.load_settings(
        {"DATABASE_URL": "postgresql://u@127.0.0.1/q", "RETRY_BACKOFF": value}
    )
    assert config.policy.retry_backoff == steps


@pytest.mark.parametrize(
    ("failures", "pause", "expected"),
    [("", "", (5, False)), ("1", "true", (1, True)), ("12", " FALSE ", (12, False))],
)
def test_broken_analyser_settings_are_read_as_written(failures, pause, expected):
    config = handler.load_settings(
        {
            "DATABASE_URL": "postgresql://u@127.0.0.1/q",
            "BROKEN_ANALYSER_FAILURES": failures,
            "PAUSE_BROKEN_ANALYSERS": pause,
        }
    )
    assert (config.broken_analyser_failures, config.pause_broken_analysers) == expected


def test_good_settings_load():
    config = handler.load_settings(
        {
            "DATABASE_URL": "postgresql://u@127.0.0.1/q",
            "DB_SSLMODE": "verify-ca",
            "MIGRATION_LOCK_TIMEOUT": "500ms",
            "UPLOAD_PASSWORD_SECRET": "secretsmanager:queue/upload",
            "ADMIN_TOKEN_SECRET": "ssm:/queue/admin",
        }
    )
    assert (config.db_sslmode, config.migration_lock_timeout) == ("verify-ca", "500ms")


@pytest.mark.parametrize(("name", "value", "message"), MISCONFIGURATIONS, ids=IDS)
def test_serve_refuses_to_start(database_url, name, value, message):
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url, name: value}
    out = run_cli("serve", "--port", str(port), env=env)
    assert out.returncode == 1, out.stderr
    assert f"error: misconfigured: {message}" in out.stderr
    assert "Uvicorn running" not in out.stderr
    assert "migrations applied" not in out.stderr


def test_cli_commands_refuse_to_start(database_url):
    env = {**os.environ, "DATABASE_URL": database_url, "STALE_ANALYSIS_DAYS": "0"}
    for args in (
        ("queue-status",),
        ("priority-report",),
        ("queue-refetch",),
        ("migrate",),
        ("why", "com.example.app"),
        ("queue-hold", "com.example.app"),
        ("queue-release", "com.example.app"),
        ("queue-pause",),
        ("queue-resume",),
        ("analysers", "pause", "pi-kitchen"),
        ("analysers", "resume", "pi-kitchen"),
    ):
        out = call_cli(*args, env=env)
        assert out.returncode == 1, (args, out.stdout)
        assert "error: misconfigured: STALE_ANALYSIS_DAYS must be at least 1" in out.stderr
        assert out.stdout == ""


def test_cli_names_a_missing_secret_id(database_url):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DB_SECRET_ID")}
    out = call_cli("queue-status", env={**env, "DB_HOST": "db.example.internal"})
    assert out.returncode == 1
    assert "error: misconfigured: DB_SECRET_ID" in out.stderr


@pytest.mark.parametrize(("name", "value", "message"), MISCONFIGURATIONS, ids=IDS)
def test_lambda_api_answers_503_and_logs_the_variable(
    database_url, monkeypatch, capsys, name, value, message
):
    configure_service(monkeypatch, database_url, **{name: value})
    for event in ("ping.json", "queue.json", "healthz.json", "get-app.json"):
        answer = handler.api(load_event(event), LambdaContext("analysis-queue-ApiFunction"))
        assert answer["statusCode"] == 503, (event, answer)
        body = json.loads(answer["body"])
        assert body == {
            "detail": "the service is misconfigured; its operators can see why in its logs"
        }
        assert name not in answer["body"]
    logs, _ = output_records(capsys.readouterr())
    misconfigured = [record for record in logs if record.get("message") == "misconfigured"]
    assert len(misconfigured) == 4
    for record in misconfigured:
        assert record["level"] == "ERROR"
        assert message in record["error"]


def test_lambda_api_names_a_missing_ca_bundle_in_the_log(database_url, monkeypatch, capsys):
    for variable in ("DATABASE_URL", "UPLOAD_PASSWORD", "ADMIN_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    configure_service(monkeypatch, database_url)
    monkeypatch.delenv("DATABASE_URL")
    for variable, value in {
        "DB_HOST": "db.example.internal",
        "DB_SECRET_ID": "queue/db",
        "DB_SSLROOTCERT": "/opt/certs/missing-bundle.pem",
    }.items():
        monkeypatch.setenv(variable, value)
    handler.use_runtime(None)
    monkeypatch.setattr(
        handler, "fetch_secret", lambda *_, **__: {"username": "u", "password": "p-7f3e"}
    )
    answer = handler.api(load_event("healthz.json"), LambdaContext())
    assert answer["statusCode"] == 503
    assert "DB_SSLROOTCERT" not in answer["body"]
    assert "misconfigured" in answer["body"]
    logs, _ = output_records(capsys.readouterr())
    (record,) = [r for r in logs if r.get("message") == "misconfigured"]
    assert "DB_SSLROOTCERT" in record["error"]
    assert "p-7f3e" not in json.dumps(logs)


@pytest.mark.parametrize(("name", "value", "message"), MISCONFIGURATIONS[:6], ids=IDS[:6])
def test_migration_failed_reason_names_the_variable(
    database_url, monkeypatch, name, value, message
):
    configure_service(monkeypatch, database_url, **{name: value})
    server = ResponseURL()
    try:
        handler.migrate(
            cfn_event("cfn-update.json", server), LambdaContext("analysis-queue-Migration")
        )
        reply = server.reply()
    finally:
        server.close()
    assert reply["Status"] == "FAILED"
    assert reply["Reason"].startswith(f"migration failed: misconfigured: {message}")
