"""The disk tier's directory (``--decode-cache-dir``): checked and claimed at start.

NOTE [ One server per directory ]
The disk tier outlives its server, and its entries are served as they are found. So, before
anything is read or written there:

* the directory must be the server user's, and neither its group nor others may write it:
  another user who can put files there can put entries that would be served (the entries
  are also checked one by one: NOTE [ Foreign entries ] in ``shm/entries.py``). The shared
  memory tier is the exception: it lives in ``/dev/shm``, which every user may write by
  design, so there only the per-entry check stands between a planted file and a batch;
* one server at a time: two owners would each count, sweep and evict the other's entries
  and fight over the usage file. The server takes an exclusive ``flock`` on
  :data:`LOCK_NAME` in the directory for as long as it runs (released by the kernel when
  it dies, so a crash leaves nothing to clean up) and writes its pid there; a second server
  is refused, naming the directory and that pid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Final

from batchd_server.errors import FailedPrecondition

__all__ = ["LOCK_NAME", "claim_directory", "release_directory"]

LOCK_NAME: Final = "dc.lock"
_FLAG: Final = "--decode-cache-dir (BATCHD_DECODE_CACHE_DIR)"


def _refuse_open(path: Path, st: os.stat_result) -> None:
    """Raise when ``path`` (its ``st``) is not this server user's alone."""
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != me:
        raise FailedPrecondition(
            f"{_FLAG} {path} is owned by uid {st.st_uid}, not by this server's uid {me}: its "
            "owner could put entries there that this server would serve. Give the server a "
            f"directory of its own user (chown {me} {path}) or choose another"
        )
    if mode & 0o022:
        raise FailedPrecondition(
            f"{_FLAG} {path} has mode {mode:04o}: its group or others may write it, and could "
            "put entries there that this server would serve. Run chmod go-w on it, or "
            "choose a directory only the server's user may write"
        )


def claim_directory(path: Path) -> int:
    """Make ``path`` if needed (mode 0700), check it is the server user's alone and take its
    lock (NOTE [ One server per directory ]).

    Returns:
        The open lock file: the directory is this server's until it is closed.

    Raises:
        FailedPrecondition: ``path`` is not a directory, is another user's or writable by
            others, or another server holds it.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise FailedPrecondition(
            f"{_FLAG} {path}: {e.strerror or e}; give a directory on a local disk that the "
            "server's user may create and write"
        ) from e
    try:
        _refuse_open(path, os.fstat(dir_fd))
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(LOCK_NAME, flags, 0o600, dir_fd=dir_fd)
        except OSError as e:
            raise FailedPrecondition(
                f"{_FLAG} {path}: cannot open its lock file {LOCK_NAME}: {e.strerror or e}"
            ) from e
    finally:
        os.close(dir_fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise FailedPrecondition(
                f"{_FLAG} {path} is in use by another batchd server (pid {holder}, as that "
                "server wrote it; in another container's PID namespace if it runs in one). "
                "Two servers on one directory would evict each other's entries: give each "
                "server a directory of its own, or stop the other one first"
            ) from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_directory(fd: int) -> None:
    """Give up a directory :func:`claim_directory` took; idempotent per fd."""
    with contextlib.suppress(OSError):
        os.close(fd)
