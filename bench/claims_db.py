"""Bare pg8000 connections for the benchmark (no handler import: the floor's clients
and the probes must not carry the service's code)."""

from __future__ import annotations

import socket
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import pg8000.native

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def connection_arguments(url: str) -> dict:
    """pg8000 keyword arguments for a postgresql:// URL (TCP or ?host=<socket dir>)."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError("the database URL must start with postgresql://")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    arguments = {
        "user": unquote(parts.username or "postgres"),
        "password": unquote(parts.password) if parts.password else None,
        "database": unquote(parts.path.lstrip("/")) or "postgres",
    }
    port = parts.port or int(query.get("port", 5432))
    if query.get("host"):
        arguments["unix_sock"] = f"{query['host']}/.s.PGSQL.{port}"
    else:
        arguments.update(host=parts.hostname or "127.0.0.1", port=port)
    return arguments


def connect(url: str, application_name: str = "bench") -> pg8000.native.Connection:
    return pg8000.native.Connection(
        application_name=application_name, timeout=600, **connection_arguments(url)
    )


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def database_name(url: str) -> str:
    return unquote(urlsplit(url).path.lstrip("/")) or "postgres"


def server_reachable(url: str) -> bool:
    arguments = connection_arguments(url)
    if "unix_sock" in arguments:
        return True
    try:
        with socket.create_connection((arguments["host"], arguments["port"]), timeout=2):
            return True
    except OSError:
        return False


def recreate_database(server_url: str, name: str) -> str:
    """Drop (forcing other sessions off) and create a database; returns its URL."""
    admin = connect(server_url)
    try:
        identifier = pg8000.native.identifier(name)
        admin.run(f"DROP DATABASE IF EXISTS {identifier} WITH (FORCE)")
        admin.run(f"CREATE DATABASE {identifier}")
    finally:
        admin.close()
    return with_database(server_url, name)
