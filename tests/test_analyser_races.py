"""Named analysers' credentials under concurrent operators (docs/analysers.md): add, rotate
and revoke of one name, two at a time on two connections, in each order a lock can queue
them (helpers.race: a third connection holds the lock both need, so PostgreSQL decides
the order, never a sleep). Whatever the interleaving, the pair answers as if the two had
run one after the other, in one order or the other, and leaves the row as that order
would: through the functions (every state and pair, exhaustively), the admin API under
`serve` (200/201/404/409, never a 500) and the CLI (its one-line errors with exit 1, never
a traceback). A revocation that commits while a rotation waits for the row made the
rotation a 500 (API) and a bare ValueError (CLI)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from datetime import UTC, datetime

import httpx
import pytest
from kit import ADMIN, configure_service

import handler
from helpers import TEST_OPERATOR, Outcome, database_at, race, races
from live import serving

NAME = "pi-race"
OPERATIONS = ("add", "rotate", "rotate-overlap", "revoke")
STATES = ("absent", "active", "revoked")


# --- the model: the two in one order, or in the other ----------------------------------


def step(state, operation: str, who: str):
    """(what `operation` by `who` answers, the state after it). A state is None (no such
    analyser) or (revoked, whose token is current)."""
    if operation == "add":
        return ("exists", state) if state else ("created", (False, who))
    if state is None:
        return "unknown", None
    revoked, token = state
    if operation.startswith("rotate"):
        return ("revoked", state) if revoked else ("rotated", (False, who))
    return "done", (True, token)


def serial(initial, first: str, second: str) -> set:
    """Every ((first's answer, second's answer), final state) of the two run one after
    the other."""
    results = set()
    for order in (("first", first), ("second", second)), (("second", second), ("first", first)):
        state, answers = initial, {}
        for who, operation in order:
            answers[who], state = step(state, operation, who)
        results.add(((answers["first"], answers["second"]), state))
    return results


def initial_state(state: str):
    return {"absent": None, "active": (False, "initial"), "revoked": (True, "initial")}[state]


def arrange(sql, name: str, state: str) -> str | None:
    """The analyser `name` in `state`; its token (None when absent)."""
    sql.run("DELETE FROM analysers WHERE name = :name", name=name)
    if state == "absent":
        return None
    token = handler.new_analyser_token()
    sql.run(
        "INSERT INTO analysers (name, token_hash, revoked) VALUES (:name, :hash, :revoked)",
        name=name,
        hash=handler.token_hash(token),
        revoked=None if state == "active" else datetime.now(UTC),
    )
    return token


def hold_the_name(holder, name: str) -> None:
    """The lock every operation on `name` needs: its row's, or, with no row yet, its key's
    (an INSERT the holder rolls back)."""
    if holder.run("SELECT 1 FROM analysers WHERE name = :name FOR UPDATE", name=name):
        return
    holder.run(
        "INSERT INTO analysers (name, token_hash)"
        " VALUES (:name, sha256(convert_to('held ' || :name, 'UTF8')))",
        name=name,
    )


def final_state(sql, name: str, tokens: dict[str, str | None]):
    """The row as the model states it: None, or (revoked, whose token is current)."""
    rows = sql.run(
        "SELECT revoked IS NOT NULL, token_hash FROM analysers WHERE name = :name", name=name
    )
    if not rows:
        return None
    ((revoked, stored),) = rows
    owners = [who for who, token in tokens.items() if token and handler.token_hash(token) == stored]
    return (revoked, owners[0] if owners else "a token no operation made")


# --- through the functions, every state and pair ----------------------------------------


def call(db: handler.SharedConnection, operation: str, name: str = NAME) -> dict:
    if operation == "add":
        return handler.add_analyser(db, TEST_OPERATOR, name)
    if operation == "revoke":
        return handler.revoke_analyser(db, TEST_OPERATOR, name)
    overlap = 3600 if operation == "rotate-overlap" else 0
    return handler.rotate_analyser(db, TEST_OPERATOR, name, overlap)


REFUSALS = {
    handler.AnalyserExists: "exists",
    handler.UnknownAnalyser: "unknown",
    handler.AnalyserRevoked: "revoked",
}
DONE = {"add": "created", "rotate": "rotated", "rotate-overlap": "rotated", "revoke": "done"}


def answer_of(operation: str, outcome: Outcome) -> str:
    if outcome.error is None:
        return DONE[operation]
    return REFUSALS.get(type(outcome.error), f"{type(outcome.error).__name__}: {outcome.error}")


def test_every_pair_of_operations_in_every_order_answers_as_one_after_the_other(database_url, sql):
    """Exhaustive: each starting state, each ordered pair of operations, each of the two
    starting first. The row lock queues them in the order they started (their only
    possible order while the row exists); with no row the adds race on its key."""
    one, two = database_at(database_url), database_at(database_url)
    wrong = []
    try:
        for state, first, second, first_starts in itertools.product(
            STATES, OPERATIONS, OPERATIONS, (True, False)
        ):
            initial_token = arrange(sql, NAME, state)
            outcomes = race(
                database_url,
                lambda holder: hold_the_name(holder, NAME),
                lambda first=first: call(one, first),
                lambda second=second: call(two, second),
                first_starts=first_starts,
            )
            tokens = {"initial": initial_token}
            for who, outcome in zip(("first", "second"), outcomes, strict=True):
                tokens[who] = (outcome.value or {}).get("token")
            answers = (answer_of(first, outcomes[0]), answer_of(second, outcomes[1]))
            seen = (answers, final_state(sql, NAME, tokens))
            if seen not in serial(initial_state(state), first, second):
                wrong.append((state, first, second, first_starts, seen))
    finally:
        one.discard()
        two.discard()
    assert wrong == []


# --- through the admin API under serve, and through the CLI, many times -------------------

PAIRS = [("rotate", "revoke"), ("add", "add"), ("revoke", "revoke"), ("rotate", "rotate")]
# The pair's starting state: two adds race for a new name, the others act on an analyser.
STARTS = {"add": "absent", "rotate": "active", "revoke": "active"}


def expected_statuses(first: str, second: str) -> set:
    """The (first, second) HTTP statuses of the two run one after the other."""
    as_status = {
        "created": 201,
        "rotated": 200,
        "done": 200,
        "exists": 409,
        "revoked": 409,
        "unknown": 404,
    }
    return {
        (as_status[a], as_status[b])
        for (a, b), _ in serial(initial_state(STARTS[first]), first, second)
    }


# The service waits for a lock longer than a round takes to line its two up (with the
# default 1 s the first would give up while the second is still starting).
PATIENT = {"LOCK_TIMEOUT_MS": "60000", "STATEMENT_TIMEOUT_MS": "120000"}


@pytest.fixture
def patient(database_url, monkeypatch):
    configure_service(monkeypatch, database_url, **PATIENT)
    return database_url


def request(http: httpx.Client, operation: str, name: str) -> int:
    if operation == "add":
        answer = http.post("/analysers", json={"name": name}, headers=ADMIN)
    elif operation == "revoke":
        answer = http.delete(f"/analysers/{name}", headers=ADMIN)
    else:
        answer = http.post(f"/analysers/{name}/rotate", json={"overlap": "0"}, headers=ADMIN)
    return answer.status_code


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_racing_admin_requests_answer_as_one_after_the_other(patient, sql, first, second):
    rounds = 12

    def setup(number: int) -> None:
        arrange(sql, f"{NAME}-{number}", STARTS[first])

    with (
        serving(handler.app) as server,
        httpx.Client(base_url=server.url, timeout=120) as one,
        httpx.Client(base_url=server.url, timeout=120) as two,
    ):
        results = races(
            patient,
            lambda holder, n: hold_the_name(holder, f"{NAME}-{n}"),
            lambda n: request(one, first, f"{NAME}-{n}"),
            lambda n: request(two, second, f"{NAME}-{n}"),
            rounds,
            setup,
        )
    statuses = [(a.value, b.value) for a, b in results]
    assert all(a.error is None and b.error is None for a, b in results), results
    allowed = expected_statuses(first, second)
    assert [pair for pair in statuses if pair not in allowed] == []
    if first != second:  # each queue order was run, and gave its own answer
        assert set(statuses) == allowed


CLI_LINES = {
    "exists": "error: an analyser named {name} exists",
    "unknown": "error: no analyser named {name}",
    "revoked": "error: the analyser {name} is revoked",
}
CLI_DONE = {"add": "Added analyser", "rotate": "Rotated analyser", "revoke": "Revoked analyser"}


def cli(url: str, operation: str, name: str) -> subprocess.CompletedProcess:
    args = ["analysers", operation, name] + (["--overlap", "0"] if operation == "rotate" else [])
    return subprocess.run(
        [sys.executable, str(handler.HERE / "handler.py"), *args],
        env={**os.environ, "DATABASE_URL": url, **PATIENT},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def cli_answer(operation: str, name: str, done: subprocess.CompletedProcess) -> str:
    """What the command answered, by its documented output; anything else as it is."""
    assert "Traceback" not in done.stderr, done.stderr
    if done.returncode == 0 and done.stdout.startswith(CLI_DONE[operation]):
        return {"add": "created", "rotate": "rotated", "revoke": "done"}[operation]
    for answer, line in CLI_LINES.items():
        if done.returncode == 1 and done.stderr == line.format(name=name) + "\n":
            return answer
    return f"exit {done.returncode}: {done.stderr.strip()}"


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_racing_cli_commands_answer_as_one_after_the_other(database_url, sql, first, second):
    rounds = 4 if first != second else 2

    def setup(number: int) -> None:
        arrange(sql, f"{NAME}-{number}", STARTS[first])

    results = races(
        database_url,
        lambda holder, n: hold_the_name(holder, f"{NAME}-{n}"),
        lambda n: cli(database_url, first, f"{NAME}-{n}"),
        lambda n: cli(database_url, second, f"{NAME}-{n}"),
        rounds,
        setup,
    )
    allowed = {answers for answers, _ in serial(initial_state(STARTS[first]), first, second)}
    seen = []
    for number, (one, two) in enumerate(results):
        name = f"{NAME}-{number}"
        assert one.error is None and two.error is None, (one, two)
        seen.append((cli_answer(first, name, one.value), cli_answer(second, name, two.value)))
    assert [answers for answers in seen if answers not in allowed] == []
    if first != second:
        assert set(seen) == allowed


def test_a_heartbeat_racing_a_revocation_is_never_recorded_after_it(patient, sql):
    """A /ping authenticated just before its analyser's revocation commits answers
    "online" (its request came first), but records no heartbeat after the revocation."""
    tokens: dict[int, str] = {}

    def setup(number: int) -> None:
        tokens[number] = arrange(sql, f"{NAME}-{number}", "active")

    with (
        serving(handler.app) as server,
        httpx.Client(base_url=server.url, timeout=120) as one,
        httpx.Client(base_url=server.url, timeout=120) as two,
    ):
        results = races(
            patient,
            lambda holder, n: hold_the_name(holder, f"{NAME}-{n}"),
            lambda n: one.get("/ping", headers={"Authorization": f"Bearer {tokens[n]}"}),
            lambda n: two.delete(f"/analysers/{NAME}-{n}", headers=ADMIN),
            6,
            setup,
        )
    assert [(a.value.status_code, b.value.status_code) for a, b in results] == [(200, 200)] * 6
    rows = sql.run(
        "SELECT name, last_seen IS NOT NULL, last_seen <= revoked FROM analysers ORDER BY name"
    )
    # Pinged first: seen, before the revocation; revoked first: never seen.
    assert (
        sorted((seen, before) for _, seen, before in rows)
        == [(False, None)] * 3 + [(True, True)] * 3
    )
