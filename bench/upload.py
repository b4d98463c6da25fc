"""What an upload costs against the least any service could do with its document.

    python bench/upload.py [--runs 7] [--server-url URL]

In a database of its own (on DATABASE_URL's server, or --server-url, else the embedded
PostgreSQL of a temporary directory), migrated by the ledger, dropped after. For an
analysis document of 1 MB and one of 4.4 MB (just under MAX_BODY_BYTES), interleaved run
by run:

* upload: `POST /uploadAnalysis` through handler.api (the Lambda entry point, in
  process, as API Gateway invokes it) for an app being processed, without a claim token
  as the deployed analysers send it: the parse and checks in Python, the judgement, the
  store and its history row;
* floor: a bare pg8000 `INSERT INTO scratch (doc) VALUES (CAST(:doc AS jsonb))` of the
  same text into a table of one jsonb column: PostgreSQL parsing the document once and
  storing it once, with nothing else;
* parse: `SELECT CAST(:doc AS jsonb) IS NOT NULL`: one parse of the document by
  PostgreSQL, the part of the floor an extra cast of it would add.

Medians, then `name=value` lines: upload_1mb_vs_floor, upload_4_4mb_vs_floor (the
service's cost as a multiple of the floor's) and parse_4_4mb_vs_floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

import handler  # noqa: E402
from helpers import LambdaContext, connect, gateway_event, migrate, with_database  # noqa: E402

PASSWORD = "bench-upload-password"
SIZES = {"1mb": 1_000_000, "4_4mb": 4_400_000}


def analysis_document(size: int) -> str:
    """An analysis of about `size` bytes, shaped as the analysers' are: trackers and
    permissions, then many recorded requests (text, integers, decimals, nested objects)."""
    head = {
        "success": True,
        "analysis_source": "bench",
        "analysis_version": "4",
        "bundleID": "bench.upload",
        "version": "5.2.1",
        "trackers": {f"Tracker {n}": f"Company {n % 17}" for n in range(40)},
        "permissions": ["Camera", "Location", "Contacts"],
    }
    requests, text, n = [], json.dumps(head), 0
    while len(text) < size:
        for _ in range(500):
            requests.append(
                {
                    "url": f"https://host{n % 97}.example.com/v1/collect/{n}?id={n * 7919}",
                    "method": "POST" if n % 3 else "GET",
                    "bytes": n * 37 % 100_003,
                    "time": round(1_700_000_000.123456 + n / 7, 6),
                    "score": n / 3,
                    "headers": {"content-type": "application/json", "x-n": str(n)},
                    "tags": [n % 5, n % 11, None, True],
                }
            )
            n += 1
        text = json.dumps({**head, "requests": requests})
    return text


def server_url(args: argparse.Namespace, scratch: Path) -> tuple[str, object | None]:
    configured = args.server_url or os.environ.get("DATABASE_URL")
    if configured:
        return configured, None
    server = handler.embedded_postgres_server(scratch / "pgdata")
    return server.get_uri(), server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--server-url")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-upload-"))
    url, server = server_url(args, scratch)
    name = f"bench_upload_{uuid.uuid4().hex[:8]}"
    admin = connect(url)
    admin.run(f"CREATE DATABASE {name}")
    try:
        database = with_database(url, name)
        migrate(database)
        sql = connect(database)
        sql.run("CREATE TABLE scratch (doc jsonb)")
        sql.run("INSERT INTO apps (appid) VALUES ('bench.upload')")
        handler.use_runtime(
            handler.Runtime(
                handler.load_settings({"DATABASE_URL": database, "UPLOAD_PASSWORD": PASSWORD})
            )
        )
        context = LambdaContext("analysis-queue-ApiFunction")
        timings: dict[str, list[float]] = {}
        for label, size in SIZES.items():
            document = analysis_document(size)
            event = gateway_event(
                "POST",
                "/uploadAnalysis",
                "appId=bench.upload&analysisVersion=4",
                headers={
                    "authorization": f"Bearer {PASSWORD}",
                    "content-type": "application/json",
                },
                body=document,
            )
            for run in range(args.runs + 1):  # the first of each is a warm-up
                # The app is being processed and holds no result: each upload is stored.
                sql.run("DELETE FROM app_analyses")
                sql.run(
                    "UPDATE apps SET status = 'processing', processing_started = now(),"
                    " analysis = NULL, analysed = NULL, analysisversion = NULL"
                )
                sql.run("TRUNCATE scratch")
                started = time.perf_counter()
                answer = handler.api(event, context)
                upload = time.perf_counter() - started
                assert answer["statusCode"] == 200, answer["body"][:300]
                started = time.perf_counter()
                sql.run("INSERT INTO scratch (doc) VALUES (CAST(:doc AS jsonb))", doc=document)
                floor = time.perf_counter() - started
                started = time.perf_counter()
                sql.run("SELECT CAST(:doc AS jsonb) IS NOT NULL", doc=document)
                parse = time.perf_counter() - started
                if run:
                    for kind, seconds in (("upload", upload), ("floor", floor), ("parse", parse)):
                        timings.setdefault(f"{kind}_{label}", []).append(seconds)
            median = {
                kind: statistics.median(timings[f"{kind}_{label}"])
                for kind in ("upload", "floor", "parse")
            }
            print(
                f"{label}: {len(document) / 1e6:.2f} MB; upload {median['upload']:.3f} s,"
                f" floor {median['floor']:.3f} s, one parse {median['parse']:.3f} s"
                f" (medians of {args.runs})"
            )
        medians = {name: statistics.median(series) for name, series in timings.items()}
        for label in SIZES:
            ratio = medians[f"upload_{label}"] / medians[f"floor_{label}"]
            print(f"upload_{label}_vs_floor={ratio:.2f}")
        print(f"parse_4_4mb_vs_floor={medians['parse_4_4mb'] / medians['floor_4_4mb']:.2f}")
        sql.close()
    finally:
        handler.use_runtime(None)
        admin.run(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()
        if server is not None:
            server.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
