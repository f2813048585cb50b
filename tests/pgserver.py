"""A private, throwaway PostgreSQL server for the test run (initdb + pg_ctl in a temp dir).

It listens only on a unix socket inside its own directory, so it cannot collide with a
Postgres the machine already runs, and it is removed when the run ends.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = (
    "batchd's tests run against a real PostgreSQL. Either install PostgreSQL's server binaries "
    "(Debian/Ubuntu: `apt-get install postgresql`; macOS: `brew install postgresql`) so that "
    "`initdb` and `pg_ctl` are on PATH or under /usr/lib/postgresql/*/bin, point BATCHD_PG_BIN at "
    "the directory that holds them, or set BATCHD_TEST_DATABASE_URL to a database the tests may "
    "create and drop databases in."
)


class PostgresUnavailable(RuntimeError):
    pass


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``."""
    candidates: list[str] = []
    if os.environ.get("BATCHD_PG_BIN"):
        candidates.append(os.environ["BATCHD_PG_BIN"])
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).parent))

    def version_key(p: str) -> tuple[int, ...]:
        parts = Path(p).parent.name.split(".")
        return tuple(int(x) for x in parts if x.isdigit())

    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version_key, reverse=True)
    candidates += sorted(glob.glob("/usr/local/opt/postgresql*/bin"), reverse=True)
    for c in candidates:
        if (Path(c) / "initdb").exists() and (Path(c) / "pg_ctl").exists():
            return Path(c)
    raise PostgresUnavailable(f"no initdb/pg_ctl found. {INSTALL_HINT}")


def _unprivileged_user() -> str | None:
    """initdb refuses to run as root; as root we run it as an ordinary account."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PostgresUnavailable(
        "running as root and no 'postgres' or 'nobody' user exists to run initdb"
    )


@dataclass
class ThrowawayPostgres:
    bindir: Path
    workdir: Path
    user: str | None

    @property
    def datadir(self) -> Path:
        return self.workdir / "data"

    @property
    def sockdir(self) -> Path:
        return self.workdir

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://batchd@/{database}?host={self.sockdir}"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    @classmethod
    def start(cls) -> ThrowawayPostgres:
        bindir = find_bindir()
        user = _unprivileged_user()
        workdir = Path(tempfile.mkdtemp(prefix="batchd-test-pg-"))
        if user is not None:
            pw = pwd.getpwnam(user)
            os.chown(workdir, pw.pw_uid, pw.pw_gid)
        server = cls(bindir=bindir, workdir=workdir, user=user)
        init = server._run(
            "initdb",
            "-D",
            str(server.datadir),
            "-U",
            "batchd",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        )
        if init.returncode != 0:
            shutil.rmtree(workdir, ignore_errors=True)
            raise PostgresUnavailable(f"initdb failed:\n{init.stdout}\n{init.stderr}")
        started = server._pg_ctl_start()
        if started.returncode != 0:
            log = server.workdir / "postgres.log"
            text = log.read_text() if log.exists() else ""
            server.stop()
            raise PostgresUnavailable(f"pg_ctl start failed:\n{started.stderr}\n{text}")
        return server

    def _pg_ctl_start(self) -> subprocess.CompletedProcess[str]:
        opts = (
            f"-c listen_addresses='' -c unix_socket_directories='{self.sockdir}' "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200 -c shared_buffers=128MB"
        )
        return self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-o",
            opts,
            "-w",
            "-t",
            "60",
            "-l",
            str(self.workdir / "postgres.log"),
            "start",
        )

    def pause(self) -> None:
        """Stop the server (its clients are disconnected), keeping its data for :meth:`resume`."""
        done = self._run("pg_ctl", "-D", str(self.datadir), "-m", "fast", "-w", "stop")
        if done.returncode != 0:
            raise PostgresUnavailable(f"pg_ctl stop failed:\n{done.stderr}")

    def resume(self) -> None:
        """Start the server again after :meth:`pause`."""
        done = self._pg_ctl_start()
        if done.returncode != 0:
            raise PostgresUnavailable(f"pg_ctl start failed:\n{done.stderr}")

    def stop(self) -> None:
        try:
            if (self.datadir / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
