"""``batchd-server healthcheck``: exit 0 when healthy, else 1 and one line saying what to
change; without a server it checks shared memory alone (a Docker HEALTHCHECK, a pre-flight)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import shmns

HEALTHCHECK = [sys.executable, "-m", "batchd_server.cli", "healthcheck"]

_SMALL_SHM = """
import json, subprocess, sys
cmd = [sys.executable, "-m", "batchd_server.cli", "healthcheck"]
out = {}
for name, extra in (("default", []), ("1GiB", ["--min-free-shm", "1GiB"])):
    done = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
    out[name] = [done.returncode, done.stdout, done.stderr]
print(json.dumps(out))
"""


def test_without_a_server_a_roomy_dev_shm_is_healthy(tmp_path: Path) -> None:
    """No --target: only /dev/shm is checked, against the default need of one image session;
    no catalog is touched (BATCHD_HOME stays empty)."""
    env = {"BATCHD_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(HEALTHCHECK, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done
    assert done.stdout.startswith("healthy: /dev/shm has ")
    assert done.stdout.rstrip().endswith("free, batchd needs 56.0 MiB")
    assert not (tmp_path / "home").exists()


def test_under_a_64mb_dev_shm_it_fails_with_one_line_naming_the_fix() -> None:
    """Docker's default 64 MB /dev/shm: enough for the default need (exit 0); asked for
    1 GiB it exits 1 with one line naming /dev/shm, both sizes and shm_size / sizeLimit."""
    reason = shmns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot mount a private 64 MB tmpfs on /dev/shm: {reason}")
    child = shmns.run_with_small_shm(_SMALL_SHM, size="64m", timeout_s=240)
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    code, stdout, stderr = out["default"]
    assert code == 0, (stdout, stderr)
    code, stdout, stderr = out["1GiB"]
    assert code == 1, (stdout, stderr)
    [line] = stdout.splitlines()
    assert line.startswith(
        "/dev/shm has 64.0 MiB free, batchd needs 1.0 GiB: set shm_size: 2gb in docker-compose.yml"
    ), line
    assert "emptyDir with medium: Memory and sizeLimit: 2Gi mounted at /dev/shm" in line


def test_a_target_nobody_listens_on_is_unhealthy_and_says_so(tmp_path: Path) -> None:
    """--target with no server behind it: exit 1, one line naming the address."""
    target = f"unix://{tmp_path}/nobody.sock"
    done = subprocess.run(
        [*HEALTHCHECK, "--target", target, "--timeout-s", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done
    [line] = done.stdout.splitlines()
    assert line.startswith(f"nothing answers at {target}") and "--target" in line


def test_the_healthcheck_reads_the_tls_variables_the_client_library_reads() -> None:
    """A container set up for batchd clients (BATCHD_TLS_CA, BATCHD_TLS_CLIENT_CERT/KEY)
    needs nothing more for `healthcheck --target` over TLS."""
    from batchd._channel import TLS_CA_ENV, TLS_CLIENT_CERT_ENV, TLS_CLIENT_KEY_ENV
    from batchd_server.config import ServerConfig
    from batchd_server.settings import setting_of

    names = ("healthcheck_tls_ca", "healthcheck_tls_client_cert", "healthcheck_tls_client_key")
    envs = tuple(setting_of(ServerConfig, name).env for name in names)
    assert envs == (TLS_CA_ENV, TLS_CLIENT_CERT_ENV, TLS_CLIENT_KEY_ENV)
