"""API log lines carry the request id and the cold-start flag.

A fresh interpreter (so the first invocation really is the cold one) invokes handler.api
twice on events/healthz.json against an unreachable database, so the app logs a warning
inside each invocation; every line must name its Lambda request id, API Gateway's
request id, and whether it was the cold start.
"""

from __future__ import annotations

import json
import os

import handler
from helpers import json_lines, run_python

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import handler
event = json.load(open(sys.argv[2]))
for n in (1, 2):
    context = handler.LocalContext(25, "analysis-queue-ApiFunction")
    context.aws_request_id = f"lambda-request-{n}"
    event["requestContext"]["requestId"] = f"apigw-request-{n}"
    answer = handler.api(event, context)
    print(json.dumps({"status": answer["statusCode"]}), flush=True)
"""


def test_every_api_log_line_carries_request_id_and_cold_start():
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DB_", "AWS_"))},
        "DATABASE_URL": "postgresql://postgres@127.0.0.1:9/unreachable",
        "UPLOAD_PASSWORD": "x",
        "ADMIN_TOKEN": "y",
    }
    probe = run_python(PROBE, str(handler.HERE), str(handler.HERE / "events/healthz.json"), env=env)
    assert probe.returncode == 0, probe.stderr
    assert [json.loads(line)["status"] for line in probe.stdout.splitlines()] == [503, 503]
    records = json_lines(probe.stderr, skip_other_lines=True)
    warnings = [r for r in records if r["message"] == "database unavailable"]
    assert len(warnings) == 2, records
    for n, record in enumerate(warnings, start=1):
        assert record["function_request_id"] == f"lambda-request-{n}"
        assert record["correlation_id"] == f"apigw-request-{n}"
        assert record["cold_start"] is (n == 1)
        assert record["function_name"] == "analysis-queue-ApiFunction"
    # Nothing the app logs during an invocation lacks them.
    for record in records:
        assert "function_request_id" in record and "cold_start" in record, record
