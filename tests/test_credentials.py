"""Credentials that rotate, and least privilege.

* Rotation: on a PostgreSQL that checks passwords (tests/pg_password.py), the database
  secret in Secrets Manager (moto) and the role's password change together while
  clients call the Lambda API entry and the service's connections are killed (new
  containers): zero failed requests, because an authentication failure (28P01) re-reads
  the secret bypassing the cache. Without the re-read the same scenario fails.
* Least privilege: docs/operations.md's GRANT block, run as written, gives a role that serves
  every route and the report, cannot change the schema, and can use what a later
  ledger file creates. Migrations use the owner's secret (DB_MIGRATION_SECRET_ID).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import uuid
from urllib.parse import urlsplit

import kit
import pg8000.native
import pytest
from kit import ADMIN, ANALYSER, Databases, configure_service
from pg_password import PasswordServer

import handler
from helpers import (
    LambdaContext,
    app_row,
    call_cli,
    connect,
    database_at,
    invoke_api,
    json_answer,
    load_event,
    migrate,
)

OPERATIONS = handler.HERE / "docs" / "operations.md"


@pytest.fixture
def secrets_manager(aws):
    return aws.client("secretsmanager")


@pytest.fixture(scope="module")
def password_server():
    server = PasswordServer()
    yield server
    server.stop()


def documented_grants() -> str:
    """The SQL block under docs/operations.md's least-privilege heading, as written there."""
    text = OPERATIONS.read_text()
    section = text.split("\n## Database roles: least privilege\n", 1)[1]
    return re.search(r"```sql\n(.*?)```", section, re.S).group(1)


def grant_role(admin: pg8000.native.Connection, role: str, password: str, database: str) -> None:
    owner = admin.run("SELECT current_user")[0][0]
    block = documented_grants()
    block = re.sub(r"\bqueue_app\b", role, block)
    block = re.sub(r"\bqueue_owner\b", owner, block)
    block = re.sub(r"\bON DATABASE analysis\b", f"ON DATABASE {database}", block)
    block = block.replace("'change-me'", pg8000.native.literal(password))
    assert role in block and database in block and password in block
    admin.execute_simple(block)


def drop_role(admin: pg8000.native.Connection, role: str) -> None:
    admin.run(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :role",
        role=role,
    )
    admin.run(f"DROP OWNED BY {pg8000.native.identifier(role)}")
    admin.run(f"DROP ROLE {pg8000.native.identifier(role)}")


# ---------------------------------------------------------------------------------------
# Rotation
# ---------------------------------------------------------------------------------------


@pytest.fixture
def rotating(password_server, secrets_manager, monkeypatch):
    """A migrated database on the password server, a role `queue_app_*` with docs/operations.md's
    grants, its secret in moto, and the service configured as on AWS (DB_*)."""
    role = f"queue_app_{uuid.uuid4().hex[:8]}"
    databases = Databases(password_server.admin_url())
    url = databases.create(migrated=False, prefix="rot")
    name = urlsplit(url).path.lstrip("/")
    migrate(url)
    owner_db = database_at(url)
    owner = owner_db.raw_connection
    with owner() as connection:
        grant_role(connection, role, "pw-initial-0", name)
    secrets_manager.create_secret(
        Name="queue/db", SecretString=json.dumps({"username": role, "password": "pw-initial-0"})
    )
    for variable in ("DATABASE_URL", "UPLOAD_PASSWORD", "ADMIN_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    configure_service(monkeypatch, "unused")
    monkeypatch.delenv("DATABASE_URL")
    for variable, value in {
        "DB_HOST": "127.0.0.1",
        "DB_PORT": str(password_server.port),
        "DB_NAME": name,
        "DB_SECRET_ID": "queue/db",
        "DB_SSLMODE": "disable",
    }.items():
        monkeypatch.setenv(variable, value)
    handler.use_runtime(None)

    def rotate(password: str) -> None:
        # Both together, as one change seen from outside: the new password takes
        # effect for new connections when the transaction commits, right after the
        # secret holds it.
        with owner() as connection:
            connection.run("BEGIN")
            connection.run(
                f"ALTER ROLE {pg8000.native.identifier(role)} PASSWORD "
                + pg8000.native.literal(password)
            )
            secrets_manager.put_secret_value(
                SecretId="queue/db",
                SecretString=json.dumps({"username": role, "password": password}),
            )
            connection.run("COMMIT")

    yield {"rotate": rotate, "role": role, "owner": owner}
    handler.use_runtime(None)
    owner_db.discard()
    databases.drop_all()  # and the role's grants in it
    admin = connect(password_server.admin_url())
    try:
        admin.run(f"DROP ROLE {pg8000.native.identifier(role)}")
    finally:
        admin.close()


def test_password_rotation_under_load_fails_no_request(rotating, monkeypatch):
    fetches = {"fresh": 0}
    real_fetch = handler.fetch_secret

    def counting_fetch(*args, **kwargs):
        if kwargs.get("fresh"):
            fetches["fresh"] += 1
        return real_fetch(*args, **kwargs)

    monkeypatch.setattr(handler, "fetch_secret", counting_fetch)
    assert invoke_api("add-app.json", ADMIN)["statusCode"] == 201

    clients, per_client, rotations = 4, 60, 3
    statuses: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    progress = threading.Semaphore(0)

    def client(index: int) -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())  # Mangum runs on this thread's loop
        events = [
            ("ping.json", ANALYSER),
            ("queue.json", ANALYSER),
            ("get-app.json", None),
            ("healthz.json", None),
        ]
        try:
            for call in range(per_client):
                if call % 3 == 0:
                    # A new container: the next request opens a new connection with
                    # whatever password the secret cache holds.
                    handler.api_connection().discard()
                name, headers = events[(index + call) % len(events)]
                statuses.append((name, invoke_api(name, headers)["statusCode"]))
                progress.release()
        except BaseException as error:  # asserted in the main thread
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    total = clients * per_client
    try:
        for rotation in range(1, rotations + 1):
            # Rotate after each quarter of the requests (counted, not timed).
            for _ in range(total // (rotations + 1)):
                assert progress.acquire(timeout=120), "the clients stopped making progress"
            rotating["rotate"](f"pw-rotated-{rotation}")
    finally:
        for thread in threads:
            thread.join(timeout=180)
    assert not errors, errors
    assert len(statuses) == total
    failed = [(name, status) for name, status in statuses if status != 200]
    assert failed == []
    # The re-read happened (at least once per rotation), and the clients did reconnect.
    assert fetches["fresh"] >= rotations


def test_without_the_reread_a_rotation_fails_new_connections(rotating):
    """The scenario above is a real test: the cached password is refused after a
    rotation, and only the fresh read gets a connection."""
    assert invoke_api("healthz.json")["statusCode"] == 200
    rotating["rotate"]("pw-rotated-x")
    handler.api_connection().discard()
    stale = handler.SharedConnection(lambda: handler.connection_arguments(handler.settings()))
    with pytest.raises(handler.DatabaseUnavailable) as caught:
        stale.run("SELECT 1")
    assert handler.sqlstate(caught.value.__cause__) == "28P01"
    assert invoke_api("healthz.json")["statusCode"] == 200  # the service re-reads


def test_a_wrong_password_still_fails_after_one_reread(rotating, secrets_manager, capsys):
    rotating["rotate"]("pw-rotated-y")
    secrets_manager.put_secret_value(
        SecretId="queue/db",
        SecretString=json.dumps({"username": rotating["role"], "password": "pw-wrong-31"}),
    )
    answer = invoke_api("healthz.json")
    assert answer["statusCode"] == 503
    logged = capsys.readouterr().err
    assert logged.count("database authentication failed; reading the secret again") == 1
    assert "pw-wrong-31" not in logged + answer["body"]
    assert "pw-rotated-y" not in logged


# ---------------------------------------------------------------------------------------
# Least privilege
# ---------------------------------------------------------------------------------------


@pytest.fixture
def queue_role(database_url, server_url, monkeypatch):
    """The documented role on the test database; the service configured to run as it."""
    role = f"queue_app_{uuid.uuid4().hex[:8]}"
    database = urlsplit(database_url).path.lstrip("/")
    owner = connect(database_url)
    grant_role(owner, role, "pw-app-1", database)
    url = re.sub(r"//[^@/]*@", f"//{role}:pw-app-1@", database_url, count=1)
    configure_service(monkeypatch, url)
    yield {"role": role, "url": url, "owner": owner}
    handler.use_runtime(None)
    drop_role(owner, role)
    owner.close()


@pytest.mark.private_database  # queue_role grants on its schema and tables
def test_healthz_as_a_role_that_may_not_read_the_ledger(queue_role, sql):
    """The documented block lets /healthz read the ledger; a role granted before it
    (the queue's tables only) gets ok when a claim could run, never a 500."""
    assert json_answer(invoke_api("healthz.json")) == {
        "status": "ok",
        "version": handler.package_version(),
    }
    sql.run(f"REVOKE SELECT ON schema_migrations FROM {queue_role['role']}")
    handler.use_runtime(None)
    assert json_answer(invoke_api("healthz.json"))["status"] == "ok"
    sql.run(
        "DELETE FROM schema_migrations"
        " WHERE filename = (SELECT max(filename) FROM schema_migrations)"
    )
    assert json_answer(invoke_api("healthz.json"))["status"] == "ok"  # it cannot tell
    sql.run(f"GRANT SELECT ON schema_migrations TO {queue_role['role']}")
    assert json_answer(invoke_api("healthz.json"))["status"] == "not migrated"


@pytest.mark.private_database  # queue_role grants on its schema and tables
def test_the_api_and_report_run_as_the_queue_role(queue_role, sql):
    assert invoke_api("healthz.json")["statusCode"] == 200
    whoami = handler.api_connection().run("SELECT current_user")[0][0]
    assert whoami == queue_role["role"]
    answers = {
        name: invoke_api(name, headers)
        for name, headers in (
            ("ping.json", ANALYSER),
            ("add-app.json", ADMIN),
            ("queue.json", ANALYSER),
            # A failure first, then a success replacing it (a failure after the app's
            # success with no claim open would be refused: docs/queue.md, "Results").
            ("report-failure.json", ANALYSER),
            ("queue-exact-app.json", ANALYSER),
            ("upload-analysis.json", ANALYSER),
            ("get-app.json", None),
            ("healthz-analyser.json", None),
        )
    }
    assert {name: a["statusCode"] for name, a in answers.items()} == {
        "ping.json": 200,
        "add-app.json": 201,
        "queue.json": 200,
        "upload-analysis.json": 200,
        "queue-exact-app.json": 200,
        "report-failure.json": 200,
        "get-app.json": 200,
        "healthz-analyser.json": 200,
    }
    assert app_row(sql, "com.example.app")["status"] == "analysed"
    sql.run("INSERT INTO apps (appid, details) VALUES ('com.example.waiting', '{}')")
    sql.run(
        "INSERT INTO queue_snapshots (hour, states, backlog, failed)"
        " VALUES (now() - interval '91 days', '{}', '{}', '{}')"
    )
    status = handler.report(load_event("schedule.json"), LambdaContext())
    # Its hourly snapshot kept, and the one past 90 days pruned, as the queue role: by
    # sql/036's function, with no DELETE granted.
    kept = sql.run("SELECT hour = date_trunc('hour', now()) FROM queue_snapshots")
    assert kept == [[True]]
    assert status["counts"] == {"queued": 1, "processing": 0, "analysed": 1, "failed": 0}
    assert status["backlog"] == {
        "queued": 1,
        "lease_expired": 0,
        "outdated_version": 0,
        "stale": 0,
        "retry_failed": 0,
        "retry_due": 0,
    }
    assert status["backlog_total"] == 1
    refetch = handler.report(
        {"command": "queue-refetch", "appIds": ["com.example.app"], "apply": True},
        LambdaContext(),
    )
    assert [app["appId"] for app in refetch["apps"]] == ["com.example.app"]
    assert handler.report({"command": "priority-report"}, LambdaContext())["apps"]


@pytest.mark.private_database  # queue_role grants on its schema and tables
def test_named_analysers_work_as_the_queue_role(queue_role, sql):
    """The admin API's analyser routes and a named analyser's whole cycle, as queue_app
    with only the documented grants (which include no DELETE)."""
    from fastapi.testclient import TestClient

    sql.run("INSERT INTO apps (appid, details) VALUES ('role.app', '{}')")
    with TestClient(handler.app, raise_server_exceptions=False) as client:
        added = client.post("/analysers", json={"name": "pi-role"}, headers=ADMIN)
        assert added.status_code == 201, added.text
        named = {"Authorization": f"Bearer {added.json()['token']}"}
        assert client.get("/ping", headers=named).status_code == 200
        assert client.get("/queue", headers=named).text == "role.app"
        upload = "/uploadAnalysis?appId=role.app&analysisVersion=4"
        assert client.post(upload, json={"success": True}, headers=named).status_code == 200
        rotated = client.post("/analysers/pi-role/rotate", json={"overlap": "0"}, headers=ADMIN)
        assert rotated.status_code == 200
        listed = client.get("/analysers", headers=ADMIN)
        assert listed.status_code == 200 and listed.json()["analysers"][0]["results24h"] == 1
        assert client.get("/healthz/analyser").status_code == 200
        assert client.delete("/analysers/pi-role", headers=ADMIN).status_code == 200
        # Its heartbeat no longer counts: the only analyser there was is revoked.
        assert client.get("/healthz/analyser").status_code == 503
    status = handler.report(load_event("schedule.json"), LambdaContext())
    assert [row["name"] for row in status["analysers"]] == ["pi-role"]


@pytest.mark.private_database  # queue_role grants on its schema and tables
def test_holds_and_pauses_work_as_the_queue_role(queue_role, sql):
    """The operators' holds and pauses, each way they are given (the admin API, the
    report function's commands, the CLI), and the claims they stop and let go, as queue_app
    with only the documented grants."""
    from fastapi.testclient import TestClient

    sql.run("INSERT INTO apps (appid, details) VALUES ('role.app', '{}'), ('role.other', '{}')")
    with TestClient(handler.app, raise_server_exceptions=False) as client:
        token = client.post("/analysers", json={"name": "pi-role"}, headers=ADMIN).json()["token"]
        named = {"Authorization": f"Bearer {token}"}
        answers = [
            client.post("/queue/pause", json={"reason": "role"}, headers=ADMIN),
            client.get("/queue", headers=ANALYSER),  # paused: empty
            client.post("/queue/resume", headers=ADMIN),
            client.post("/analysers/pi-role/pause", headers=ADMIN),
            client.get("/queue", headers=named),  # paused: empty
            client.post("/analysers/pi-role/resume", headers=ADMIN),
            client.post("/apps/role.app/hold", json={"reason": "role"}, headers=ADMIN),
            client.get("/queue", headers=named),  # role.other: role.app is held
            client.post("/apps/role.app/release", headers=ADMIN),
            client.post("/apps/role.other/hold", json={"force": True}, headers=ADMIN),
            client.get("/apps/role.other", headers=ADMIN),
        ]
    assert [answer.status_code for answer in answers] == [200] * len(answers), [
        answer.text for answer in answers
    ]
    assert [answers[1].text, answers[4].text, answers[7].text] == ["", "", "role.other"]
    assert answers[9].json()["outcome"] == "lease_broken"
    assert answers[10].json()["why"]["held"] == "hold"
    # The report function's commands.
    context = LambdaContext()
    done = [
        handler.report(event, context)
        for event in (
            {"command": "why", "appId": "role.app"},
            {"command": "queue-hold", "appId": "role.app", "reason": "role"},
            {"command": "queue-release", "appId": "role.app"},
            {"command": "queue-pause", "reason": "role"},
            {"command": "queue-resume"},
            {"command": "analysers-pause", "name": "pi-role"},
            {"command": "analysers-resume", "name": "pi-role"},
        )
    ]
    assert [answer.get("outcome") for answer in done] == [
        None,
        "held",
        "released",
        "paused",
        "resumed",
        "paused",
        "resumed",
    ]
    # The CLI's.
    env = {**os.environ, "DATABASE_URL": queue_role["url"]}
    runs = [
        call_cli(*args, env=env)
        for args in (
            ("why", "role.app"),
            ("why", "role.app", "--json"),
            ("queue-hold", "role.app", "--force", "--reason", "role"),
            ("queue-release", "role.app"),
            ("queue-pause", "--reason", "role"),
            ("queue-resume",),
            ("analysers", "pause", "pi-role"),
            ("analysers", "resume", "pi-role"),
            ("queue-refetch", "--failed-by", "pi-role", "--since", "1h", "--apply", "--yes"),
            ("queue-status",),
        )
    ]
    # Each went through: exit 0, no error line (stderr holds the log's records only).
    failed = [(run.args[2:], run.returncode, run.stderr) for run in runs]
    assert failed == [(run.args[2:], 0, run.stderr) for run in runs]
    assert not [line for run in runs for line in run.stderr.splitlines() if "error" in line]
    ((actions,),) = sql.run("SELECT count(*) FROM operator_actions")
    assert actions >= 18  # each change above is recorded (the refetch found nothing)


@pytest.mark.private_database  # queue_role grants on its schema and tables
def test_the_web_view_works_as_the_queue_role(queue_role, sql, monkeypatch):
    """Sign-in, a session, an action and its record, sign-out, as queue_app with only the
    documented grants."""
    from fastapi.testclient import TestClient

    configure_service(monkeypatch, queue_role["url"], ADMIN_WEB="full")
    sql.run("INSERT INTO apps (appid, details) VALUES ('role.app', '{}')")
    page = {"Sec-Fetch-Site": "same-origin"}
    with TestClient(handler.app, raise_server_exceptions=False) as client:
        signed_in = client.post(
            "/admin/login", data={"token": kit.ADMIN_TOKEN}, headers=page, follow_redirects=False
        )
        assert signed_in.status_code == 303, signed_in.text
        refetch = client.post("/admin/api/refetch", json={"appIds": ["role.app"]}, headers=page)
        assert refetch.status_code == 200, refetch.text
        story = client.get("/admin/api/apps/role.app").json()
        assert [action["action"] for action in story["actions"]] == ["refetch"]
        for path, body in (
            ("/admin/api/apps/role.app/hold", {"reason": "role"}),
            ("/admin/api/apps/role.app/release", {}),
            ("/admin/api/queue/pause", {"reason": "role"}),
            ("/admin/api/queue/resume", {}),
        ):
            acted = client.post(path, json=body, headers=page)
            assert acted.status_code == 200, (path, acted.text)
        story = client.get("/admin/api/apps/role.app").json()
        assert [action["action"] for action in story["actions"]][:2] == [
            "release app",
            "hold app",
        ]
        assert client.post("/admin/logout", json={}, headers=page).status_code == 200
        assert client.get("/admin/api/status").status_code == 401


@pytest.mark.private_database  # queue_role grants on its schema and tables
def test_named_operators_work_as_the_queue_role(queue_role, sql, monkeypatch):
    """A named operator added, acting by bearer token and by a web session, rotated and
    revoked, the record read, as queue_app with only the documented grants."""
    from fastapi.testclient import TestClient

    configure_service(monkeypatch, queue_role["url"], ADMIN_WEB="full")
    page = {"Sec-Fetch-Site": "same-origin"}
    with TestClient(handler.app, raise_server_exceptions=False) as client:
        signed_in = client.post(
            "/admin/login", data={"token": kit.ADMIN_TOKEN}, headers=page, follow_redirects=False
        )
        assert signed_in.status_code == 303, signed_in.text
        client.cookies.clear()
        added = client.post("/operators", json={"name": "ops-role"}, headers=ADMIN)
        assert added.status_code == 201, added.text
        named = {"Authorization": f"Bearer {added.json()['token']}"}
        assert client.post("/queue/pause", json={}, headers=named).status_code == 200
        assert client.get("/operators", headers=named).json()["operators"][0]["name"] == "ops-role"
        web = client.post(
            "/admin/login",
            data={"token": added.json()["token"]},
            headers=page,
            follow_redirects=False,
        )
        assert web.status_code == 303, web.text
        recent = client.get("/admin/api/actions").json()["actions"]
        assert [(x["actor"], x["action"]) for x in recent[:2]] == [
            ("ops-role", "sign-in"),
            ("ops-role", "pause queue"),
        ]
        rotated = client.post("/operators/ops-role/rotate", json={"overlap": "0"}, headers=ADMIN)
        assert rotated.status_code == 200, rotated.text
        assert client.get("/admin/api/status").status_code == 401  # the session ended
        assert client.delete("/operators/ops-role", headers=ADMIN).status_code == 200
        again = {"Authorization": f"Bearer {rotated.json()['token']}"}
        assert client.get("/operators", headers=again).status_code == 401


@pytest.mark.private_database  # queue_role grants on its schema and tables
@pytest.mark.parametrize(
    "ddl",
    [
        "CREATE TABLE sneaky (id int)",
        "ALTER TABLE apps ADD COLUMN sneaky int",
        "DROP TABLE app_analyses",
        "DELETE FROM apps",
        "TRUNCATE apps",
        "CREATE INDEX sneaky ON apps (added)",
    ],
)
def test_the_queue_role_cannot_change_the_schema(queue_role, ddl):
    app = connect(queue_role["url"])
    try:
        with pytest.raises(pg8000.native.DatabaseError) as refused:
            app.run(ddl)
        assert handler.sqlstate(refused.value) == "42501"  # insufficient_privilege
    finally:
        app.close()


@pytest.mark.private_database  # queue_role grants on its schema and tables
def test_migrations_as_the_queue_role_fail_and_as_the_owner_succeed(
    queue_role, database_url, monkeypatch, tmp_path
):
    directory = tmp_path / "sql"
    directory.mkdir()
    for path in handler.SQL_DIR.glob("*.sql"):
        (directory / path.name).write_bytes(path.read_bytes())
    (directory / "900_new_table.sql").write_text(
        "CREATE TABLE analyser_notes (id bigserial PRIMARY KEY, note text);\n"
    )
    monkeypatch.setattr(handler, "SQL_DIR", directory)
    as_app = handler.owner_connection()
    # The runner's first DDL (the ledger table's CREATE ... IF NOT EXISTS) is refused.
    with pytest.raises(pg8000.native.DatabaseError) as refused:
        handler.apply_migrations(as_app)
    assert handler.sqlstate(refused.value) == "42501"
    as_app.discard()
    # The owner (the tests' superuser, who created the tables) applies the new file.
    assert migrate(database_url) == ["900_new_table.sql"]
    # Default privileges: queue_app uses the new table and its sequence at once.
    app = connect(queue_role["url"])
    try:
        app.run("INSERT INTO analyser_notes (note) VALUES ('hello')")
        assert app.run("SELECT note FROM analyser_notes") == [["hello"]]
    finally:
        app.close()


def test_migration_secret_is_used_for_migrations_only(monkeypatch):
    secrets = {
        "secretsmanager:queue/app": {"username": "queue_app", "password": "a"},
        "secretsmanager:queue/owner": {"username": "queue_owner", "password": "o"},
    }
    monkeypatch.setattr(handler, "fetch_secret", lambda reference, *_, **__: secrets[reference])
    env = {
        "DB_HOST": "db.example.internal",
        "DB_SECRET_ID": "queue/app",
        "DB_MIGRATION_SECRET_ID": "queue/owner",
        "DB_SSLMODE": "disable",
    }
    config = handler.load_settings(env)
    assert handler.connection_arguments(config)["user"] == "queue_app"
    assert handler.connection_arguments(config, owner=True)["user"] == "queue_owner"
    assert handler.connection_arguments(config, fresh=True, owner=True)["user"] == "queue_owner"
    without = handler.load_settings({k: v for k, v in env.items() if k != "DB_MIGRATION_SECRET_ID"})
    assert handler.connection_arguments(without, owner=True)["user"] == "queue_app"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    handler.use_runtime(None)
    try:
        runner = handler.owner_connection()
        assert runner.arguments()["user"] == "queue_owner"
        assert runner.fresh_arguments()["user"] == "queue_owner"
        handler.runtime().close()
        api_db = handler.api_connection()
        assert api_db.arguments()["user"] == "queue_app"
    finally:
        handler.use_runtime(None)
