"""The HTTP contract holds through the lean path: the OpenAPI document is the one
tests/openapi.json holds, and every route answers as FastAPI's own resolver would.

handler.py's routes are GuardedRoutes, which call a route's guards from a plan made when
the route is declared instead of FastAPI's per-request dependency resolution, and the
analysers' routes are tried first. Neither may change an answer or the document: generated
requests (methods, paths, Authorization headers) get the same status, headers and body
from the app as from the same declarations on FastAPI's stock APIRoute, with the
analysers' routes tried last. A change to any route's declaration fails the snapshot
test until it is written again and reviewed in its diff:

    python3 tests/test_openapi_is_the_contract.py --write
"""

from __future__ import annotations

import json
import sys

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN_TOKEN, ROOT, UPLOAD_PASSWORD

import handler
from helpers import insert_app

SNAPSHOT = ROOT / "tests" / "openapi.json"


def document_text() -> str:
    return json.dumps(handler.app.openapi(), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def test_the_document_is_the_snapshot():
    assert handler.app.openapi() == json.loads(SNAPSHOT.read_text(encoding="utf-8"))


def test_every_route_is_a_guarded_route():
    declared = [route for route in handler.app.routes if isinstance(route, APIRoute)]
    assert declared and all(isinstance(route, handler.GuardedRoute) for route in declared)


def test_no_other_route_matches_an_analysers_path():
    """So trying the analysers' routes first changes no request's route."""
    for path in handler.ANALYSERS_PATHS:
        others = [route for route in handler.app.routes if route.path != path]
        assert [route.path for route in others if route.path_regex.match(path)] == []
    assert [route.path for route in handler.app.routes[: len(handler.ANALYSERS_PATHS)]] == list(
        handler.ANALYSERS_PATHS
    )


async def _bearer(request: Request) -> str:
    return request.headers.get("authorization", "")


async def _guard(token: str = Depends(_bearer)) -> str:
    return token


async def _nested(token: str = Depends(_guard)) -> str:
    return token


def _declare(endpoint, **options) -> None:
    FastAPI().router.add_api_route(
        "/x", endpoint, route_class_override=handler.GuardedRoute, **options
    )


def test_a_route_of_another_shape_is_refused_when_declared():
    async def takes_a_query(limit: int) -> PlainTextResponse:
        return PlainTextResponse("")

    def not_async(request: Request) -> PlainTextResponse:
        return PlainTextResponse("")

    async def nested_guard(request: Request, token: str = Depends(_nested)) -> PlainTextResponse:
        return PlainTextResponse("")

    async def guard_and_query(limit: int, token: str = Depends(_guard)) -> PlainTextResponse:
        return PlainTextResponse("")

    for endpoint in (takes_a_query, not_async, nested_guard, guard_and_query):
        with pytest.raises(TypeError, match="GuardedRoute"):
            _declare(endpoint)

    async def fine(request: Request, token: str = Depends(_guard)) -> PlainTextResponse:
        return PlainTextResponse(token)

    _declare(fine, dependencies=[Depends(_guard)])


def test_an_endpoint_that_answers_no_response_is_an_error():
    async def answers_a_dict(request: Request) -> dict:
        return {"a": 1}

    app = FastAPI()
    app.router.add_api_route("/x", answers_a_dict, route_class_override=handler.GuardedRoute)
    with TestClient(app, raise_server_exceptions=True) as client:
        with pytest.raises(TypeError, match="answered no Response"):
            client.get("/x")


def stock_app() -> FastAPI:
    """The same declarations on FastAPI's own APIRoute and resolver, with the app's error
    answers, and the analysers' routes tried last instead of first."""
    stock = FastAPI(
        exception_handlers=dict(handler.app.exception_handlers),
        redirect_slashes=handler.app.router.redirect_slashes,
    )
    declared = [route for route in handler.app.routes if isinstance(route, APIRoute)]
    declared.sort(key=lambda route: route.path in handler.ANALYSERS_PATHS)
    for route in declared:
        stock.router.add_api_route(
            route.path,
            route.endpoint,
            methods=route.methods,
            dependencies=route.dependencies,
            include_in_schema=route.include_in_schema,
            route_class_override=APIRoute,
        )
    return stock


# Paths that reach every route, and some that reach none; a token of each kind.
PATHS = (
    "/queue",
    "/queue?appId=com.example.app",
    "/ping",
    "/uploadAnalysis?appId=com.example.app&analysisVersion=1",
    "/reportAnalysisFailure?appId=com.example.app",
    "/apps",
    "/apps/com.example.app",
    "/apps/com.example.none",
    "/analysers",
    "/analysers/pi-1",
    "/analysers/pi-1/rotate",
    "/healthz",
    "/healthz/analyser",
    "/admin",
    "/admin/api/status",
    "/nowhere",
    "/queue/",
)
METHODS = ("GET", "POST", "DELETE", "PUT", "HEAD", "PATCH")
# Requests that may change something are made only with a token every guard refuses,
# so that both apps see the same database; the right tokens go to reads.
READS = ("/apps/com.example.app", "/apps/com.example.none", "/analysers", "/apps", "/healthz")
WRONG_TOKENS = st.one_of(
    st.none(),
    st.text(max_size=20).map(lambda text: f"Bearer {text}"),
    st.sampled_from(["Bearer", "bearer x", "Basic eA==", "Bearer  x", "Token x", ""]),
    st.sampled_from(["aqa_x", "aqa_" + "0" * 40]).map(lambda token: f"Bearer {token}"),
)
RIGHT_TOKENS = st.sampled_from([f"Bearer {UPLOAD_PASSWORD}", f"Bearer {ADMIN_TOKEN}"])


def _answer(client: TestClient, method: str, path: str, authorization: str | None) -> tuple:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = client.request(method, path, headers=headers)
    return response.status_code, sorted(response.headers.items()), response.content


@st.composite
def requests(draw) -> tuple[str, str, str | None]:
    if draw(st.booleans()):
        return "GET", draw(st.sampled_from(READS)), draw(RIGHT_TOKENS)
    authorization = draw(WRONG_TOKENS)
    if authorization is not None and not all(" " <= c <= "~" for c in authorization):
        authorization = None  # a header value is printable ASCII on the wire
    return draw(st.sampled_from(METHODS)), draw(st.sampled_from(PATHS)), authorization


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_generated_requests_get_fastapis_own_answers(request, database_url, sql):
    if not sql.run("SELECT 1 FROM apps WHERE appid = 'com.example.app'"):
        insert_app(sql, "com.example.app")
    method, path, authorization = request
    with TestClient(handler.app, raise_server_exceptions=False) as lean:
        with TestClient(stock_app(), raise_server_exceptions=False) as stock:
            assert _answer(lean, method, path, authorization) == _answer(
                stock, method, path, authorization
            )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python3 tests/test_openapi_is_the_contract.py --write")
    SNAPSHOT.write_text(document_text(), encoding="utf-8")
    print(f"wrote {SNAPSHOT.relative_to(ROOT)}")
