"""What the events of events/ and the README's curl walkthrough must answer, said once and
read by both the suite and `make sam-local`:

- EVENT_RUN: every event file, in the order one new, unmigrated database goes through
  them (the custom resource's Create applies the ledger, as a deploy does), with the
  parts of each answer that hold on every run: status codes, keys and a few values.
  tests/test_lambda_runtime.py checks the answers of the built package in the emulator,
  and of the entry points in-process, against it; tools/sam_local.py checks those of
  `sam local invoke`. (What one event answers in other states, field by field, is
  tests/test_entry_api.py's, test_entry_migrate.py's and test_entry_report.py's.)
- The README's walkthrough: the README itself shows each command's answer.
  tests/test_api.py runs it against uvicorn, tools/sam_local.py against
  `sam local start-api`, both with run_readme_walkthrough() and comparable().

So a change to what an event or the walkthrough answers is made once: here, or in the
README.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import handler


class Json(dict):
    """An API answer's body: JSON holding (at least) these keys, with these values."""


class _Present:
    def __repr__(self) -> str:
        return "<present>"


PRESENT = _Present()  # the key is there, whatever its value


@dataclass(frozen=True)
class Step:
    function: str  # template.yaml's logical id
    event: str  # a file of events/
    expect: dict  # what the answer holds: mismatches(expect, answer) is empty


LEDGER = ",".join(sorted(path.name for path in handler.SQL_DIR.glob("*.sql")))
ANSWERED = {"Status": "SUCCESS", "PhysicalResourceId": "analysis-queue-migrations"}

EVENT_RUN = [
    Step("MigrationFunction", "cfn-create.json", {**ANSWERED, "Data": {"Applied": LEDGER}}),
    Step("MigrationFunction", "cfn-update.json", {**ANSWERED, "Data": {"Applied": "none"}}),
    Step("MigrationFunction", "cfn-delete.json", ANSWERED),
    Step("ApiFunction", "healthz.json", {"statusCode": 200, "body": Json(status="ok")}),
    Step("ApiFunction", "ping.json", {"statusCode": 200, "body": "online"}),
    Step(
        "ApiFunction",
        "healthz-analyser.json",
        {"statusCode": 200, "body": Json(status="online", analysersLastHour=1)},
    ),
    Step(
        "ApiFunction",
        "add-app.json",
        {"statusCode": 201, "body": Json(appId="com.example.app", status="queued")},
    ),
    Step(
        "ApiFunction",
        "get-app.json",
        {"statusCode": 200, "body": Json(appId="com.example.app", status="queued")},
    ),
    Step(
        "ApiFunction",
        "queue.json",
        {
            "statusCode": 200,
            "body": "com.example.app",
            "headers": {"x-analysis-claim-token": PRESENT},
        },
    ),
    # A failure, then a success replacing it: a failure after the claim's success would
    # be refused (docs/queue.md, "Results").
    Step("ApiFunction", "report-failure.json", {"statusCode": 200, "body": Json(rowCount=1)}),
    # The failure (app_not_found) is final: no candidate, so exact-app mode answers empty.
    Step("ApiFunction", "queue-exact-app.json", {"statusCode": 200, "body": ""}),
    Step("ApiFunction", "upload-analysis.json", {"statusCode": 200, "body": Json(rowCount=1)}),
    Step(
        "ApiFunction",
        "get-app.json",
        {"statusCode": 200, "body": Json(status="analysed", analysisVersion=4)},
    ),
    # The operator's /analysers routes: pi-01 added, its token rotated, listed, revoked.
    Step(
        "ApiFunction",
        "analysers-add.json",
        {"statusCode": 201, "body": Json(name="pi-01", token=PRESENT)},
    ),
    Step(
        "ApiFunction",
        "analysers-rotate.json",
        {"statusCode": 200, "body": Json(name="pi-01", token=PRESENT)},
    ),
    Step(
        "ApiFunction", "analysers-list.json", {"statusCode": 200, "body": Json(analysers=PRESENT)}
    ),
    Step(
        "ApiFunction",
        "analysers-revoke.json",
        {"statusCode": 200, "body": Json(name="pi-01", revoked=PRESENT)},
    ),
    Step(
        "ApiFunction",
        "hold-app.json",
        {"statusCode": 200, "body": Json(appId="com.example.app", outcome="held")},
    ),
    Step(
        "ApiFunction",
        "release-app.json",
        {"statusCode": 200, "body": Json(appId="com.example.app", outcome="released")},
    ),
    Step(
        "ApiFunction",
        "analysers-pause.json",
        {"statusCode": 200, "body": Json(name="pi-01", outcome="paused")},
    ),
    Step(
        "ApiFunction",
        "analysers-resume.json",
        {"statusCode": 200, "body": Json(name="pi-01", outcome="resumed")},
    ),
    Step("ApiFunction", "queue-pause.json", {"statusCode": 200, "body": Json(outcome="paused")}),
    Step("ApiFunction", "queue-resume.json", {"statusCode": 200, "body": Json(outcome="resumed")}),
    # The /operators routes: alice added (a full operator), rotated, listed, revoked.
    Step(
        "ApiFunction",
        "operators-add.json",
        {"statusCode": 201, "body": Json(name="alice", readOnly=False, token=PRESENT)},
    ),
    Step(
        "ApiFunction",
        "operators-rotate.json",
        {"statusCode": 200, "body": Json(name="alice", token=PRESENT)},
    ),
    Step(
        "ApiFunction", "operators-list.json", {"statusCode": 200, "body": Json(operators=PRESENT)}
    ),
    Step(
        "ApiFunction",
        "operators-revoke.json",
        {"statusCode": 200, "body": Json(name="alice", revoked=PRESENT)},
    ),
    Step("ReportFunction", "schedule.json", {"total": 1, "counts": {"analysed": 1}}),
]


def mismatches(expected: object, actual: object, where: str = "answer") -> list[str]:
    """How `actual` differs from what `expected` says it holds (none: it holds it). A dict
    names keys that must be there with matching values (others may be there too), a Json
    a body to parse and match so, PRESENT any value; anything else must be equal."""
    if isinstance(expected, Json):
        try:
            actual = json.loads(actual)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return [f"{where} is not JSON: {actual!r:.300}"]
        return mismatches(dict(expected), actual, where)
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{where} is {actual!r:.300}, not an object"]
        found = []
        for key, value in expected.items():
            if key not in actual:
                found.append(f"{where}[{key!r}] is missing")
            elif value is not PRESENT:
                found += mismatches(value, actual[key], f"{where}[{key!r}]")
        return found
    if actual != expected:
        return [f"{where} is {actual!r:.300}, expected {expected!r:.300}"]
    return []


# --- the README's walkthrough -------------------------------------------------------------


def readme_walkthrough() -> list[tuple[str, list[str]]]:
    """The curl walkthrough of the README: each `$ ` command (with its continuation lines)
    and the lines the README shows it printing."""
    readme = (handler.HERE / "README.md").read_text()
    start = readme.index("Try it with curl once `serve` runs")
    section = readme[start : readme.index("\n## ", start)]
    steps: list[tuple[str, list[str]]] = []
    continued = False
    for line in section.splitlines():
        if line.startswith("    $ "):
            steps.append((line[6:], []))
        elif continued:
            steps[-1] = (steps[-1][0] + "\n" + line[4:], steps[-1][1])
        elif line.startswith("    ") and steps:
            steps[-1][1].append(line[4:])
        continued = line.startswith("    ") and line.endswith("\\")
    return steps


def comparable(lines: list[str]) -> list[str]:
    """Output lines with the times and claim tokens, which differ per run, masked."""
    time = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00"
    token = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    return [re.sub(token, "<token>", re.sub(time, "<time>", line)) for line in lines]


def run_readme_walkthrough(
    port: int, cwd: Path, timeout: float = 60
) -> list[tuple[str, list[str], list[str]]]:
    """Every command of the walkthrough, run as written in one bash (in `cwd`, which
    receives its headers.txt), against 127.0.0.1:`port` instead of localhost:3000:
    (command, the lines the README shows, the lines it printed), in order."""
    steps = readme_walkthrough()
    script = "\n".join(f"echo '@@step'\n{command}" for command, _ in steps)
    script = script.replace("localhost:3000", f"127.0.0.1:{port}")
    run = subprocess.run(
        ["bash", "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if run.returncode != 0:
        raise AssertionError(f"the walkthrough exited {run.returncode}: {run.stderr[-2000:]}")
    printed = run.stdout.split("@@step\n")[1:]
    if len(printed) != len(steps):
        raise AssertionError(f"{len(steps)} commands, {len(printed)} outputs:\n{run.stdout}")
    return [
        (command, shown, output.splitlines())
        for (command, shown), output in zip(steps, printed, strict=True)
    ]
