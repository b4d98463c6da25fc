"""Soak: 32 simulated analysers against the real server on loopback, for a few minutes.

    python bench/soak.py [--database-url URL] [--analysers 32] [--seconds 180]

The server is `python3 handler.py serve` (uvicorn, one process, one database connection)
on 127.0.0.1; the database defaults to the 1M-app one bench/claims.py leaves behind
(bench_1000000 on the local PostgreSQL). Each analyser loops ping -> queue -> upload (one
in ten reports a failure instead), with its claim token, until the time is up. Every
request goes to 127.0.0.1 and the run stops by itself.

It prints the number of double claims (an app handed out twice while nothing made it a
candidate again: every result here is stored on the current version, so any repeat is
one), the number of 5xx answers, claim latency (median, p99) and the server's memory at
start and end, then `name=value` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "soak-upload-password"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(database_url: str, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "UPLOAD_PASSWORD": TOKEN,
        "ADMIN_TOKEN": "soak-admin-token",
    }
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "handler.py"), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("the server did not start")


def analyser(number: int, base: str, stop_at: float, results: dict, lock: threading.Lock):
    rng = random.Random(number)
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Analyser-Id": f"soak-{number}"}
    with httpx.Client(base_url=base, timeout=30) as http:
        while time.monotonic() < stop_at:
            statuses = [http.get("/ping", headers=headers).status_code]
            started = time.perf_counter()
            claim = http.get("/queue", headers=headers)
            latency = time.perf_counter() - started
            statuses.append(claim.status_code)
            appid = claim.text if claim.status_code == 200 else ""
            if appid:
                token = claim.headers["x-analysis-claim-token"]
                claim_headers = {**headers, "X-Analysis-Claim-Token": token}
                if rng.random() < 0.1:
                    answer = http.post(
                        f"/reportAnalysisFailure?appId={appid}&analysisVersion=4",
                        content=b"usb disconnected\n" * 50,
                        headers={**claim_headers, "Content-Type": "text/plain"},
                    )
                else:
                    answer = http.post(
                        f"/uploadAnalysis?appId={appid}&analysisVersion=4",
                        content=json.dumps({"success": True, "trackers": {}, "soak": number}),
                        headers={**claim_headers, "Content-Type": "application/json"},
                    )
                statuses.append(answer.status_code)
            with lock:
                results["latencies"].append(latency)
                results["statuses"].update(statuses)
                if appid:
                    results["claimed"].append(appid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--database-url", default="postgresql://postgres@127.0.0.1:5432/bench_1000000"
    )
    parser.add_argument("--analysers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=180)
    args = parser.parse_args()

    port = free_port()
    server = start_server(args.database_url, port)
    base = f"http://127.0.0.1:{port}"
    try:
        httpx.get(f"{base}/ping", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        rss_start = rss_mb(server.pid)
        results = {"latencies": [], "statuses": Counter(), "claimed": []}
        lock = threading.Lock()
        stop_at = time.monotonic() + args.seconds
        threads = [
            threading.Thread(target=analyser, args=(n, base, stop_at, results, lock))
            for n in range(args.analysers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=args.seconds + 120)
        rss_end = rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)

    claimed = results["claimed"]
    double_claims = len(claimed) - len(set(claimed))
    server_errors = sum(n for status, n in results["statuses"].items() if status >= 500)
    latencies = sorted(results["latencies"])
    p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan")
    print(f"analysers {args.analysers}, {args.seconds:.0f} s, server on {base}")
    print(f"requests by status: {dict(sorted(results['statuses'].items()))}")
    print(f"claims: {len(claimed)} apps handed out, {len(claimed) / args.seconds:.1f}/s")
    print(
        f"claim latency: median {statistics.median(latencies) * 1000:.1f} ms,"
        f" p99 {p99 * 1000:.1f} ms"
    )
    print(f"server RSS: start {rss_start:.1f} MB, end {rss_end:.1f} MB")
    print(f"double_claims={double_claims}")
    print(f"server_errors={server_errors}")
    print(f"claim_p99_ms={p99 * 1000:.1f}")
    print(f"rss_start_mb={rss_start:.1f}")
    print(f"rss_end_mb={rss_end:.1f}")
    return 0 if double_claims == 0 and server_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
