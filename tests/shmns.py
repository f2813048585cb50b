"""Run Python code with a small, private ``/dev/shm``: a tmpfs in a new mount namespace.

``unshare --mount`` gives the child its own mount table with private propagation, so the
tmpfs mounted over ``/dev/shm`` there is invisible to every other process, and it vanishes
with its last process. This needs root (or CAP_SYS_ADMIN), as on the test machines and CI;
``unavailable_reason`` says why it cannot be done elsewhere, so that tests can skip loudly.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys

__all__ = ["SETUP_FAILED", "run_with_small_shm", "unavailable_reason"]

SETUP_FAILED = 97
"""Exit status of the wrapper when it could not mount the tmpfs."""

_WRAPPER = 'mount -t tmpfs -o "size=$1" batchd-test-shm /dev/shm || exit {code}; shift; exec "$@"'


def _command(size: str, argv: list[str]) -> list[str]:
    wrapper = _WRAPPER.format(code=SETUP_FAILED)
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        wrapper,
        "sh",
        size,
        *argv,
    ]


@functools.cache
def unavailable_reason() -> str | None:
    """Why a private tmpfs cannot be mounted at ``/dev/shm`` here, or None when it can."""
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not on PATH"
    probe = subprocess.run(
        _command("1m", ["true"]), capture_output=True, text=True, timeout=60, check=False
    )
    if probe.returncode != 0:
        return f"unshare/mount exited {probe.returncode}: {probe.stderr.strip()}"
    return None


def run_with_small_shm(
    script: str, *, size: str = "64m", timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with this interpreter, ``/dev/shm`` being a fresh tmpfs of ``size``.

    Args:
        script: Python source, run as ``python -c script``.
        size: The tmpfs ``size=`` mount option (``"64m"``).
        timeout_s: Kill the child after this long.

    Returns:
        The finished child; its returncode is ``-signal`` if a signal (SIGBUS) killed it.
    """
    argv = _command(size, [sys.executable, "-c", script])
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
