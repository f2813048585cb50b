"""Workers are sized by what the process's cgroup allows, not by its host (``workers/host.py``):
a fake cgroup tree for each layout (v2, v1, nested limits, a container without a cgroup
namespace, no cgroups at all), and a real cgroup made here with a CPU quota and a memory
limit, which a child process started in it reads."""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchd_server.workers.host import Cgroups, affinity_cpus, available_memory, usable_cpus
from batchd_server.workers.sizing import Autoscaler, WorkerRange, available_cpus, memory_ceiling

MiB = 1 << 20


def tree(tmp_path: Path, membership: str, files: dict[str, str], *, v2: bool = True) -> Cgroups:
    """A cgroup filesystem under ``tmp_path / "fs"`` holding ``files`` (path -> text), and a
    membership file saying ``membership``."""
    root = tmp_path / "fs"
    root.mkdir()
    if v2:
        (root / "cgroup.controllers").write_text("cpu memory\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "cgroup").write_text(membership)
    return Cgroups(root=root, membership=tmp_path / "cgroup")


def test_v2_cpu_max_and_memory_max_are_read_and_the_lowest_ancestor_wins(tmp_path: Path) -> None:
    cgroups = tree(
        tmp_path,
        "0::/job/step\n",
        {
            "job/cpu.max": "150000 100000\n",
            "job/step/cpu.max": "max 100000\n",
            "job/memory.max": f"{1024 * MiB}\n",
            "job/memory.current": f"{512 * MiB}\n",
            "job/memory.stat": f"anon 1\ninactive_file {128 * MiB}\n",
            "job/step/memory.max": "max\n",
            "job/step/memory.current": f"{512 * MiB}\n",
        },
    )
    assert cgroups.cpu_quota() == 1.5
    assert usable_cpus(cgroups) == 1 == available_cpus(cgroups), "1.5 CPUs keep one busy"
    assert cgroups.memory_available() == 640 * MiB, "the limit less what is not page cache"
    assert available_memory(cgroups) == 640 * MiB  # the host has more than that


def test_a_v2_container_without_its_own_cgroup_namespace_reads_its_mounts_root(
    tmp_path: Path,
) -> None:
    """/proc/self/cgroup names the host's path, which the container's mount does not have:
    the mount's root is the container's cgroup."""
    cgroups = tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {"cpu.max": "200000 100000\n", "memory.max": f"{256 * MiB}\n", "memory.current": "0\n"},
    )
    assert cgroups.cpu_quota() == 2.0
    assert cgroups.memory_available() == 256 * MiB
    # A worker of 64 MiB: the 256 MiB the cgroup has left hold two more, twice over; the host
    # (gigabytes available) would have said dozens.
    assert memory_ceiling(2, 64 * MiB, cgroups) == 4


def test_v1_cfs_quota_and_memory_limit_are_read(tmp_path: Path) -> None:
    cgroups = tree(
        tmp_path,
        "4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n",
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "cpu,cpuacct/job/cpu.cfs_quota_us": "250000\n",
            "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": f"{4096 * MiB}\n",
            "memory/job/memory.limit_in_bytes": f"{512 * MiB}\n",
            "memory/job/memory.usage_in_bytes": f"{100 * MiB}\n",
            "memory/job/memory.stat": f"cache 1\ntotal_inactive_file {36 * MiB}\n",
        },
        v2=False,
    )
    assert cgroups.cpu_quota() == 2.5
    assert cgroups.memory_available() == 448 * MiB


@pytest.mark.parametrize(
    "files",
    [
        {},
        {"cpu.max": "max 100000\n", "memory.max": "max\n", "memory.current": "5\n"},
        {"cpu.max": "garbage\n", "memory.max": "lots\n", "memory.current": "5\n"},
    ],
)
def test_no_limit_or_an_unreadable_one_leaves_the_hosts_figures(
    tmp_path: Path, files: dict[str, str]
) -> None:
    cgroups = tree(tmp_path, "0::/\n", files)
    assert cgroups.cpu_quota() is None and cgroups.memory_available() is None
    assert usable_cpus(cgroups) == affinity_cpus()
    nothing = Cgroups(root=tmp_path / "none", membership=tmp_path / "no-such-file")
    assert nothing.cpu_quota() is None and nothing.memory_available() is None


# -- a real cgroup ---------------------------------------------------------------------------

_PROBE = """
import json
from batchd_server.workers.host import HOST, affinity_cpus
from batchd_server.workers.sizing import Autoscaler, WorkerRange, available_cpus, memory_ceiling
print(json.dumps({
    "affinity": affinity_cpus(),
    "cpus": available_cpus(),
    "quota": HOST.cpu_quota(),
    "memory": HOST.memory_available(),
    "ceiling": memory_ceiling(1, 16 << 20),
}))
"""


def _writable(directory: Path) -> bool:
    probe = directory / f"bd-probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    probe.rmdir()
    return True


@pytest.fixture
def real_cgroup() -> Iterator[list[Path]]:
    """A fresh cgroup with a quota of one CPU and a 256 MiB memory limit, in whichever
    hierarchy this machine lets root write: v2 with the cpu and memory controllers, else
    v1's cpu and memory hierarchies. Its directories, removed afterwards."""
    root = Path("/sys/fs/cgroup")
    name = f"batchd-test-{secrets.token_hex(4)}"
    made: list[Path] = []
    controllers = (
        (root / "cgroup.controllers").read_text().split()
        if (root / "cgroup.controllers").is_file()
        else []
    )
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    try:
        if {"cpu", "memory"} <= set(controllers) and _writable(root):
            group = root / name
            group.mkdir()
            made.append(group)
            (group / "cpu.max").write_text("100000 100000")
            (group / "memory.max").write_text(str(256 * MiB))
        elif _writable(root / "cpu") and _writable(root / "memory"):
            for hierarchy in ("cpu", "memory"):
                group = root / hierarchy / name
                group.mkdir()
                made.append(group)
            (made[0] / "cpu.cfs_period_us").write_text("100000")
            (made[0] / "cpu.cfs_quota_us").write_text("100000")
            (made[1] / "memory.limit_in_bytes").write_text(str(256 * MiB))
        else:
            pytest.skip(
                f"no writable cgroup hierarchy with cpu and memory under {root} (v2 "
                f"controllers: {controllers or 'none'}; v1 cpu/memory not writable)"
            )
        yield made
    finally:
        for group in reversed(made):
            group.rmdir()


def test_a_process_in_a_real_cgroup_with_a_quota_of_one_cpu_sizes_by_it(
    real_cgroup: list[Path],
) -> None:
    """The child joins the cgroup before it runs Python; its affinity mask still shows
    every CPU (two or more on the machines the suite runs on), the quota says one, and so
    does ``available_cpus`` (the ``--workers`` default and the autoscaler's ceiling). Its
    memory is the cgroup's 256 MiB less what it holds."""

    def join() -> None:
        for group in real_cgroup:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        preexec_fn=join,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = json.loads(done.stdout)
    assert found["quota"] == 1.0 and found["cpus"] == 1, found
    assert 0 < found["memory"] <= 256 * MiB, found
    assert found["ceiling"] <= 1 + 256 * MiB // (32 * MiB), found


class _IdlePool:
    def load(self) -> tuple[int, int]:
        return 0, 0


def test_idle_cores_under_a_quota_are_what_the_cgroup_left_of_it(tmp_path: Path) -> None:
    """A container at its quota has no idle core to grow into, however idle the node's CPUs
    are: the autoscaler's idle cores are the quota less the cgroup's own use (v2
    ``cpu.stat``), and without a quota the host's figure stands."""
    cgroups = tree(
        tmp_path,
        "0::/pod\n",
        {"pod/cpu.max": "200000 100000\n", "pod/cpu.stat": "usage_usec 5000000\nuser_usec 1\n"},
    )
    assert cgroups.cpu_used_s() == 5.0
    scaler = Autoscaler(
        _IdlePool(), WorkerRange(1, 4), cpus=4, stall_ratio=lambda: None, cgroups=cgroups
    )
    assert scaler._quota_left(100.0) == math.inf, "one reading is no rate yet"
    (tmp_path / "fs/pod/cpu.stat").write_text("usage_usec 6800000\n")  # 1.8 s in 1 s
    assert scaler._quota_left(101.0) == pytest.approx(0.2)
    (tmp_path / "fs/pod/cpu.stat").write_text("usage_usec 9000000\n")  # over the quota
    assert scaler._quota_left(102.0) == 0.0
    none = tmp_path / "none"
    none.mkdir()
    unlimited = Autoscaler(
        _IdlePool(), WorkerRange(1, 4), cpus=4, stall_ratio=lambda: None,
        cgroups=tree(none, "0::/\n", {}),
    )  # fmt: skip
    assert unlimited._quota_left(1.0) == unlimited._quota_left(2.0) == math.inf


def test_a_v1_cgroups_cpu_use_is_read_from_cpuacct(tmp_path: Path) -> None:
    cgroups = tree(
        tmp_path,
        "4:cpu,cpuacct:/job\n",
        {"cpu,cpuacct/job/cpuacct.usage": "2500000000\n"},
        v2=False,
    )
    assert cgroups.cpu_used_s() == 2.5
