"""Shared-memory segments: creation, budget, attach, sweeping dead servers, array packs.

Everything here uses real files in /dev/shm (a tmpfs) and real child processes. Other test
runs may share this /dev/shm at the same time, so the tests only ever look at entries of the
instances they made, and tests that count what a sweep removed use a directory of their own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchd_server.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from batchd_server.shm import (
    SHM_DIR,
    ShmRegistry,
    attach,
    attach_arrays,
    format_bytes,
    pack_arrays,
)
from batchd_server.shm.arrays import ALIGN_BYTES

import shmns

KiB = 1 << 10
MiB = 1 << 20
NAME_RE = re.compile(r"batchd-[0-9a-f]{12}-(ring|catalog)-[0-9a-f]{32}")


def entries_of(instances: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Entries (segments and lock files) of these instances in ``shm_dir``."""
    return sorted(
        name for name in os.listdir(shm_dir) for i in instances if name.startswith(f"batchd-{i}")
    )


def mappings_of(name: str) -> list[str]:
    """Permissions (``rw-s``, ``r--s``) of this process's mappings of segment ``name``."""
    with open("/proc/self/maps") as maps:
        return [line.split()[1] for line in maps if name in line]


@pytest.fixture
def own_instances() -> Iterator[set[str]]:
    """Instances a test makes; when it ends none may have an entry left in /dev/shm."""
    instances: set[str] = set()
    yield instances
    assert entries_of(instances) == []


@pytest.fixture
def registry(own_instances: set[str]) -> Iterator[ShmRegistry]:
    """A registry in the real /dev/shm with a 1 MiB budget, closed after the test."""
    with ShmRegistry(budget_bytes=MiB) as reg:
        own_instances.add(reg.instance)
        yield reg


@pytest.fixture
def private_shm_dir() -> Iterator[Path]:
    """A directory of its own on the /dev/shm tmpfs, which no other run's sweep looks into."""
    path = Path(tempfile.mkdtemp(prefix="shm-test-", dir=SHM_DIR))
    try:
        yield path
        assert os.listdir(path) == []
    finally:
        shutil.rmtree(path, ignore_errors=True)


CHILD_SERVER = """
import json, pathlib, sys
from batchd_server.shm import ShmRegistry
with ShmRegistry(budget_bytes=1 << 30, shm_dir=pathlib.Path(sys.argv[1])) as registry:
    sizes = (("ring", 1 << 20), ("catalog", 4096))
    names = [registry.create(kind, n, purpose="a child's").name for kind, n in sizes]
    print(json.dumps({"instance": registry.instance, "names": names}), flush=True)
    sys.stdin.readline()
print("closed", flush=True)
"""


@contextlib.contextmanager
def child_server(shm_dir: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """A Python process holding a registry with two segments until told to close (a line)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_SERVER, str(shm_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line, f"the child server exited with {proc.wait()} before it was ready"
        yield proc, json.loads(line)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdin.close()
        proc.stdout.close()


def test_a_created_segment_is_private_reserved_zeroed_and_accounted(
    registry: ShmRegistry,
) -> None:
    """create() makes a 0600 file of the exact size, allocated and zeroed, counted in the budget."""
    segment = registry.create("ring", 300 * KiB, purpose="a test ring")
    st_ = os.stat(segment.path)
    assert NAME_RE.fullmatch(segment.name) and segment.name.startswith(
        f"batchd-{registry.instance}"
    )
    assert segment.path == SHM_DIR / segment.name and segment.kind == "ring"
    assert st_.st_mode & 0o777 == 0o600
    assert st_.st_size == segment.nbytes == len(segment.buf) == 300 * KiB
    assert st_.st_blocks * 512 >= 300 * KiB, "posix_fallocate reserved every page up front"
    assert not segment.ndarray(np.uint8, segment.nbytes).any()
    assert registry.reserved_bytes() == 300 * KiB and registry.segments() == [segment]

    registry.release(segment)
    assert not segment.path.exists()
    assert registry.reserved_bytes() == 0 and registry.segments() == []
    registry.release(segment)  # idempotent
    with pytest.raises(FailedPrecondition, match="no longer mapped"):
        segment.buf  # noqa: B018


def test_exceeding_the_budget_names_the_numbers_and_creates_nothing(
    registry: ShmRegistry,
) -> None:
    """A create past the budget raises ResourceExhausted with budget, reserved, needed, remedy."""
    first = registry.create("ring", 512 * KiB, purpose="session A's ring")
    with pytest.raises(ResourceExhausted) as info:
        registry.create("ring", 600 * KiB, purpose="session B's ring")
    message = str(info.value)
    for part in ("1.0 MiB", "1048576 bytes", "512.0 KiB is reserved", "600.0 KiB more"):
        assert part in message
    assert "session B's ring" in message and "--shm-budget" in message
    assert "BATCHD_SHM_BUDGET" in message and "prefetch" in message
    assert entries_of({registry.instance}) == sorted(
        [first.name, f"batchd-{registry.instance}.lock"]
    )
    assert registry.reserved_bytes() == 512 * KiB

    registry.release(first)
    registry.release(registry.create("ring", 600 * KiB, purpose="session B's ring"))


@pytest.mark.parametrize(("kind", "nbytes"), [("slots", 4096), ("ring", 0), ("ring", -1)])
def test_create_rejects_unknown_kinds_and_sizes_below_one_byte(
    registry: ShmRegistry, kind: str, nbytes: int
) -> None:
    """create() validates its arguments before touching /dev/shm."""
    with pytest.raises(InvalidArgument):
        registry.create(kind, nbytes, purpose="test")
    assert registry.segments() == []


def test_releasing_a_segment_with_live_views_keeps_them_valid_until_they_die(
    registry: ShmRegistry,
) -> None:
    """release() with numpy views alive unlinks at once; the mapping goes with the last view."""
    segment = registry.create("ring", 4096, purpose="test")
    view = segment.ndarray(np.int64, 8, offset=64)
    view[:] = np.arange(8)
    registry.release(segment)
    assert not segment.path.exists() and registry.reserved_bytes() == 0
    assert view.tolist() == list(range(8))
    assert mappings_of(segment.name) == ["rw-s"]
    del view
    assert mappings_of(segment.name) == []


def test_close_releases_everything_removes_the_lock_and_is_idempotent(
    own_instances: set[str],
) -> None:
    """close() unlinks every segment and the lock file; later creates fail clearly."""
    registry = ShmRegistry(budget_bytes=MiB)
    own_instances.add(registry.instance)
    segments = [registry.create("ring", 4096, purpose="test") for _ in range(2)]
    assert (SHM_DIR / f"batchd-{registry.instance}.lock").exists()
    registry.close()
    registry.close()
    assert entries_of({registry.instance}) == []
    assert all(s.path.exists() is False for s in segments)
    with pytest.raises(FailedPrecondition, match="closed"):
        registry.create("ring", 4096, purpose="test")


def test_a_forked_child_closing_the_registry_leaves_the_parents_files_and_lock(
    registry: ShmRegistry, own_instances: set[str]
) -> None:
    """close() in a forked child unmaps only: the parent's segment and instance lock survive."""
    segment = registry.create("ring", 4096, purpose="test")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            registry.close()
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert segment.path.exists() and (SHM_DIR / f"batchd-{registry.instance}.lock").exists()
    with ShmRegistry(budget_bytes=MiB) as other:
        own_instances.add(other.instance)
        assert segment.name not in other.sweep()
    assert segment.path.exists()


def test_sweep_removes_a_killed_servers_segments_and_logs_one_line(
    private_shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGKILLed server's segments and lock file go at the next sweep, with one log line."""
    with ShmRegistry(budget_bytes=MiB, shm_dir=private_shm_dir) as registry:
        with child_server(private_shm_dir) as (child, info):
            child.kill()
            child.wait(timeout=60)
        dead = info["instance"]
        assert entries_of({dead}, private_shm_dir) == sorted(
            [*info["names"], f"batchd-{dead}.lock"]
        )
        with caplog.at_level(logging.INFO, logger="batchd_server.shm"):
            removed = registry.sweep()
        assert sorted(removed) == sorted(info["names"])
        assert entries_of({dead}, private_shm_dir) == []
        assert [r.getMessage() for r in caplog.records] == [
            f"removed 2 shared-memory segment(s), 1.0 MiB, left in {private_shm_dir} by dead "
            f"batchd instance {dead}"
        ]
        assert registry.sweep() == []


def test_a_new_registry_in_dev_shm_sweeps_what_a_killed_server_left(
    own_instances: set[str],
) -> None:
    """Starting a registry on the real /dev/shm removes a SIGKILLed server's leftovers."""
    with child_server(SHM_DIR) as (child, info):
        own_instances.add(info["instance"])
        child.kill()
        child.wait(timeout=60)
    with ShmRegistry(budget_bytes=MiB) as registry:
        own_instances.add(registry.instance)
        assert entries_of({info["instance"]}) == []


def test_sweep_never_touches_a_live_server_in_another_process(
    registry: ShmRegistry, own_instances: set[str]
) -> None:
    """A live server's segments survive sweeps; they go when that server closes."""
    with child_server(SHM_DIR) as (child, info):
        own_instances.add(info["instance"])
        assert child.stdin is not None and child.stdout is not None
        assert not set(info["names"]) & set(registry.sweep())
        with ShmRegistry(budget_bytes=MiB) as newcomer:  # sweeps as it starts
            own_instances.add(newcomer.instance)
        assert all((SHM_DIR / name).exists() for name in info["names"])
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.stdout.readline() == "closed\n"
        assert child.wait(timeout=60) == 0


def test_sweep_removes_orphans_without_a_lock_and_ignores_foreign_names(
    private_shm_dir: Path,
) -> None:
    """Segments with no lock file and an unlocked lock file go; other names stay untouched."""
    orphan = "batchd-0123456789ab-ring-" + "0" * 32
    stale_lock = "batchd-ba9876543210.lock"
    foreign = ["batchd-notes.txt", "batchd-0123456789ab-ring-short", "other-file"]
    for name in (orphan, stale_lock, *foreign):
        (private_shm_dir / name).write_bytes(b"x" * 10)
    with ShmRegistry(budget_bytes=MiB, shm_dir=private_shm_dir) as registry:
        assert sorted(os.listdir(private_shm_dir)) == sorted(
            [*foreign, f"batchd-{registry.instance}.lock"]
        )
    for name in foreign:
        (private_shm_dir / name).unlink()


def test_a_read_only_attachment_sees_the_data_and_cannot_write(registry: ShmRegistry) -> None:
    """attach(writable=False) maps r--s: writes through the buffer or a numpy view raise."""
    segment = registry.create("ring", 4096, purpose="test")
    segment.buf[:5] = b"hello"
    with attach(segment.name, writable=False) as attached:
        assert attached.nbytes == 4096 and attached.buf[:5] == b"hello"
        assert sorted(mappings_of(segment.name)) == ["r--s", "rw-s"]
        with pytest.raises(TypeError):
            attached.buf[:1] = b"j"
        view = attached.ndarray(np.uint8, 5)
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0] = ord("j")
        with pytest.raises(ValueError):
            view.setflags(write=True)
    assert segment.buf[:5] == b"hello"
    assert view.tobytes() == b"hello", "a view outlives close() and keeps the mapping"
    del view
    assert mappings_of(segment.name) == ["rw-s"]
    registry.release(segment)


def test_a_writable_attachment_writes_into_the_segment(registry: ShmRegistry) -> None:
    """attach(writable=True) shares the pages with the creator's mapping."""
    segment = registry.create("ring", 4096, purpose="test")
    attached = attach(segment.name, writable=True)
    attached.ndarray(np.float32, 4, offset=128)[:] = [1.5, 2.5, 3.5, 4.5]
    attached.close()
    attached.close()
    assert segment.ndarray(np.float32, 4, offset=128).tolist() == [1.5, 2.5, 3.5, 4.5]
    with pytest.raises(FailedPrecondition):
        attached.buf  # noqa: B018
    with pytest.raises(InvalidArgument, match="needs bytes"):
        segment.ndarray(np.float32, 1025)


def test_attaching_a_missing_segment_raises_not_found() -> None:
    """A well-formed name with no file behind it is NotFound, naming the path."""
    name = "batchd-0123456789ab-ring-" + "f" * 32
    with pytest.raises(NotFound, match=str(SHM_DIR / name)):
        attach(name, writable=False)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "ring",
        "batchd-",
        "batchd-0123456789ab.lock",
        "../batchd-0123456789ab-ring-" + "0" * 32,
        "batchd-0123456789ab-ring-" + "0" * 32 + "/x",
        "/dev/shm/batchd-0123456789ab-ring-" + "0" * 32,
        "batchd-0123456789ab-ring-" + "0" * 31 + "\x00",
    ],
)
def test_attach_rejects_anything_but_a_batchd_segment_name(name: str) -> None:
    """Names that are not batchd segment names (paths, lock files, NULs) are InvalidArgument."""
    with pytest.raises(InvalidArgument, match="is not a batchd shared-memory segment name"):
        attach(name, writable=False)


def test_packed_arrays_round_trip_read_only_and_aligned(registry: ShmRegistry) -> None:
    """pack_arrays/attach_arrays return equal, read-only, 64-byte aligned arrays of any dtype."""
    arrays: dict[str, np.ndarray] = {
        "ids": np.arange(10, dtype=np.int64),
        "weights": np.linspace(0, 1, 7, dtype=np.float32),
        "path_bytes": np.frombuffer(b"a/b.jpg", np.uint8),
        "flags": np.array([True, False, True]),
        "big_endian": np.arange(5, dtype=">i4"),
        "matrix": np.arange(12, dtype=np.float16).reshape(3, 4)[:, ::2],  # not contiguous
        "scalar": np.array(3.25),
        "empty": np.empty(0, np.int64),
        "empty_2d": np.empty((3, 0), np.float64),
        "names": np.array(["cat", "dog"]),
    }
    segment = pack_arrays(registry, arrays, purpose="catalog of test/train")
    assert segment.kind == "catalog"
    views, attachment = attach_arrays(segment.name)
    assert list(views) == list(arrays)
    for name, array in arrays.items():
        view = views[name]
        assert view.dtype == array.dtype and view.shape == array.shape, name
        assert np.array_equal(view, array), name
        assert not view.flags.writeable and view.flags.c_contiguous, name
        assert view.__array_interface__["data"][0] % ALIGN_BYTES == 0, name
    del views, view
    attachment.close()
    registry.release(segment)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrays=st.dictionaries(
        st.text(max_size=8),
        hnp.arrays(
            dtype=st.one_of(
                hnp.scalar_dtypes(),
                hnp.integer_dtypes(endianness=">"),
                hnp.floating_dtypes(endianness=">"),
                hnp.byte_string_dtypes(),
                hnp.unicode_string_dtypes(),
            ),
            shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        ),
        max_size=5,
    )
)
def test_any_packable_arrays_come_back_byte_for_byte(
    registry: ShmRegistry, arrays: dict[str, np.ndarray]
) -> None:
    """Whatever names, dtypes and shapes go in, the same bytes, dtypes and shapes come out."""
    segment = pack_arrays(registry, arrays, purpose="property test")
    views, attachment = attach_arrays(segment.name)
    try:
        assert list(views) == list(arrays)
        for name, array in arrays.items():
            assert views[name].dtype.str == array.dtype.str and views[name].shape == array.shape
            assert views[name].tobytes() == array.tobytes()
    finally:
        del views
        attachment.close()
        registry.release(segment)


@pytest.mark.parametrize(
    "array",
    [np.array([{}, None], dtype=object), np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])],
    ids=["object", "structured"],
)
def test_pack_arrays_rejects_dtypes_that_cannot_be_shared(
    registry: ShmRegistry, array: np.ndarray
) -> None:
    """Object and structured arrays are InvalidArgument, and nothing is created."""
    with pytest.raises(InvalidArgument, match="cannot live in shared memory"):
        pack_arrays(registry, {"ok": np.arange(3), "bad": array}, purpose="test")
    assert registry.segments() == []


def test_attach_arrays_of_a_segment_that_is_no_pack_is_invalid(registry: ShmRegistry) -> None:
    """A ring segment is not an array pack; attach_arrays says so and keeps nothing mapped."""
    segment = registry.create("ring", 4096, purpose="test")
    with pytest.raises(InvalidArgument, match="not an array pack"):
        attach_arrays(segment.name)
    assert mappings_of(segment.name) == ["rw-s"]
    registry.release(segment)


def test_format_bytes_uses_binary_units_with_one_decimal() -> None:
    """Sizes in messages read as people expect."""
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(64 * KiB) == "64.0 KiB"
    assert format_bytes(402 * MiB) == "402.0 MiB"
    assert format_bytes(3 << 29) == "1.5 GiB"


SMALL_SHM_SCRIPT = """
import json, os
from pathlib import Path
import numpy as np
from batchd_server.errors import ResourceExhausted
from batchd_server.shm import ShmRegistry

MiB = 1 << 20
out = {}


class SpaceTakenMeanwhile(ShmRegistry):
    # Reports the whole tmpfs as free, as if another process filled it between the check
    # and the reservation: posix_fallocate itself must then fail with ENOSPC.
    def free_bytes(self):
        st = os.statvfs(self.shm_dir)
        return st.f_blocks * st.f_frsize


with ShmRegistry(budget_bytes=1 << 30) as registry:
    out["free"] = registry.free_bytes()
    try:
        registry.create("ring", 100 * MiB, purpose="ring of 4 slots of 25.0 MiB")
    except ResourceExhausted as e:
        out["too_big"] = str(e)
    out["after_too_big"] = sorted(os.listdir("/dev/shm"))
    segment = registry.create("ring", 32 * MiB, purpose="a ring that fits")
    view = segment.ndarray(np.uint8, segment.nbytes)
    view[:] = 0xA5
    out["sum"] = int(view.sum(dtype=np.uint64))
    del view
    registry.release(segment)
    with SpaceTakenMeanwhile(budget_bytes=1 << 30) as racy:
        first = racy.create("ring", 40 * MiB, purpose="first")
        try:
            racy.create("ring", 40 * MiB, purpose="second")
        except ResourceExhausted as e:
            out["enospc"] = str(e)
        out["after_enospc"] = sorted(os.listdir("/dev/shm"))
        out["lock_names"] = [f"batchd-{registry.instance}.lock", f"batchd-{racy.instance}.lock"]
        out["first"] = first.name
out["at_exit"] = sorted(os.listdir("/dev/shm"))
print(json.dumps(out))
"""


def test_a_64mb_dev_shm_fails_big_sessions_clearly_and_serves_small_ones() -> None:
    """On a 64 MB tmpfs: 100 MiB fails with the remedy, 32 MiB is written fully, no SIGBUS."""
    reason = shmns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot mount a private 64 MB tmpfs on /dev/shm: {reason}")
    child = shmns.run_with_small_shm(SMALL_SHM_SCRIPT, size="64m")
    assert child.returncode == 0, f"exit {child.returncode} (-7 is SIGBUS): {child.stderr}"
    out = json.loads(child.stdout)
    assert out["free"] == 64 * MiB
    too_big = out["too_big"]
    assert too_big.startswith("/dev/shm has 64.0 MiB free; this session needs 100.0 MiB")
    assert "(ring of 4 slots of 25.0 MiB)" in too_big
    assert "shm_size: 1gb" in too_big and "sizeLimit: 1Gi" in too_big
    assert "mounted at /dev/shm" in too_big and "batch_size / prefetch" in too_big
    assert out["after_too_big"] == [out["lock_names"][0]]
    assert out["sum"] == 0xA5 * 32 * MiB

    enospc = out["enospc"]
    assert enospc.startswith("/dev/shm has 24.0 MiB free; this session needs 40.0 MiB (second)")
    assert "shm_size" in enospc and "sizeLimit" in enospc
    assert out["after_enospc"] == sorted([*out["lock_names"], out["first"]])
    assert out["at_exit"] == []
