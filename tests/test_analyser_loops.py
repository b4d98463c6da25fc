"""The analysers' loop as the frozen contract describes it (README, "The API"): bash and
curl, the bearer token read from the host's config file, GET /ping, GET /queue (`curl
--fail`; the body is the bundle ID), then POST /uploadAnalysis (`-d @file`) or POST
/reportAnalysisFailure (`--data-binary`), no claim token; and the newer loop that sends
back the X-Analysis-Claim-Token of its claim. Run as they are against a live local server
(loopback, a bounded number of cycles) with per-analyser tokens and the shared password
side by side: only the token in the config file differs."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from kit import ADMIN, UPLOAD_PASSWORD, configure_service

import handler
from helpers import insert_app
from live import LiveServer

# The deployed loop, word for word in what it sends; `analyse` stands for the iPhone
# work: an app whose bundle ID contains "fail" fails, with a log that is not UTF-8.
CONTRACT_LOOP = r"""
set -u
. "$1"   # the host's config: SERVER_URL and UPLOAD_PASSWORD (its bearer token)
SERVER_URL="${SERVER_URL%/}"
work="$(mktemp -d)"
for cycle in $(seq "$2"); do
  curl -s -H "Authorization: Bearer $UPLOAD_PASSWORD" "$SERVER_URL/ping" > /dev/null
  app="$(curl -s --fail -H "Authorization: Bearer $UPLOAD_PASSWORD" "$SERVER_URL/queue")" \
    || app=""
  if [ -z "$app" ]; then echo "cycle $cycle: no work"; continue; fi
  case "$app" in
    *fail*)
      printf 'usb error\n\377 raw bytes\n' > "$work/log.txt"
      curl -s --fail -o /dev/null -X POST -H "Authorization: Bearer $UPLOAD_PASSWORD" \
        -H "Content-Type: text/plain" --data-binary "@$work/log.txt" \
        "$SERVER_URL/reportAnalysisFailure?appId=$app&analysisVersion=4" \
        && echo "cycle $cycle: failed $app" ;;
    *)
      printf '{"success": true,\n "bundleID": "%s", "trackers": {}}\n' "$app" \
        > "$work/analysis.json"
      curl -s --fail -o /dev/null -X POST -H "Authorization: Bearer $UPLOAD_PASSWORD" \
        -H "Content-Type: application/json" -d "@$work/analysis.json" \
        "$SERVER_URL/uploadAnalysis?appId=$app&analysisVersion=4" \
        && echo "cycle $cycle: analysed $app" ;;
  esac
done
"""

# The newer loop: the same, and it sends its claim's token back with the result.
CLAIM_TOKEN_LOOP = r"""
set -u
. "$1"
SERVER_URL="${SERVER_URL%/}"
work="$(mktemp -d)"
for cycle in $(seq "$2"); do
  curl -s -H "Authorization: Bearer $UPLOAD_PASSWORD" "$SERVER_URL/ping" > /dev/null
  app="$(curl -s --fail -D "$work/headers.txt" \
    -H "Authorization: Bearer $UPLOAD_PASSWORD" "$SERVER_URL/queue")" || app=""
  if [ -z "$app" ]; then echo "cycle $cycle: no work"; continue; fi
  claim="$(tr -d '\r' < "$work/headers.txt" \
    | sed -n 's/^[Xx]-[Aa]nalysis-[Cc]laim-[Tt]oken: //p')"
  case "$app" in
    *fail*)
      printf 'usb error\n' > "$work/log.txt"
      curl -s --fail -o /dev/null -X POST -H "Authorization: Bearer $UPLOAD_PASSWORD" \
        -H "X-Analysis-Claim-Token: $claim" \
        -H "Content-Type: text/plain" --data-binary "@$work/log.txt" \
        "$SERVER_URL/reportAnalysisFailure?appId=$app&analysisVersion=4" \
        && echo "cycle $cycle: failed $app" ;;
    *)
      printf '{"success": true, "bundleID": "%s"}' "$app" > "$work/analysis.json"
      curl -s --fail -o /dev/null -X POST -H "Authorization: Bearer $UPLOAD_PASSWORD" \
        -H "X-Analysis-Claim-Token: $claim" \
        -H "Content-Type: application/json" -d "@$work/analysis.json" \
        "$SERVER_URL/uploadAnalysis?appId=$app&analysisVersion=4" \
        && echo "cycle $cycle: analysed $app" ;;
  esac
done
"""


@pytest.fixture
def live(database_url, monkeypatch):
    assert shutil.which("curl"), "curl is not installed: the analysers' loop needs it"
    configure_service(monkeypatch, database_url)
    with LiveServer(handler.app) as server:
        yield server


def host(tmp_path, name: str, server_url: str, token: str):
    """A host's config file, as its .env holds it (the server URL with a trailing slash,
    which the loop strips)."""
    config = tmp_path / f"{name}.env"
    config.write_text(f"SERVER_URL={server_url}/\nUPLOAD_PASSWORD={token}\n")
    return config


def start(loop: str, config, cycles: int) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", loop, "loop", str(config), str(cycles)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen) -> list[str]:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return out.splitlines()


def add_analyser(client, name: str) -> str:
    answer = client.post("/analysers", json={"name": name}, headers=ADMIN)
    assert answer.status_code == 201
    return answer.json()["token"]


def test_loops_complete_cycles_with_their_own_tokens(live, client, sql, tmp_path):
    apps = [f"loop.app{n:02d}" for n in range(9)] + ["loop.fail1", "loop.fail2"]
    for reviews, appid in enumerate(apps):
        insert_app(sql, appid, reviews=str(reviews))
    hosts = {
        "pi-contract": (CONTRACT_LOOP, add_analyser(client, "pi-contract")),
        "pi-newer": (CLAIM_TOKEN_LOOP, add_analyser(client, "pi-newer")),
        "shared": (CONTRACT_LOOP, UPLOAD_PASSWORD),  # a host not moved over yet
    }
    # Each host in turn (so each surely gets work), then all three at once.
    printed = {
        name: finish(start(loop, host(tmp_path, name, live.url, token), cycles=3))
        for name, (loop, token) in hosts.items()
    }
    running = {
        name: start(loop, host(tmp_path, name, live.url, token), cycles=3)
        for name, (loop, token) in hosts.items()
    }
    for name, process in running.items():
        printed[name] += finish(process)
    done = {
        line.split()[-1]: name
        for name, lines in printed.items()
        for line in lines
        if " analysed " in line or " failed " in line
    }
    # Every app was handed out once and its result stored, by the host that claimed it.
    assert sorted(done) == sorted(apps)
    rows = dict(sql.run("SELECT appid, status FROM apps"))
    assert rows == {a: ("failed" if "fail" in a else "analysed") for a in apps}, printed
    by = dict(sql.run("SELECT appid, COALESCE(analysed_by, 'shared') FROM apps"))
    assert by == done
    # In turn, each host's three cycles each had work (11 apps for 9 cycles).
    for name in hosts:
        assert all(" analysed " in line or " failed " in line for line in printed[name][:3])
    listed = {
        row["name"]: row for row in client.get("/analysers", headers=ADMIN).json()["analysers"]
    }
    for name in ("pi-contract", "pi-newer"):
        mine = [a for a, who in done.items() if who == name]
        row = listed[name]
        assert row["online"] and row["holding"] is None
        assert row["results24h"] + row["failures24h"] == len(mine)
        assert row["lastResult"]["appId"] in mine
    assert sql.run("SELECT count(*) FROM analyser_heartbeats") == [[1]]  # the shared host

    # Revoked, the host's loop finds no work (401 is a non-2xx: no work), and claims none.
    insert_app(sql, "loop.late", reviews="99")
    assert client.delete("/analysers/pi-contract", headers=ADMIN).status_code == 200
    config = host(tmp_path, "pi-contract", live.url, hosts["pi-contract"][1])
    assert finish(start(CONTRACT_LOOP, config, cycles=2)) == [
        "cycle 1: no work",
        "cycle 2: no work",
    ]
    assert sql.run("SELECT status FROM apps WHERE appid = 'loop.late'") == [["queued"]]
