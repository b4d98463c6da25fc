"""Where one claim's time goes: GET /queue through handler.api, layer by layer.

    python3 bench/claim_layers.py [--apps 10000] [--claims 300] [--python-calls 1000]
                                  [--profile-claims 200] [--server-url URL] [--reuse]
                                  [--keep] [--seed 1]

The same measurement is bench/claims.py's phase "where a service claim's time goes" (in
its API process, at each size); this script runs it alone, in this process, on a
database `bench_layers_<N>` built as bench/claims.py builds its own (bench/claims_data.py:
ledger state 006, the production-like draws, a fixed seed), upgraded to the head of the
ledger by handler.migrate, promoted once and analysed. It is dropped at the end unless
--keep; --reuse measures one a run kept.

A claim's Python layers cost a few hundred microseconds around a round trip that varies
by as much from claim to claim on a busy machine, so they are measured in two parts, each
a set of series interleaved call by call in a shuffled order (every series sees the same
load, and none always follows the same other one):

1. The Python, without the database: a handler.Runtime whose API connection answers
   the claim's statement at once with a row (installed with handler.use_runtime, as the
   tests install theirs; the promoter is caught up), so every layer runs its own code and
   only the round trip is missing. --python-calls calls of each, from the outside in:
   * handler.api (the Lambda entry point) with an API Gateway v2 event for GET /queue,
   * handler.api.__wrapped__: the same without Powertools' Logger.inject_lambda_context,
   * handler.answer_asgi(HTTPCycle(scope, body), handler.deployed_app), the scope made
     outside the timer: without handler.api's own work (the event read into a scope and
     the answer mapped back by Mangum's adapter, the correlation id),
   * handler.deployed_app as an ASGI app, with the same scope, stepped without a loop
     (it never waits on Lambda): without Mangum's HTTPCycle and the hand stepping,
   * the route function, handler.next_app, with a Request and the shared password's
     Credential, run without a loop (it never waits on Lambda): without Starlette's
     middleware and routing, the guard (handler.GuardedRoute's call of require_analyser)
     and the response's sending,
   * handler.claim_next_app as the route calls it: without the route's own work (its
     query checks, settings(), blocking(), the response object); what is left is
     claim_next_app's own (the promoter's clock, the token, the retry frame).
   Each layer less the one inside it is that layer's cost.
2. The database, with real claims: --claims claims through each of handler.api (the
   whole claim, as bench/claims.py's latency series time it), handler.claim_next_app,
   handler.api_connection().records(CLAIM_NEXT_APP), a pg8000 prepared statement of
   CLAIM_NEXT_APP on the same connection (same session settings, generic plan), and the
   floor (bench/claims_workers.FLOOR_CLAIM on a bare pg8000 connection, the denominator
   of claim_vs_floor). The claimed rows are put back and apps vacuumed between rounds
   of at most ROUND_CLAIMS claims per series, as bench/claims.py does between phases.
   "The rest" is what a real claim costs above its Python layers and its claim_next_app:
   the Python running slower around a real round trip (caches, the scheduler).

Pieces measured alone (cross-checks): Mangum around an ASGI app that answers at once,
its event-to-scope translation and its response mapping; Powertools' decorator around a
no-op; one asyncio task; the bearer dependency (HTTPBearer and handler.require_analyser);
Starlette's route matching; and the bench's own event building, which bench/claims.py's
latency series time with the claim. Then cProfile over --profile-claims real claims
through handler.api: the top entries by cumulative and by own time, per claim.

Medians in microseconds, wall time and this thread's CPU time (wall less CPU is waiting:
on PostgreSQL, the socket, the scheduler); a layer's figure is a difference of medians.
Ends with `name=value` lines (layer_*_us). handler.py is not changed by it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import claims_db
import claims_workers

ROOT = Path(__file__).resolve().parent.parent
ROUND_CLAIMS = 100  # real claims per series between two restores
ALONE_REPEATS = 3  # calls of each piece measured alone per cycle of the series
CLAIMED_APP = "com.example.bench.app123"

# Part 1, without the database, outermost first: (key, what runs).
PYTHON = (
    ("api", "handler.api(event, context)"),
    ("unwrapped", "handler.api.__wrapped__(event, context)"),
    ("stepped", "handler.answer_asgi(HTTPCycle(scope, body), handler.deployed_app)"),
    ("asgi", "handler.deployed_app(scope, receive, send), stepped without a loop"),
    ("endpoint", "handler.next_app(request, credential)"),
    ("claim", "handler.claim_next_app(...)"),
)
# Part 2, real claims: the same layers, and below claim_next_app the statement through
# handler's SharedConnection, pg8000's prepared statement, and the floor.
DATABASE = (
    *PYTHON,
    ("records", "handler.api_connection().records(CLAIM_NEXT_APP)"),
    ("prepared", "pg8000 prepared CLAIM_NEXT_APP on the API connection"),
    ("floor", "FLOOR_CLAIM on a bare pg8000 connection"),
)
ALONE = (
    "event",
    "powertools",
    "mangum_null",
    "mangum_in",
    "mangum_out",
    "task",
    "bearer",
    "routing",
)


def say(text: str = "") -> None:
    print(text, flush=True)


def drive(coroutine):
    """Run a coroutine that never waits (the Lambda path: blocking() runs inline) to its
    end without an event loop, so that no loop's cost is in the figure."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine waited: it needs an event loop")


async def _null_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _nothing() -> None:
    return None


def answering_runtime(handler):
    """A handler.Runtime whose API connection answers every statement at once with the
    claimed row, without a round trip, its promoter caught up (a clock that stands
    still): the service's Python with the database taken out."""

    class AnsweringConnection(handler.SharedConnection):
        def autocommit(self, work):
            return [{"appid": CLAIMED_APP}]

        def transaction(self, work):
            return [{"appid": CLAIMED_APP}]

    class AnsweringRuntime(handler.Runtime):
        def api_connection(self):
            return self.answering

    config = handler.load_settings(dict(os.environ))
    runtime = AnsweringRuntime(config)
    runtime.answering = AnsweringConnection(lambda: {}, clock=lambda: 0.0)
    runtime.answering.promoter.caught_up_at[config.policy] = 0.0
    return runtime


class Layers:
    """The pieces of one claim, each callable on its own, in a process that imported
    handler as a Lambda container does (claims_workers.ServiceClaimer)."""

    def __init__(self, service: claims_workers.ServiceClaimer, url: str, seed: int = 1):
        from mangum import Mangum
        from mangum.protocols import HTTPCycle
        from starlette.requests import Request
        from starlette.routing import Match

        self.service = service
        handler = self.handler = service.handler
        self.url = url
        self.context = service.context
        self.Request = Request
        self.HTTPCycle = HTTPCycle
        self.Match = Match
        self.random = random.Random(seed)
        self.mangum = Mangum(handler.deployed_app, lifespan="off")
        self.mangum_null = Mangum(_null_app, lifespan="off")
        self.loop = asyncio.new_event_loop()  # for Mangum's own run, measured alone
        self.decorated_noop = handler.logger.inject_lambda_context(lambda event, context: None)
        self.response = {
            "status": 200,
            "headers": [
                [b"content-length", str(len(CLAIMED_APP)).encode()],
                [b"content-type", b"text/plain; charset=utf-8"],
                [b"x-analysis-claim-token", str(uuid.UUID(int=1)).encode()],
            ],
            "body": CLAIMED_APP.encode(),
        }
        self.floor = None
        self.statement = None
        self.connected = None
        scope = self.scope()
        self.routes_before = 0
        for route in handler.app.router.routes:
            if route.matches(scope)[0] == Match.FULL:
                break
            self.routes_before += 1

    def connect(self) -> None:
        """The real claims' connections: the service's (connected as a warm container's
        is, its Runtime's first claim made, which runs the promoter, and the claim's
        statement prepared on it) and the floor's."""
        handler = self.handler
        if self.statement is None or handler.runtime() is not self.connected:
            self.service.get("/healthz")
            self.connected = handler.runtime()
            self.call("api", self.arguments("api"))
            with handler.api_connection().raw_connection() as connection:
                self.statement = connection.prepare(handler.CLAIM_NEXT_APP)
        if self.floor is None:
            self.floor = claims_db.connect(self.url, "bench-floor")

    def close(self) -> None:
        if self.statement is not None and self.handler.runtime() is self.connected:
            with self.handler.api_connection().raw_connection():
                self.statement.close()
        self.statement = None
        if self.floor is not None:
            self.floor.close()
            self.floor = None

    def event(self) -> dict:
        return claims_workers.api_gateway_v2_event("/queue")

    def scope(self) -> dict:
        return self.mangum.infer(self.event(), self.context).scope

    # --- one call of a layer: its arguments are made outside the timer -------------------

    def arguments(self, key: str):
        if key in ("api", "unwrapped"):
            return (self.event(), self.context)
        if key in ("stepped", "asgi"):
            return (self.scope(),)
        if key == "endpoint":
            return (self.Request(self.scope()), self.handler.SHARED_PASSWORD)
        if key in ("records", "prepared"):
            return (uuid.uuid4(),)
        return ()

    def call(self, key: str, arguments) -> bool:
        """One call through the layer; whether it handed out an app."""
        handler = self.handler
        if key == "api":
            return bool(handler.api(*arguments)["body"])
        if key == "unwrapped":
            return bool(handler.api.__wrapped__(*arguments)["body"])
        if key == "stepped":
            cycle = self.HTTPCycle(arguments[0], b"")
            return bool(handler.answer_asgi(cycle, handler.deployed_app)["body"])
        if key == "asgi":
            sent = []

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message):
                sent.append(message)

            drive(handler.deployed_app(arguments[0], receive, send))
            return sent[0]["status"] == 200 and bool(sent[-1].get("body"))
        if key == "endpoint":
            return bool(drive(handler.next_app(*arguments)).body)
        if key == "claim":
            config = handler.settings()
            claimed = handler.claim_next_app(
                handler.api_connection(),
                config.policy,
                None,
                config.promotion_budget_ms / 1000,
                None,
            )
            return claimed is not None
        params = handler.settings().policy.sql_params()
        if key == "records":
            return bool(
                handler.api_connection().records(
                    handler.CLAIM_NEXT_APP, token=arguments[0], analyser=None, **params
                )
            )
        if key == "prepared":
            return bool(self.statement.run(token=arguments[0], analyser=None, **params))
        if key == "floor":
            return bool(self.floor.run(claims_workers.FLOOR_CLAIM))
        raise KeyError(key)

    def timed(self, key: str) -> tuple[float, float, bool]:
        """(wall seconds, this thread's CPU seconds, whether it handed out an app)."""
        arguments = self.arguments(key)
        started, cpu = time.perf_counter(), time.thread_time()
        claimed = self.call(key, arguments)
        return time.perf_counter() - started, time.thread_time() - cpu, claimed

    def alone(self, key: str) -> float:
        """Wall seconds of one piece measured alone (it claims nothing)."""
        handler = self.handler
        event = self.event()
        if key == "event":
            started = time.perf_counter()
            self.event()
        elif key == "powertools":
            started = time.perf_counter()
            self.decorated_noop(event, self.context)
        elif key == "mangum_null":
            started = time.perf_counter()
            self.mangum_null(event, self.context)
        elif key == "mangum_in":
            started = time.perf_counter()
            adapter = self.mangum.infer(event, self.context)
            adapter.scope  # noqa: B018 - builds the scope, as Mangum does
            adapter.body  # noqa: B018
        elif key == "mangum_out":
            adapter = self.mangum.infer(event, self.context)
            response = dict(self.response)
            started = time.perf_counter()
            adapter(response)
        elif key == "task":
            started = time.perf_counter()
            self.loop.run_until_complete(_nothing())
        elif key == "bearer":
            request = self.Request(self.scope())
            started = time.perf_counter()
            credentials = drive(handler.analyser_bearer(request))
            drive(handler.require_analyser(credentials))
        elif key == "routing":
            scope = self.scope()
            started = time.perf_counter()
            for route in handler.app.router.routes:
                if route.matches(scope)[0] == self.Match.FULL:
                    break
        else:
            raise KeyError(key)
        return time.perf_counter() - started

    def _series(self, series: list[tuple[str, str]], cycles: int, alone: bool, pause=None):
        """`cycles` calls of each (prefix, key) series, in a shuffled order each cycle;
        the samples under prefix + key (wall) and prefix + key + "_cpu", and whether the
        queue ran dry. A series whose prefix is "pyc_" calls pause() first, untimed."""
        samples: dict[str, list[float]] = {}
        for _ in range(cycles):
            order = list(series)
            self.random.shuffle(order)
            for prefix, key in order:
                if prefix == "pyc_":
                    pause()
                wall, cpu, claimed = self.timed(key)
                if not claimed:
                    return samples, True
                samples.setdefault(prefix + key, []).append(wall)
                samples.setdefault(prefix + key + "_cpu", []).append(cpu)
            if alone:
                for key in ALONE:
                    for _ in range(ALONE_REPEATS):
                        samples.setdefault(key, []).append(self.alone(key))
        return samples, False

    def python_series(self, calls: int) -> dict[str, list[float]]:
        """Part 1: the Python layers with the database answering at once, each called
        back to back (py_) and right after a round trip to PostgreSQL on another
        connection (pyc_: the thread waited, as a real claim's does, and other processes
        ran meanwhile). The process's Runtime is replaced meanwhile; the next real
        request builds one anew."""
        self.close()
        handler = self.handler
        other = claims_db.connect(self.url, "bench-pause")
        handler.use_runtime(answering_runtime(handler))
        try:
            for _ in range(20):  # warm
                for key, _ in PYTHON:
                    self.timed(key)
            series = [(prefix, key) for prefix in ("py_", "pyc_") for key, _ in PYTHON]
            samples, _ = self._series(series, calls, True, lambda: other.run("SELECT 1"))
        finally:
            handler.use_runtime(None)
            other.close()
        return samples

    def database_round(self, claims: int) -> tuple[dict[str, list[float]], bool]:
        """Part 2: one round of real claims through each series (the caller puts the
        rows back between rounds)."""
        self.connect()
        return self._series([("db_", key) for key, _ in DATABASE], claims, False)

    def profile(self, claims: int, top: int = 15) -> list[str]:
        """cProfile over `claims` real claims through handler.api: the top entries by
        cumulative time, then by own time, per claim."""
        self.connect()
        profiler = cProfile.Profile()
        plain, profiled = [], []
        for _ in range(claims):  # unprofiled claims first, for scale
            event = self.event()
            started = time.perf_counter()
            if not self.handler.api(event, self.context)["body"]:
                break
            plain.append(time.perf_counter() - started)
        for _ in range(claims):
            event = self.event()
            started = time.perf_counter()
            profiler.enable()
            answer = self.handler.api(event, self.context)
            profiler.disable()
            profiled.append(time.perf_counter() - started)
            if not answer["body"]:
                break
        return profile_lines(profiler, len(profiled), plain, profiled, top)


def _where(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    path = filename.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return f"{path.split(marker, 1)[1]}:{line} {name}"
    if "/lib/python3" in path:
        return f"{path.split('/lib/', 1)[1].split('/', 1)[1]}:{line} {name}"
    return f"{Path(path).name}:{line} {name}"


def profile_lines(profiler, claims: int, plain, profiled, top: int) -> list[str]:
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    entries = [
        (key, nc, tt, ct)
        for key, (_, nc, tt, ct, _) in stats.items()
        if "_lsprof.Profiler" not in key[2]
    ]
    n = max(claims, 1)
    lines = [
        f"cProfile over {claims} claims through handler.api (median {us(_median(plain))}"
        f" unprofiled, {us(_median(profiled))} profiled: the profiler's own cost inflates"
        " small functions); per claim, µs:",
        f"   {'cumulative':>10} {'own':>8} {'calls':>6}  function (by cumulative time)",
    ]
    for key, nc, tt, ct in sorted(entries, key=lambda e: -e[3])[:top]:
        lines.append(f"   {ct / n * 1e6:10.1f} {tt / n * 1e6:8.1f} {nc / n:6.1f}  {_where(key)}")
    lines.append(f"   {'own':>10} {'cumul.':>8} {'calls':>6}  function (by own time)")
    for key, nc, tt, ct in sorted(entries, key=lambda e: -e[2])[:top]:
        lines.append(f"   {tt / n * 1e6:10.1f} {ct / n * 1e6:8.1f} {nc / n:6.1f}  {_where(key)}")
    return lines


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs"


# --- the table ------------------------------------------------------------------------

# (label, outer series, inner series or None, figure name): a row is outer less inner,
# in part 1 (py_: back to back, pyc_: after a round trip; blank where part 1 has no such
# series, and outer alone where it has no inner one: its connection answers at once) and
# in part 2 (db_: real claims, wall and CPU).
ROWS = (
    ("GET /queue via handler.api, the whole claim", "api", None, "claim"),
    ("  Powertools: Logger.inject_lambda_context", "api", "unwrapped", "powertools"),
    ("  handler.api's own: event to scope, answer to dict, correlation id", "unwrapped",
     "stepped", "api_own"),
    ("  Mangum's HTTPCycle, stepped by hand (handler.answer_asgi)", "stepped", "asgi",
     "cycle"),
    ("  Starlette/FastAPI: middleware, routing, the guard, sending", "asgi", "endpoint",
     "starlette_fastapi"),
    ("  the route's own: query checks, settings, blocking, response", "endpoint", "claim",
     "route"),
    ("  claim_next_app's own: promoter's clock, token, retry frame", "claim", "records",
     "claim_next_app"),
    ("  handler's SharedConnection and Session (rows as dicts)", "records", "prepared",
     "session"),
    ("  pg8000 + PostgreSQL: CLAIM_NEXT_APP prepared, generic plan", "prepared", None,
     "prepared_sql"),
    ("    of which over the floor (less FLOOR_CLAIM, bare)", "prepared", "floor",
     "sql_over_floor"),
    ("the Python above pg8000 (api - prepared)", "api", "prepared", "python"),
    ("the floor: FLOOR_CLAIM on a bare pg8000 connection", "floor", None, "floor"),
    ("a real claim over the floor (api - floor)", "api", "floor", "over_floor"),
)  # fmt: skip
ALONE_LABELS = (
    ("  Powertools' decorator around a no-op", "powertools"),
    ("  Powertools Metrics: no flush on /queue (api has no log_metrics)", None),
    ("  Mangum around an ASGI app that answers at once", "mangum_null"),
    ("    its event to scope and body", "mangum_in"),
    ("    its response to API Gateway's dict", "mangum_out"),
    ("  one asyncio task run to completion (what answer_asgi saves)", "task"),
    ("  the bearer dependency: HTTPBearer + require_analyser", "bearer"),
    ("  Starlette: matching /queue against the routes", "routing"),
    ("  the bench's event building (in claims.py's latency series)", "event"),
)
NAN = float("nan")


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    """Median microseconds of each series."""
    return {key: _median(values) * 1e6 for key, values in samples.items()}


# The rows part 1 shows as the outer series alone: what is below it answers at once there.
OUTER_ALONE = ("claim_next_app", "python")


def _cell(m: dict[str, float], prefix: str, row: tuple, cpu: bool = False) -> float:
    _, outer, inner, name = row
    suffix = "_cpu" if cpu else ""
    value = m.get(prefix + outer + suffix, NAN)
    if inner is None or (prefix != "db_" and name in OUTER_ALONE):
        return value
    return value - m.get(prefix + inner + suffix, NAN)


def _number(value: float, width: int = 8) -> str:
    return f"{'':>{width}}" if value != value else f"{value:{width}.1f}"


def table(samples: dict[str, list[float]], routes_before: int | None = None) -> list[str]:
    """The layer table in microseconds, each layer less the one inside it: part 1 back
    to back and after a round trip, part 2 (real claims) wall and CPU time; then the
    pieces measured alone."""
    m = medians(samples)
    whole = m.get("db_api", NAN)
    width = 64
    lines = [
        f"   {'':<{width}}{'no database':>16}{'real claims':>16}",
        f"   {'layer (each less the one inside it; medians, µs)':<{width}}"
        f"{'b-to-b':>8}{'a.trip':>8}{'wall':>8}{'CPU':>8}{'of wall':>8}",
    ]
    for row in ROWS:
        wall = _cell(m, "db_", row)
        lines.append(
            f"   {row[0]:<{width}}{_number(_cell(m, 'py_', row))}"
            f"{_number(_cell(m, 'pyc_', row))}{_number(wall)}"
            f"{_number(_cell(m, 'db_', row, cpu=True))}{wall / whole:8.1%}"
        )
    lines.append(f"   {'measured alone, no claim':<{width}}{'':>16}{'wall':>8}")
    for label, key in ALONE_LABELS:
        value = m.get(key, NAN) if key else 0.0
        if key == "routing" and routes_before is not None:
            label += f" ({routes_before} before it)"
        lines.append(f"   {label:<{width}}{'':>16}{_number(value)}{'':>8}{value / whole:8.1%}")
    lines.append(
        f"   (no database: {len(samples.get('py_api', []))} calls per layer, the connection"
        " answering at once, back to back (b-to-b) and each after a round trip on another"
        f" connection (a.trip); real claims: {len(samples.get('db_api', []))} per layer;"
        f" {len(samples.get('event', []))} calls of each piece alone. Each row is a"
        " difference of two medians, and can come out below zero)"
    )
    return lines


def figures(samples: dict[str, list[float]]) -> dict[str, float]:
    """The `name=value` figures of the layer table, microseconds: real claims' wall and
    CPU time, and part 1's back to back where it has the layer."""
    m = medians(samples)
    found = {}
    for row in ROWS:
        name = row[3]
        found[f"layer_{name}_us"] = _cell(m, "db_", row)
        found[f"layer_{name}_cpu_us"] = _cell(m, "db_", row, cpu=True)
        warm = _cell(m, "py_", row)
        if warm == warm:
            found[f"layer_{name}_no_db_us"] = warm
    return found


def merge(into: dict[str, list[float]], samples: dict[str, list[float]]) -> None:
    for key, values in samples.items():
        into.setdefault(key, []).extend(values)


# --- standalone -------------------------------------------------------------------------


def prepare(args: argparse.Namespace, handler) -> str:
    import claims_data
    import claims_upgrade

    name = f"bench_layers_{args.apps}"
    server = claims_db.with_database(args.server_url, "postgres")
    if args.reuse:
        say(f"-- reusing {name}")
        return claims_db.with_database(server, name)
    url = claims_db.recreate_database(server, name)
    sql = claims_db.connect(url, "bench-layers")
    try:
        sql.run("SET statement_timeout = '10min'")
        say(f"-- build: {args.apps:,} apps at ledger state 006 in {name}, seed {args.seed}")
        started = time.perf_counter()
        claims_data.build_legacy_database(sql, ROOT / "sql", args.apps, args.seed, 1000)
        say(f"   build {time.perf_counter() - started:.1f} s")
        configure(url)
        started = time.perf_counter()
        entry, applied = claims_upgrade.run_ledger(handler)
        say(f"   {entry}: {len(applied)} ledger files, {time.perf_counter() - started:.1f} s")
        # The promoter's first pass (the upgrade's stale rows), then statistics, as
        # bench/claims.py's first claim and ANALYZE leave the database.
        handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
        handler.use_runtime(None)
        sql.run("VACUUM ANALYZE apps")
    finally:
        sql.close()
    return url


def configure(url: str) -> None:
    os.environ.update(DATABASE_URL=url, UPLOAD_PASSWORD=claims_workers.UPLOAD_PASSWORD)
    for name in ("CURRENT_ANALYSIS_VERSION", "STALE_ANALYSIS_DAYS", "PROCESSING_TIMEOUT_MINUTES"):
        os.environ.pop(name, None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--apps", type=int, default=10_000, help="apps (10000)")
    parser.add_argument("--claims", type=int, default=300, help="real claims per series (300)")
    parser.add_argument(
        "--python-calls",
        type=int,
        default=1000,
        help="calls per series without the database (1000)",
    )
    parser.add_argument(
        "--profile-claims", type=int, default=200, help="claims under cProfile (200)"
    )
    parser.add_argument("--server-url", default=claims_db.DEFAULT_SERVER)
    parser.add_argument("--seed", type=int, default=1, help="random seed of the data (1)")
    parser.add_argument("--reuse", action="store_true", help="measure bench_layers_<N> as kept")
    parser.add_argument("--keep", action="store_true", help="keep bench_layers_<N> at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    sys.path.insert(0, str(ROOT))
    import claims

    import handler

    try:
        url = prepare(args, handler)
        configure(url)
        bench = claims.Bench(handler, url, args)
        service = claims_workers.ServiceClaimer(url)
        layers = Layers(service, url, args.seed)
        try:
            bench.snapshot()
            layers.connect()
            for _ in range(20):  # warm: the statements prepared, the first promotion run
                layers.timed("api")
            bench.restore(claims._all_floor_claims(bench))
            queued = bench.queued_count()
            per_round = max(10, min(ROUND_CLAIMS, queued // (2 * len(DATABASE))))
            say(
                f"-- where a service claim's time goes ({args.apps:,} apps, {queued:,} queued;"
                f" load average {claims._load()})"
            )
            say(f"   part 1: {args.python_calls} calls per series without the database")
            samples = layers.python_series(args.python_calls)
            say(
                f"   part 2: {args.claims} real claims per series in rounds of {per_round}"
                " (rows put back and apps vacuumed between rounds)"
            )
            left = args.claims
            while left > 0:
                got, dry = layers.database_round(min(per_round, left))
                merge(samples, got)
                bench.restore(claims._all_floor_claims(bench))
                left -= per_round
                if dry:
                    say("   !! the queue ran dry during a round")
                    break
            for line in table(samples, layers.routes_before):
                say(line)
            lines = layers.profile(min(args.profile_claims, queued // 4))
            bench.restore(claims._all_floor_claims(bench))
            say("-- " + lines[0])
            for line in lines[1:]:
                say(line)
            say()
            for name, value in figures(samples).items():
                say(f"{name}={value:.1f}")
        finally:
            layers.close()
            bench.restore_all()
            bench.drop_snapshot()
            bench.sql.close()
            handler.use_runtime(None)
    finally:
        if not args.keep:
            admin = claims_db.connect(claims_db.with_database(args.server_url, "postgres"))
            try:
                admin.run(f"DROP DATABASE IF EXISTS bench_layers_{args.apps} WITH (FORCE)")
            finally:
                admin.close()
            say(f"-- dropped bench_layers_{args.apps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
