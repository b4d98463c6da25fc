"""How long /queue waits behind large uploads under `python3 handler.py serve`, with the
routes' blocking work on worker threads (as serve runs) and on the event loop (as it ran
before), measured in one run.

    python bench/serve_fairness.py [--uploads 8] [--rounds 3] [--server-url URL]

For each way and round, a new database (bench_serve_fairness, made afresh on the server; an
embedded PostgreSQL is started when nothing answers at the default URL), --uploads apps
whose tokenless success is stored, and a server on a loopback port: handler.app under
uvicorn as `serve` runs it, with SERVE_WORKER_THREADS worker threads or none. It times
/queue idle, then /queue asked a second after --uploads uploads of about 4 MB each were
sent, and counts the uploads answered before it. Prints each round, then `name=value`
lines of the medians over the rounds: the times, behind_vs_idle for each way, and
loop_vs_threads (the event loop's time behind the uploads over the worker threads').
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import claims_db  # noqa: E402

os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

# _cli_serve's uvicorn, with `worker_threads` threads (0: the work on the event loop).
SERVER = """
import sys, uvicorn, handler
handler.use_cli_runtime(worker_threads=int(sys.argv[2]))
uvicorn.run(handler.app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            http=handler.header_deadline_protocol(),
            timeout_keep_alive=handler.SERVE_KEEP_ALIVE_SECONDS)
"""
PASSWORD = "bench-upload-password"
ANALYSER = {"Authorization": f"Bearer {PASSWORD}"}
IDLE_CLAIMS = 5


def say(text: str) -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def large_analysis() -> bytes:
    """About 4 MB of small nested arrays: slow to parse and check, as a large result is
    (the size tests/test_serve_fairness.py sends)."""
    return json.dumps({"success": True, "items": [[n % 10] for n in range(850_000)]}).encode()


def arranged(server_url: str, uploads: int) -> str:
    """A new migrated database with `uploads` fresh retryable failures (a tokenless
    success replaces each) and IDLE_CLAIMS + 1 queued apps; its URL."""
    import handler

    url = claims_db.recreate_database(server_url, "bench_serve_fairness")
    db = handler.SharedConnection(
        lambda: handler.connection_arguments(handler.load_settings({"DATABASE_URL": url}))
    )
    try:
        handler.apply_migrations(db)
    finally:
        db.discard()
    sql = claims_db.connect(url)
    try:
        sql.run(
            "INSERT INTO apps (appid, details, analysis, analysisversion, analysed, status,"
            " failure_reason, failure_retryable)"
            " SELECT 'up.' || n, '{}', '{\"success\": false}', 4, now(), 'failed',"
            " 'analysis_failed', true FROM generate_series(1, :count) n",
            count=uploads,
        )
        sql.run(
            "INSERT INTO apps (appid, details, status)"
            " SELECT 'next.' || n, jsonb_build_object('reviews', (100 - n)::text), 'queued'"
            " FROM generate_series(1, :count) n",
            count=IDLE_CLAIMS + 1,
        )
    finally:
        sql.close()
    return url


def measure(server_url: str, uploads: int, worker_threads: int) -> dict[str, float]:
    """/queue's time idle (median of IDLE_CLAIMS), its time behind `uploads` large
    uploads, and how many of them were answered first."""
    import httpx

    url = arranged(server_url, uploads)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), str(worker_threads)],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url, "UPLOAD_PASSWORD": PASSWORD},
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not answer within 60 s")
            time.sleep(0.2)

        def timed_claim() -> tuple[float, str]:
            started = time.perf_counter()
            answer = httpx.get(f"{base}/queue", headers=ANALYSER, timeout=300)
            return time.perf_counter() - started, answer.text

        idle = statistics.median(timed_claim()[0] for _ in range(IDLE_CLAIMS))
        body = large_analysis()
        answered: list[int] = []

        def upload(n: int) -> None:
            answer = httpx.post(
                f"{base}/uploadAnalysis?appId=up.{n}&analysisVersion=4",
                content=body,
                headers={**ANALYSER, "Content-Type": "application/json"},
                timeout=300,
            )
            answered.append(answer.status_code)

        threads = [threading.Thread(target=upload, args=(n,)) for n in range(1, uploads + 1)]
        for thread in threads:
            thread.start()
        time.sleep(1)  # the uploads are sent and being worked on
        behind, claimed = timed_claim()
        first = len(answered)
        for thread in threads:
            thread.join(300)
        if claimed != f"next.{IDLE_CLAIMS + 1}" or answered != [200] * uploads:
            raise SystemExit(f"unexpected answers: /queue {claimed!r}, uploads {answered}")
        return {"idle_s": idle, "behind_s": behind, "uploads_answered_first": first}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


def main(argv: list[str] | None = None) -> int:
    import handler

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uploads", type=int, default=8, help="uploads in flight (8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way (3)")
    parser.add_argument(
        "--server-url",
        default=claims_db.DEFAULT_SERVER,
        help="server for the bench_serve_fairness database (an embedded PostgreSQL is"
        " started when nothing answers there)",
    )
    args = parser.parse_args(argv)
    if not claims_db.server_reachable(args.server_url):
        args.server_url = handler.start_embedded_postgres(ROOT / ".local" / "bench-pgdata")
        say(f"no server at the default URL; embedded PostgreSQL at {args.server_url}")
    ways = {"threads": handler.SERVE_WORKER_THREADS, "loop": 0}
    rounds: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for round_number in range(1, args.rounds + 1):
        for way, worker_threads in ways.items():
            found = measure(args.server_url, args.uploads, worker_threads)
            rounds[way].append(found)
            say(
                f"round {round_number}, {way:7} ({worker_threads} worker threads):"
                f" /queue idle {found['idle_s'] * 1000:.1f} ms,"
                f" behind {args.uploads} uploads {found['behind_s']:.2f} s,"
                f" after {found['uploads_answered_first']} of them"
            )
    figures: dict[str, float] = {}
    for way, found in rounds.items():
        for name in found[0]:
            figures[f"{way}_{name}"] = statistics.median(one[name] for one in found)
        figures[f"{way}_behind_vs_idle"] = figures[f"{way}_behind_s"] / figures[f"{way}_idle_s"]
    figures["loop_vs_threads"] = figures["loop_behind_s"] / figures["threads_behind_s"]
    for name, value in figures.items():
        print(f"{name}={value:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
