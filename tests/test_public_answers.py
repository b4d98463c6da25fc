"""The public answers agree with each other, whatever the caller sends and whatever state
the database is in: GET /apps/{appId} stays public under any Authorization and any
admin-token configuration; /healthz, and every other route, answer a database the ledger
has not reached with a reason (503), never a 500."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN_TOKEN, UPLOAD_PASSWORD, configure_service

import handler
from helpers import call_api, gateway_event, insert_app

pytestmark = pytest.mark.usefixtures("lambda_container")

PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
TOKENS = st.one_of(
    PRINTABLE,
    st.sampled_from(
        [ADMIN_TOKEN, UPLOAD_PASSWORD, "aqa_" + "x" * 43, "", " ", ADMIN_TOKEN + " ", "null"]
    ),
)
SCHEMES = st.sampled_from(["Bearer", "bearer", "BEARER", "Basic", "Token", "", "Bearer:"])


@st.composite
def authorization_values(draw) -> str:
    """One Authorization value: a bearer token, another scheme, a bare token or scheme,
    or several of them as API Gateway joins a header sent more than once (commas)."""
    parts = [
        f"{draw(SCHEMES)} {draw(TOKENS)}".strip()
        if draw(st.booleans())
        else draw(st.one_of(TOKENS, SCHEMES))
        for _ in range(draw(st.integers(1, 3)))
    ]
    return ", ".join(parts)


ADMIN_CONFIGURATIONS = ["admin token set", "admin token unset", "admin secret unreadable"]


@pytest.fixture(params=ADMIN_CONFIGURATIONS)
def admin_configuration(request, database_url, monkeypatch, aws):
    """The API with the admin token in the environment, with none at all, or in a
    Secrets Manager secret that cannot be read (moto has no such secret)."""
    if request.param == "admin token set":
        configure_service(monkeypatch, database_url)
    elif request.param == "admin token unset":
        configure_service(monkeypatch, database_url, ADMIN_TOKEN="")
    else:
        configure_service(
            monkeypatch, database_url, ADMIN_TOKEN="", ADMIN_TOKEN_SECRET="secretsmanager:gone"
        )
    return request.param


def get_app(headers: dict[str, str]) -> dict:
    return call_api(gateway_event("GET", "/apps/com.example.failed", headers=headers))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(authorization=authorization_values())
def test_get_app_is_public_under_any_authorization_and_configuration(
    admin_configuration, sql, authorization
):
    """The same request without a header gets the public answer; with any Authorization
    (any bearer, another scheme, a malformed or repeated header) it gets the same public
    answer, 200, under every admin-token configuration. Only the admin token itself, when
    the server has one, adds what operators see."""
    if not sql.run("SELECT 1 FROM apps"):
        insert_app(sql, "com.example.failed", status="failed", retryable=True, version=4)
    public = get_app({})
    assert public["statusCode"] == 200, public
    assert json.loads(public["body"])["analysis"] is None  # a failure record: admin only
    answer = get_app({"authorization": authorization})
    assert answer["statusCode"] == 200, (authorization, answer)
    scheme, _, token = authorization.partition(" ")
    is_admin_token = scheme.lower() == "bearer" and token.strip() == ADMIN_TOKEN
    if admin_configuration == "admin token set" and is_admin_token:
        assert json.loads(answer["body"])["analysis"] is not None
    else:
        assert answer["body"] == public["body"], authorization


def test_the_admin_token_still_opens_the_admin_view(database_url, sql):
    insert_app(sql, "com.example.failed", status="failed", retryable=True, version=4)
    for scheme in ("Bearer", "bearer"):
        answer = get_app({"authorization": f"{scheme} {ADMIN_TOKEN}"})
        view = json.loads(answer["body"])
        assert answer["statusCode"] == 200
        assert view["analysis"]["logs"] == "boom"
        assert "claimedBy" in view and "analysedBy" in view
