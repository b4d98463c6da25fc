"""Processes that play a Lambda container (the service, one request at a time, its own
connection) or a bare SQL client (the floor). Started with the spawn method, so each is
a fresh interpreter like a cold Lambda container, and its peak RSS is its own.

The service's claims go through handler.api, the Mangum entry point that Lambda calls,
with an API Gateway HTTP API (payload v2) event for GET /queue: routing, the bearer
check, the sync route in the thread pool, claim_next_app, the response mapping.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPLOAD_PASSWORD = "bench-upload-password"
TOKEN_HEADER = "x-analysis-claim-token"

# The floor: the complete index-head claim, bare (the statement).
FLOOR_CLAIM = """
UPDATE apps SET status = 'processing', processing_started = now(),
                analysis_claim_token = gen_random_uuid()
WHERE appid = (
    SELECT appid FROM apps WHERE status = 'queued'
    ORDER BY app_popularity(details) DESC, added, appid
    LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING appid
"""


def api_gateway_v2_event(path: str, password: str = UPLOAD_PASSWORD) -> dict:
    """What API Gateway (HTTP API, payload format 2.0) hands the API function."""
    now = time.time()
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {
            "accept": "*/*",
            "authorization": f"Bearer {password}",
            "host": "bench.execute-api.us-east-1.amazonaws.com",
            "user-agent": "curl/7.88.1",
            "x-forwarded-for": "127.0.0.1",
            "x-forwarded-port": "443",
            "x-forwarded-proto": "https",
        },
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "bench",
            "domainName": "bench.execute-api.us-east-1.amazonaws.com",
            "domainPrefix": "bench",
            "http": {
                "method": "GET",
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": "127.0.0.1",
                "userAgent": "curl/7.88.1",
            },
            "requestId": "bench",
            "routeKey": "$default",
            "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)),
            "timeEpoch": int(now * 1000),
        },
        "isBase64Encoded": False,
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _service_env(url: str, extra: dict[str, str] | None) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ["UPLOAD_PASSWORD"] = UPLOAD_PASSWORD
    os.environ.setdefault("POWERTOOLS_METRICS_NAMESPACE", "AnalysisQueueBench")
    for name in ("CURRENT_ANALYSIS_VERSION", "STALE_ANALYSIS_DAYS", "PROCESSING_TIMEOUT_MINUTES"):
        os.environ.pop(name, None)
    os.environ.update(extra or {})


def _import_handler():
    code = os.environ.get("BENCH_CODE_DIR") or str(ROOT)  # the run's copy of handler.py
    if code not in sys.path:
        sys.path.insert(0, code)
    started = time.perf_counter()
    import handler

    return handler, time.perf_counter() - started


class ServiceClaimer:
    """A Lambda container of the API function: one /queue request at a time."""

    def __init__(self, url: str, extra_env: dict[str, str] | None = None):
        _service_env(url, extra_env)
        self.handler, self.import_s = _import_handler()
        self.context = self.handler.LocalContext(25, "bench-api")  # the API's Timeout
        self.configure(extra_env)

    def configure(self, extra_env: dict[str, str] | None = None) -> None:
        _service_env(os.environ["DATABASE_URL"], extra_env)
        self.handler.use_runtime(None)

    def get(self, path: str) -> dict:
        return self.handler.api(api_gateway_v2_event(path), self.context)

    def claim(self) -> tuple[str, str | None]:
        """(appid or '' when there is no work, claim token)."""
        response = self.get("/queue")
        if response["statusCode"] != 200:
            raise RuntimeError(f"/queue answered {response['statusCode']}: {response['body']}")
        headers = {k.lower(): v for k, v in (response.get("headers") or {}).items()}
        return response["body"], headers.get(TOKEN_HEADER)


def api_process(pipe, url: str) -> None:
    """The API process of the latency measurements, driven by commands over a pipe:
    ("claims", n) -> [(appid, token, seconds)], ("gets", [(path, n)]) -> {path: [seconds]},
    ("configure", env) -> None, the claim's layers (bench/claim_layers.py):
    ("layers_python", calls) -> (samples, routes before /queue), ("layers_claims", n) ->
    (samples, ran dry), ("layers_profile", n) -> lines, ("layers_close", None) -> None;
    ("stats", None) -> dict, ("exit", None)."""
    service = ServiceClaimer(url)
    layers = None
    while True:
        command, argument = pipe.recv()
        if command.startswith("layers_") and layers is None:
            import claim_layers

            layers = claim_layers.Layers(service, url)
        if command == "claims":
            results = []
            for _ in range(argument):
                started = time.perf_counter()
                appid, token = service.claim()
                results.append((appid, token, time.perf_counter() - started))
                if not appid:
                    break
            pipe.send(results)
        elif command == "gets":
            # [(path, repeats)] -> {path: [seconds of each GET through handler.api]}
            timings = {}
            for path, repeats in argument:
                timings[path] = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    response = service.get(path)
                    timings[path].append(time.perf_counter() - started)
                    if response["statusCode"] != 200:
                        raise RuntimeError(f"{path} answered {response['statusCode']}")
            pipe.send(timings)
        elif command == "layers_python":
            pipe.send((layers.python_series(argument), layers.routes_before))
        elif command == "layers_claims":
            pipe.send(layers.database_round(argument))
        elif command == "layers_profile":
            pipe.send(layers.profile(argument))
        elif command == "layers_close":
            layers.close()
            layers = None
            pipe.send(None)
        elif command == "configure":
            if layers is not None:
                layers.close()
                layers = None
            service.configure(argument)
            pipe.send(None)
        elif command == "stats":
            pipe.send(
                {
                    "peak_rss_mb": peak_rss_mb(),
                    "boto3_loaded": "boto3" in sys.modules,
                    "import_handler_s": service.import_s,
                }
            )
        elif command == "exit":
            pipe.send(None)
            return


def _run_window(claim, barrier, duration: float, quota: int) -> dict:
    """One claim to warm up (a container's first claim also runs the promoter), then
    claims until the window or the quota ends, or the queue runs dry."""
    started = time.perf_counter()
    warmup = claim()
    warmup_s = time.perf_counter() - started
    barrier.wait()
    started = time.perf_counter()
    deadline = started + duration
    claimed: list[tuple[str, str | None]] = []
    latencies: list[float] = []
    empty = False
    while len(claimed) < quota and time.perf_counter() < deadline:
        t = time.perf_counter()
        appid, token = claim()
        latencies.append(time.perf_counter() - t)
        if not appid:
            empty = True
            break
        claimed.append((appid, token))
    return {
        "warmup": (*warmup, warmup_s),
        "claimed": claimed,
        "latencies": latencies,
        "elapsed": time.perf_counter() - started,
        "empty": empty,
        "peak_rss_mb": peak_rss_mb(),
    }


def service_worker(url: str, barrier, results, duration: float, quota: int) -> None:
    """One Lambda container claiming through handler.api for a bounded window."""
    service = ServiceClaimer(url)
    response = service.get("/healthz")  # connect, as a warm container already has
    if response["statusCode"] != 200:
        raise RuntimeError(f"/healthz answered {response['statusCode']}")
    results.put(_run_window(service.claim, barrier, duration, quota))


def floor_worker(url: str, barrier, results, duration: float, quota: int) -> None:
    """One bare pg8000 client running the floor statement for a bounded window."""
    from claims_db import connect

    connection = connect(url, "bench-floor")

    def claim() -> tuple[str, None]:
        rows = connection.run(FLOOR_CLAIM)
        return (rows[0][0] if rows else ""), None

    results.put(_run_window(claim, barrier, duration, quota))
    connection.close()


def claim_sql_worker(url: str, barrier, results, duration: float, quota: int) -> None:
    """One client running the service's claim statement alone: handler.claim_next_app on
    the API's own connection (its session settings, the prepared claim), with no HTTP
    stack. Between the floor and the service: what the claim's SQL costs under
    concurrency, apart from the request's Python."""
    _service_env(url, None)
    handler, _ = _import_handler()
    db = handler.api_connection()
    policy = handler.settings().policy

    def claim() -> tuple[str, str | None]:
        claimed = handler.claim_next_app(db, policy)
        return claimed if claimed else ("", None)

    results.put(_run_window(claim, barrier, duration, quota))
    db.discard()
