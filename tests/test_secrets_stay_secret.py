"""Secrets stay secret, comparisons are constant-time, and the two tokens are distinct."""

from __future__ import annotations

import hmac
import logging

from kit import ADMIN, ADMIN_TOKEN, ANALYSER, UPLOAD_PASSWORD, configure_service

import handler
from helpers import insert_app


def test_token_comparisons_are_constant_time(client, sql, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(handler.hmac, "compare_digest", spy)
    insert_app(sql, "com.example.app")
    client.get("/ping", headers={"Authorization": "Bearer wrong"})
    assert calls[-1] == (b"wrong", UPLOAD_PASSWORD.encode())
    client.post("/apps", json={"appId": "com.x"}, headers=ANALYSER)
    assert calls[-1] == (UPLOAD_PASSWORD.encode(), ADMIN_TOKEN.encode())
    token = client.get("/queue", headers=ANALYSER).headers["x-analysis-claim-token"]
    client.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        json={"success": True},
        headers={**ANALYSER, "X-Analysis-Claim-Token": "not-it"},
    )
    assert calls[-1] == (b"not-it", token.encode())


def test_tokens_are_not_interchangeable(client, sql):
    insert_app(sql, "com.example.app")
    assert client.get("/queue", headers=ADMIN).status_code == 401
    assert client.post("/apps", json={"appId": "com.x"}, headers=ANALYSER).status_code == 401
    assert client.get("/queue", headers=ANALYSER).status_code == 200
    assert client.post("/apps", json={"appId": "com.x"}, headers=ADMIN).status_code == 201


def test_database_password_never_reaches_logs_or_bodies(client, monkeypatch, capsys, caplog):
    password = "db-pass-7f3a9c"
    configure_service(monkeypatch, f"postgresql://queue:{password}@127.0.0.1:9/queue")
    caplog.set_level(logging.DEBUG)
    bodies = [
        client.get("/queue", headers=ANALYSER).text,
        client.get("/healthz").text,
        client.get("/apps/com.example.app").text,
    ]
    captured = capsys.readouterr()
    everything = "".join(bodies) + captured.out + captured.err + caplog.text
    assert "database unavailable" in everything
    assert password not in everything
    for secret in (UPLOAD_PASSWORD, ADMIN_TOKEN):
        assert secret not in everything
