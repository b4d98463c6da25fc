"""Lambda's 6 MB limits, both ways.

* A response: the runtime sends the handler's return value as one JSON document, so the
  body is escaped once more inside it. Whatever is stored (the largest accepted upload or
  failure log, full of quotes, control characters and characters outside the BMP), the
  answer of GET /apps/{appId} fits, with the large part left out and said so.
* A request: a body of MAX_BODY_BYTES, base64-encoded by API Gateway, fits the 6 MB
  invocation limit with the event's other fields.
"""

from __future__ import annotations

import json

import pytest
from kit import ADMIN_TOKEN, UPLOAD_PASSWORD

import handler
from helpers import app_row, call_api, gateway_event, insert_app

LIMIT = handler.LAMBDA_PAYLOAD_LIMIT_BYTES
ANALYSER = {"authorization": f"Bearer {UPLOAD_PASSWORD}"}
MAX_BODY = handler.DEFAULT_MAX_BODY_BYTES


def invocation_bytes(response: dict) -> int:
    """The size of what the Lambda runtime sends back (ASCII-escaped JSON, the worst)."""
    return len(json.dumps(response).encode())


def worst_text(size: int) -> str:
    """Text whose JSON (as the analyser sends it) is about size bytes, made of what grows
    most when escaped again: quotes, backslashes, control and astral characters."""
    pattern = '"\\\x01💥\ufffd</'
    encoded = len(json.dumps(pattern, ensure_ascii=False).encode()) - 2
    return pattern * (size // encoded)


@pytest.mark.parametrize(
    "log",
    [
        b'"' * MAX_BODY,
        b"\x01" * MAX_BODY,
        b"\xff" * MAX_BODY,  # invalid UTF-8: each byte becomes U+FFFD
        "💥".encode() * (MAX_BODY // 4),
    ],
    ids=["quotes", "control", "invalid-utf8", "emoji"],
)
def test_the_largest_failure_log_gives_an_answer_that_fits(database_url, sql, log):
    insert_app(sql, "big.app", status="processing")
    stored = call_api(
        gateway_event(
            "POST",
            "/reportAnalysisFailure",
            "appId=big.app&analysisVersion=4",
            headers={**ANALYSER, "content-type": "text/plain"},
            body=log,
            base64_body=True,
        )
    )
    assert stored["statusCode"] == 200
    assert invocation_bytes(stored) < LIMIT
    # Public: a failure record is never answered, whatever its size.
    public = call_api(gateway_event("GET", "/apps/big.app"))
    assert public["statusCode"] == 200
    view = json.loads(public["body"])
    assert view["status"] == "failed" and view["analysis"] is None
    assert view["failure"] == {"reason": "analysis_failed", "retryable": True}
    # With the admin token it is, and one too large for an answer is left out, said so.
    answer = call_api(
        gateway_event("GET", "/apps/big.app", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    )
    assert answer["statusCode"] == 200
    assert invocation_bytes(answer) < LIMIT
    view = json.loads(answer["body"])
    assert view["status"] == "failed"
    assert view["failure"] == {"reason": "analysis_failed", "retryable": True}
    assert view["analysis"] is None
    assert "more than a response can carry" in view["analysisOmitted"]
    assert app_row(sql, "big.app")["analysis"]["logs"][:10]  # stored in full


def test_a_large_analysis_and_large_details_are_left_out_in_turn(database_url, sql):
    text = worst_text(MAX_BODY - 100)
    added = call_api(
        gateway_event(
            "POST",
            "/apps",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"},
            body=json.dumps(
                {"appId": "big.app", "details": {"title": text}}, ensure_ascii=False
            ).encode(),
            base64_body=True,
        )
    )
    assert added["statusCode"] == 201
    assert invocation_bytes(added) < LIMIT
    sql.run("UPDATE apps SET status = 'processing'")
    uploaded = call_api(
        gateway_event(
            "POST",
            "/uploadAnalysis",
            "appId=big.app&analysisVersion=4",
            headers={**ANALYSER, "content-type": "application/json"},
            body=json.dumps({"success": True, "notes": text}, ensure_ascii=False).encode(),
            base64_body=True,
        )
    )
    assert uploaded["statusCode"] == 200
    assert invocation_bytes(uploaded) < LIMIT
    answer = call_api(gateway_event("GET", "/apps/big.app"))
    assert invocation_bytes(answer) < LIMIT
    view = json.loads(answer["body"])
    assert view["analysis"] is None and view["details"] is None
    assert set(view) >= {"analysisOmitted", "detailsOmitted"}


def test_a_small_document_is_answered_whole(database_url, sql):
    insert_app(
        sql, "small.app", status="analysed", version=4, analysis={"success": True, "q": '"' * 1000}
    )
    view = json.loads(call_api(gateway_event("GET", "/apps/small.app"))["body"])
    assert view["analysis"] == {"success": True, "q": '"' * 1000}
    assert "analysisOmitted" not in view


@pytest.mark.parametrize("size", [MAX_BODY, handler.load_settings({}).max_body_bytes])
def test_the_largest_body_fits_the_invocation_limit_in_base64(size):
    headers = {
        **ANALYSER,
        "content-type": "text/plain",
        "user-agent": "curl/7.88.1",
        "x-amzn-trace-id": "Root=1-67d15e24-0123456789abcdef01234567",
        "x-forwarded-for": "203.0.113.10",
        "x-forwarded-port": "443",
        "x-forwarded-proto": "https",
    }
    event = gateway_event(
        "POST",
        "/reportAnalysisFailure",
        "appId=" + "a" * 255 + "&analysisVersion=4",
        headers=headers,
        body=b"\xff" * size,
        base64_body=True,
    )
    assert len(json.dumps(event).encode()) < LIMIT - 64 * 1024


def test_one_byte_over_the_limit_is_refused(database_url, sql):
    insert_app(sql, "big.app", status="processing")
    answer = call_api(
        gateway_event(
            "POST",
            "/reportAnalysisFailure",
            "appId=big.app&analysisVersion=4",
            headers={**ANALYSER, "content-type": "text/plain"},
            body=b"x" * (MAX_BODY + 1),
            base64_body=True,
        )
    )
    assert answer["statusCode"] == 413
    assert app_row(sql, "big.app")["status"] == "processing"


def test_a_legacy_document_too_large_to_answer_is_not_even_read(database_url, sql):
    """Rows written before the limits (or by another program) may hold documents of any
    size; only their size is read, and the answer says so."""
    insert_app(sql, "legacy.app", status="analysed", version=4)
    sql.run(
        """UPDATE apps SET analysis = jsonb_build_object('success', true, 'blob',
               repeat('x', :n)) WHERE appid = 'legacy.app'""",
        n=LIMIT + 1000,
    )
    answer = call_api(gateway_event("GET", "/apps/legacy.app"))
    assert answer["statusCode"] == 200
    assert invocation_bytes(answer) < LIMIT
    view = json.loads(answer["body"])
    assert view["analysis"] is None
    assert f"is {LIMIT + 1000 + 29} bytes" in view["analysisOmitted"]
