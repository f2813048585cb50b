"""Transient I/O errors while reading samples (``pipelines/transient.py``): which errnos are
retried, how often and with which pauses, what a persistent one becomes, and that a file
that gave up in a batch costs no more retries in that batch. Real files; the errors come
from the test-only hook the workers honour (``BATCHD_TESTING_READ_ERRORS``)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from batchd_server.pipelines.base import BadSample
from batchd_server.pipelines.transient import (
    FAULTS_ENV,
    FIRST_DELAY_S,
    TRANSIENT_ERRNOS,
    TRIES,
    TransientError,
    retrying,
)
from batchd_server.storage.files import SampleFiles


def test_the_errnos_the_issue_names_are_transient_and_a_permission_error_is_not() -> None:
    for name in ("EIO", "EMFILE", "ESTALE", "ENOMEM", "EAGAIN"):
        assert getattr(errno, name) in TRANSIENT_ERRNOS, name
    assert errno.EACCES not in TRANSIENT_ERRNOS and errno.ENOENT not in TRANSIENT_ERRNOS


def test_retries_back_off_and_stop_at_the_first_success() -> None:
    sleeps: list[float] = []
    forgotten: list[str] = []
    failures = iter([OSError(errno.EIO, "Input/output error")] * 2)

    def attempt() -> str:
        error = next(failures, None)
        if error is not None:
            raise TransientError("a.bin", error)
        return "bytes"

    got = retrying(attempt, forget=forgotten.extend, given_up={}, sleep=sleeps.append)
    assert got == "bytes"
    assert sleeps == [FIRST_DELAY_S, 4 * FIRST_DELAY_S]
    assert forgotten == ["a.bin", "a.bin"], "a stale descriptor is reopened, not retried"


def test_a_persistent_error_is_a_transient_sample_error_and_is_not_retried_again() -> None:
    sleeps: list[float] = []
    given_up: dict[str, str] = {}
    calls = 0

    def attempt() -> str:
        nonlocal calls
        calls += 1
        raise TransientError("b.bin", OSError(errno.ESTALE, "Stale file handle"))

    with pytest.raises(BadSample) as raised:
        retrying(attempt, forget=lambda _: None, given_up=given_up, sleep=sleeps.append)
    assert raised.value.kind == "transient" and calls == TRIES and len(sleeps) == TRIES - 1
    assert "b.bin" in str(raised.value) and "usually transient" in str(raised.value)
    with pytest.raises(BadSample, match="usually transient"):
        retrying(attempt, forget=lambda _: None, given_up=given_up, sleep=sleeps.append)
    assert calls == TRIES + 1 and len(sleeps) == TRIES - 1, "no second round in the batch"


def test_sample_files_retry_transient_errnos_only_and_start_over_each_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ok.bin").write_bytes(b"payload")
    (tmp_path / "eio.bin").write_bytes(b"eio")
    (tmp_path / "perm.bin").write_bytes(b"perm")
    monkeypatch.setenv(FAULTS_ENV, f"EIO:{TRIES - 1}:ok.bin,EIO:-1:eio.bin,EACCES:1:perm.bin")
    files = SampleFiles(str(tmp_path))
    try:
        assert bytes(files.read("ok.bin")) == b"payload"  # recovered on the last try
        with pytest.raises(BadSample) as raised:
            files.read("eio.bin")
        assert raised.value.kind == "transient"
        with pytest.raises(BadSample) as raised:
            files.read("perm.bin")
        assert raised.value.kind == "unreadable", "a permission error is the sample's own"
        assert bytes(files.read("perm.bin")) == b"perm"
        files.begin_batch()
        with pytest.raises(BadSample, match="on each of"):
            files.read("eio.bin")
    finally:
        files.close()
