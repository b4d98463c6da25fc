"""Does the queue model (tests/test_model.py) catch each of the edge fixes taken out?

For every mutation below, a copy of the checkout gets handler.py with that one fix undone,
and the model test runs there. A mutation the model does not fail is reported as MISSED.
Prints one line per mutation and exits 1 if any was missed.

    python3 bench/model_mutations.py            # every mutation
    python3 bench/model_mutations.py refetch    # the ones whose name contains "refetch"

It runs against DATABASE_URL when set, else the copy's own embedded PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (text in handler.py, its replacement): each undoes one fix.
MUTATIONS = {
    "refetch breaks a live lease": (
        "status = 'processing' AND NOT :force\n",
        "false AND NOT :force\n",
    ),
    "tokenless results applied in any state": (
        "    if newer:\n        return refused_as_older\n    if held:",
        "    return Verdict('store', target.claim)\n    if held:",
    ),
    "a stored result is not recognised on a retry": (
        '    if target.same_result and finished:\n        return Verdict("stored")',
        '    if False:\n        return Verdict("stored")',
    ),
    "an older version replaces a newer one": (
        "newer = target.has_result and target.version is not None",
        "newer = False and target.version is not None",
    ),
    "a tokenless result spends the open claim's token": (
        '            replaceable = target.status != "processing" and not target.result_verified',
        "            replaceable = False",
    ),
    "outdated results are due at once": (
        "OUTDATED_RESULT_SETTLED = f\"COALESCE(analysed, '-infinity') < {LEASE_CUTOFF}\"",
        'OUTDATED_RESULT_SETTLED = "true"',
    ),
    "expired leases are handed out forever": (
        '"max_lease_attempts": self.max_lease_attempts,',
        '"max_lease_attempts": 10**6,',
    ),
}


def mutated_checkout(old: str, new: str) -> Path:
    """A copy of the checkout (without .git and the embedded PostgreSQL's data) whose
    handler.py has `old` replaced by `new`."""
    copy = Path(tempfile.mkdtemp(prefix="mutation-")) / "checkout"
    shutil.copytree(
        ROOT, copy, ignore=shutil.ignore_patterns(".git", ".local", "__pycache__", ".hypothesis")
    )
    text = (copy / "handler.py").read_text()
    if text.count(old) != 1:
        raise SystemExit(f"the mutation's text is not in handler.py once: {old!r}")
    (copy / "handler.py").write_text(text.replace(old, new))
    return copy


def main() -> int:
    wanted = sys.argv[1:]
    missed = 0
    for name, (old, new) in MUTATIONS.items():
        if wanted and not any(word in name for word in wanted):
            continue
        copy = mutated_checkout(old, new)
        started = time.monotonic()
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                "tests/test_model.py",
            ],
            cwd=copy,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            timeout=1200,
        )
        seconds = time.monotonic() - started
        caught = run.returncode == 1 and "failed" in run.stdout.splitlines()[-1]
        reason = next((line.strip() for line in run.stdout.splitlines() if "Error:" in line), "")
        print(f"{'caught' if caught else 'MISSED'}  {name}  ({seconds:.0f} s) {reason[:120]}")
        missed += not caught
        shutil.rmtree(copy, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
