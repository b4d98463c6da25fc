"""What a named analyser's token costs per request: the lookup by hash, against a claim.

    python bench/credential_lookup.py [--analysers 1000] [--apps 5000] [--rounds 2000]

On the embedded PostgreSQL of a temporary directory (or DATABASE_URL's server, in a
database of its own that is dropped after), migrated by the ledger: `--analysers` named
analysers and `--apps` queued apps. Times, on the service's own SharedConnection (generic plans,
as the API runs), interleaved round by round: handler.authenticate_analyser on a valid
token, on an unknown one, and handler.claim_next_app (GET /queue's work). Medians, then
`name=value` lines: lookup_vs_claim (the share a lookup adds to a claim; the decision in
docs/analysers.md, "Revocation: how fast", rests on it being small) and
unknown_vs_valid.
"""

from __future__ import annotations

import argparse
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

import handler  # noqa: E402
from helpers import connect, migrate, with_database  # noqa: E402


def server_url(scratch: Path) -> tuple[str, object | None]:
    configured = os.environ.get("DATABASE_URL")
    if configured:
        return configured, None
    server = handler.embedded_postgres_server(scratch / "pgdata")
    return server.get_uri(), server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--analysers", type=int, default=1000)
    parser.add_argument("--apps", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-credentials-"))
    url, server = server_url(scratch)
    name = f"bench_credentials_{uuid.uuid4().hex[:8]}"
    admin = connect(url)
    admin.run(f"CREATE DATABASE {name}")
    try:
        database = with_database(url, name)
        migrate(database)
        sql = connect(database)
        sql.run(
            "INSERT INTO apps (appid, details) SELECT 'bench.app' || n,"
            " jsonb_build_object('reviews', (n % 997)::text) FROM generate_series(1, :n) n",
            n=args.apps,
        )
        sql.run("ANALYZE")
        sql.close()
        runtime = handler.Runtime(handler.load_settings({"DATABASE_URL": database}))
        db = runtime.api_connection()
        policy = runtime.settings.policy
        bench = handler.Operator("bench", "credential_lookup.py")
        tokens = [
            handler.add_analyser(db, bench, f"pi-{n}")["token"] for n in range(args.analysers)
        ]
        valid, unknown, claims = [], [], []
        for round_number in range(args.rounds):
            token = tokens[round_number % len(tokens)]
            started = time.perf_counter()
            assert handler.authenticate_analyser(db, token) is not None
            valid.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert handler.authenticate_analyser(db, handler.new_analyser_token()) is None
            unknown.append(time.perf_counter() - started)
            started = time.perf_counter()
            handler.claim_next_app(db, policy)
            claims.append(time.perf_counter() - started)
        runtime.close()
        medians = {
            "lookup_valid_ms": statistics.median(valid) * 1000,
            "lookup_unknown_ms": statistics.median(unknown) * 1000,
            "claim_ms": statistics.median(claims) * 1000,
        }
        for key, value in medians.items():
            print(f"{key}={value:.3f}")
        print(f"lookup_vs_claim={medians['lookup_valid_ms'] / medians['claim_ms']:.3f}")
        print(f"unknown_vs_valid={medians['lookup_unknown_ms'] / medians['lookup_valid_ms']:.3f}")
    finally:
        admin.run(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()
        if server is not None:
            server.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
