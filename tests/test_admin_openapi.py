"""The admin API's OpenAPI document (docs/api.md, "The admin API's OpenAPI document"):
GET /admin/api/openapi.json describes every /admin/api route of the route table, each
with every method it has, and is a valid OpenAPI 3.1 document; a route added to the
table without a description fails to build it."""

from __future__ import annotations

import json

import pytest
from kit import ADMIN_TOKEN, configure_service
from openapi_spec_validator import validate

import handler
from helpers import call_api, gateway_event


def admin_api_routes() -> set[tuple[str, str]]:
    return {
        (method.lower(), path)
        for method, path, *_ in handler.ADMIN_ROUTES
        if path.startswith("/admin/api/")
    }


@pytest.mark.no_database
def test_the_document_is_valid_and_names_every_admin_api_route():
    document = handler.admin_openapi(handler.ADMIN_ROUTES)
    validate(document)
    described = {(method, path) for path, item in document["paths"].items() for method in item}
    assert described == admin_api_routes()
    assert ("get", "/admin/api/history") in described  # the newest, as an example
    for path, item in document["paths"].items():
        for operation in item.values():
            named = {p["name"] for p in operation["parameters"] if p["in"] == "path"}
            assert named == set(handler.re.findall(r"\{(\w+)\}", path)), path
            assert operation["summary"], path


@pytest.mark.no_database
def test_a_route_without_a_description_cannot_be_described():
    table = (*handler.ADMIN_ROUTES, ("GET", "/admin/api/new", None, "read"))
    with pytest.raises(KeyError):
        handler.admin_openapi(table)


def test_it_is_served_to_an_operator_and_to_no_one_else(monkeypatch, database_url):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    path = "/admin/api/openapi.json"
    signed = gateway_event("GET", path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    answer = call_api(signed)
    assert answer["statusCode"] == 200
    assert json.loads(answer["body"]) == handler.admin_openapi(handler.ADMIN_ROUTES)
    assert call_api(gateway_event("GET", path))["statusCode"] == 401
