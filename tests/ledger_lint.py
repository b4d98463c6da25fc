"""squawk over the ledger files production has not run yet: `python3 tests/ledger_lint.py`
(.ci/run runs it; tests/test_ledger_lint.py tests it). Settings: .squawk.toml.

Each file is linted as the runner applies it: inside a transaction (squawk's
--assume-in-transaction), unless its first line is the no-transaction marker, in which
case it runs on its own and is linted so. Exit status: squawk's (0: nothing found).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SQL_DIR = ROOT / "sql"
CONFIG = ROOT / ".squawk.toml"
# The last ledger file production has applied: every file after it, in the runner's order
# (sorted names), is new and linted. Move it forward when a release is deployed.
LAST_APPLIED_IN_PRODUCTION = "018_analysis_claim_token.sql"
# handler.NO_TRANSACTION_MARKER (not imported: this runs without the service's packages).
NO_TRANSACTION_MARKER = "-- ledger: no-transaction"


def new_ledger_files(directory: Path = SQL_DIR) -> list[Path]:
    """The ledger files after LAST_APPLIED_IN_PRODUCTION, in order."""
    files = sorted(directory.glob("*.sql"))
    if LAST_APPLIED_IN_PRODUCTION not in {path.name for path in files}:
        raise SystemExit(f"{LAST_APPLIED_IN_PRODUCTION} (the production cutoff) is not in sql/")
    return [path for path in files if path.name > LAST_APPLIED_IN_PRODUCTION]


def runs_in_a_transaction(path: Path) -> bool:
    return not path.read_text().startswith(NO_TRANSACTION_MARKER)


def squawk_command(reporter: str = "tty") -> list[str]:
    squawk = shutil.which("squawk")
    if squawk is None:
        raise SystemExit("squawk is not installed: pip install -r tests/requirements.txt")
    return [squawk, "--config", str(CONFIG), "--reporter", reporter]


def squawk(paths: list[Path], in_transaction: bool, reporter: str = "tty"):
    """squawk on `paths`, each run inside a transaction or not."""
    flag = "--assume-in-transaction" if in_transaction else "--no-assume-in-transaction"
    return subprocess.run(
        [*squawk_command(reporter), flag, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def findings(paths: list[Path]) -> list[dict]:
    """squawk's findings on `paths` (JSON records: file, line, rule_name, message, ...),
    each file linted the way the runner runs it."""
    found = []
    for in_transaction in (True, False):
        group = [path for path in paths if runs_in_a_transaction(path) is in_transaction]
        if not group:
            continue
        done = squawk(group, in_transaction, reporter="json")
        if done.returncode not in (0, 1) or not done.stdout.strip():
            raise RuntimeError(f"squawk failed ({done.returncode}): {done.stderr}")
        found += json.loads(done.stdout)
    return found


def main() -> int:
    files = new_ledger_files()
    print(f"squawk {', '.join(p.name for p in files) or '(no new ledger files)'}", flush=True)
    status = 0
    for in_transaction in (True, False):
        group = [path for path in files if runs_in_a_transaction(path) is in_transaction]
        if group:
            done = squawk(group, in_transaction)
            print(done.stdout + done.stderr, end="", flush=True)
            status = status or done.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
