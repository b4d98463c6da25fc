"""Does the queue model (tests/test_queue_follows_its_rules.py) catch each of the edge
fixes taken out, and does each guarantee's own test (the one docs/testing.md names for
it) catch its slip?

For every mutation below, a copy of the checkout gets handler.py with that one fix undone,
and the model test runs there (or, for a fix outside the model's reach, the tests named
with it: the file docs/testing.md names for that guarantee). A mutation those tests do
not fail is reported as MISSED. Prints one line per mutation and exits 1 if any was
missed.

    python3 bench/model_mutations.py            # every mutation
    python3 bench/model_mutations.py refetch    # the ones whose name contains "refetch"
    python3 bench/model_mutations.py "compared with" "per chunk"   # either word group

It runs against DATABASE_URL when set, else the copy's own embedded PostgreSQL, with the
"mutations" hypothesis profile (tests/conftest.py): a run stops at its first failing
example, unshrunk, and the line shows that failure.
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

# name -> (text in handler.py, its replacement[, the tests to run]): each undoes one fix.
MODEL = "tests/test_queue_follows_its_rules.py"
MUTATIONS = {
    "refetch breaks a live lease": (
        "REFETCH_LIVE_LEASE = f\"status = 'processing' AND NOT {REFETCH_LEASE_EXPIRED}\"",
        'REFETCH_LIVE_LEASE = "false"',
    ),
    "tokenless results applied in any state": (
        "    if newer:\n        return holders_refused_as_older if held else refused_as_older\n",
        "    return Verdict('store', target.claim)\n",
    ),
    "a stored result is not recognised on a retry": (
        '    if target.same_result and left_by_a_result:\n        return Verdict("stored")',
        '    if False:\n        return Verdict("stored")',
    ),
    "an older version replaces a newer one": (
        "    newer = newer and target.version > version\n",
        "    newer = False\n",
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
    "the back-off's failure is not judged": (
        '                (failed if verdict.action == "store" else returned).append(row["appid"])',
        '                failed.append(row["appid"])',
    ),
    "a holder's refused result counts as a lease without a result": (
        '        lease="ended" if newer and target.version > current_version else "answered",',
        '        lease="",',
    ),
    "a holder's refused result keeps a lease only a newer analyser could answer": (
        '        lease="ended" if newer and target.version > current_version else "answered",',
        '        lease="answered" if newer else "",',
    ),
    "a newer version than the current one is stale by age": (
        "             OR (COALESCE(analysisversion, 0) <= :analysis_version\n",
        "             OR (true\n",
    ),
    "a result that queued its app for a refetch is stored again when resent": (
        '    left_by_a_result = target.status in ("analysed", "failed") or queued_by_its_result\n',
        '    left_by_a_result = target.status in ("analysed", "failed")\n',
    ),
    "a late tokenless result undoes a refetch that waited for a lease": (
        '    if target.status == "queued" and not queued_by_its_result:\n',
        '    if target.status == "queued":\n',
    ),
    "a lease that starts in the future never expires": (
        "     OR processing_started > now() + make_interval(mins => {minutes}))",
        "     OR false)",
        "tests/test_odd_rows_never_break_a_reader.py",
    ),
    "a tokenless result under the shared password ends the holder's lease": (
        '        if verdict.lease == "ended" and claim_token is None and analyser is None:\n',
        "        if False:\n",
    ),
    "the back-off's failure is a newer result than a lower version's": (
        "    newer = target.has_result and not target.server_record and target.version",
        "    newer = target.has_result and target.version",
        "tests/test_queue_holds_at_its_edges.py",
    ),
    "the back-off's failure is no claim's result": (
        "        result_claim_token = analysis_claim_token, result_claim_verified = false,\n",
        "        result_claim_token = NULL, result_claim_verified = false,\n",
        "tests/test_queue_holds_at_its_edges.py",
    ),
    "migrate --dry-run waits for a lock without a timeout": (
        '            connection.run("SET LOCAL lock_timeout = "'
        " + pg8000.native.literal(lock_timeout))\n",
        "",
        "tests/test_cli_operations.py",
    ),
    "an upload is re-serialised through floats": (
        "        raise HTTPException(400, problem)\n    return text, value\n",
        "        raise HTTPException(400, problem)\n"
        "    return json.dumps(json.loads(text)), value\n",
        "tests/test_documents_as_sent.py",
    ),
    "the public answer shows an analyser's own failure reason": (
        "    if reason is None or reason in FAILURE_REASONS:\n        return reason\n",
        "    if True:\n        return reason\n",
        "tests/test_public_answers.py",
    ),
    "an analyser's own failure reason is stored as the app's reason": (
        "        reason = written if written in ANALYSER_FAILURE_REASONS else ANALYSIS_FAILED\n",
        "        reason = written\n",
        "tests/test_public_answers.py",
    ),
    "a secret from the store is compared with ==": (
        "    if hmac.compare_digest(given, expected.encode()):\n",
        "    if given == expected.encode():\n",
        "tests/test_secrets_stay_secret.py",
    ),
    "the web view's session signature is compared with !=": (
        "    if not hmac.compare_digest(signature.encode(),"
        " _session_signature(session_id).encode()):",
        "    if signature.encode() != _session_signature(session_id).encode():",
        "tests/test_secrets_stay_secret.py",
    ),
    "the body limit is checked per chunk": (
        "            if size > limit:\n",
        "            if len(chunk) > limit:\n",
        "tests/test_api.py",
    ),
    "the claim hands out failures that will not be retried": (
        "    OR ((status = 'analysed' OR (status = 'failed' AND failure_retryable))\n",
        "    OR ((status = 'analysed' OR status = 'failed')\n",
        "tests/test_claims_follow_the_oracle.py",
    ),
    "the public answer hides failure records by status": (
        '    withheld = row["failure_record"] and not admin\n',
        '    withheld = row["status"] == "failed" and not admin\n',
        "tests/test_public_answers.py",
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
    for name, (old, new, *tests) in MUTATIONS.items():
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
                *(tests or [MODEL]),
            ],
            cwd=copy,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HYPOTHESIS_PROFILE": "mutations"},
            timeout=1200,
        )
        seconds = time.monotonic() - started
        # A run that ended on the test's timeout, or on anything but a failed assertion,
        # says nothing about the mutation.
        failed = run.returncode == 1 and "failed" in run.stdout.splitlines()[-1]
        caught = failed and "Timeout" not in run.stdout
        reason = next((line.strip() for line in run.stdout.splitlines() if "Error:" in line), "")
        verdict = "caught" if caught else ("TIMEOUT" if failed else "MISSED")
        print(f"{verdict}  {name}  ({seconds:.0f} s) {reason[:120]}")
        missed += not caught
        shutil.rmtree(copy, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
