"""What this process may use of its machine: CPUs and memory as its cgroup limits them.

A container's limits are not its host's: a pod with ``limits: {cpu: 2, memory: 4Gi}`` on a
64-core node sees 64 CPUs in its affinity mask and the node's memory in ``/proc/meminfo``,
but the kernel throttles it to two CPUs' worth of time a period and kills it past 4 GiB.
Sizing the decode workers (``sizing.py``) from the host would start 64 workers that share two
CPUs and grow them until the OOM killer stops them. So the limits are read from the cgroup
the process is in, and the lowest limit on its path from the hierarchy's root wins:

- **cgroup v2** (one hierarchy): ``cpu.max`` (``QUOTA PERIOD`` or ``max PERIOD``),
  ``memory.max`` (bytes or ``max``) less what ``memory.current`` holds that is not
  reclaimable page cache (``inactive_file`` in ``memory.stat``);
- **cgroup v1** (a hierarchy per controller): ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
  (-1: none), ``memory.limit_in_bytes`` less ``memory.usage_in_bytes`` and
  ``total_inactive_file``.

The process's cgroup is named in ``/proc/self/cgroup``. In a container with its own cgroup
namespace the path there is ``/`` and the mount's root is the container's cgroup; without
one, the host's path may not exist inside the container's mount, which is then the
container's cgroup too. A file that is missing or unreadable is no limit: the host's
figures stand (a machine without cgroups, or a platform without ``/proc``).

:class:`Cgroups` takes the filesystem's root and the membership file as parameters, so the
tests read a fake tree as well as the real one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "HOST",
    "Cgroups",
    "affinity_cpus",
    "available_memory",
    "meminfo_available",
    "usable_cpus",
]

_UNLIMITED: Final = 1 << 60
"""A v1 memory limit at or above this is none (the kernel writes 2^63 rounded to a page)."""
_V1_CPU: Final = ("cpu", "cpu,cpuacct", "cpuacct,cpu")
"""Where a v1 cpu controller may be mounted under the root."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _stat_value(path: Path, name: str, missing: int = 0) -> int:
    """Field ``name`` of a ``memory.stat`` or ``cpu.stat`` file; ``missing`` when it is not
    there (or not a number)."""
    text = _read(path) or ""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            try:
                return int(value)
            except ValueError:
                return missing
    return missing


@dataclass(frozen=True)
class Cgroups:
    """The cgroup filesystem at ``root`` as the process named by ``membership`` sees it."""

    root: Path = Path("/sys/fs/cgroup")
    membership: Path = Path("/proc/self/cgroup")

    def _paths(self) -> dict[str, str]:
        """Controller (``""`` for v2) -> the cgroup's path in its hierarchy."""
        found: dict[str, str] = {}
        for line in (_read(self.membership) or "").splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            _, controllers, path = parts
            for controller in controllers.split(",") if controllers else [""]:
                found.setdefault(controller, path)
        return found

    def _chain(self, mount: Path, path: str) -> list[Path]:
        """The cgroup's directory under ``mount`` and its ancestors up to ``mount``; just
        ``mount`` when the path is not under it (a container without a cgroup namespace)."""
        here = mount / path.lstrip("/")
        if not here.is_dir():
            return [mount] if mount.is_dir() else []
        chain = [here]
        while here != mount and mount in here.parents:
            here = here.parent
            chain.append(here)
        return chain

    def _v2(self) -> list[Path]:
        path = self._paths().get("")
        if path is None or not (self.root / "cgroup.controllers").is_file():
            return []
        return self._chain(self.root, path)

    def _v1(self, controller: str, mounts: tuple[str, ...]) -> list[Path]:
        path = self._paths().get(controller)
        if path is None:
            return []
        for name in mounts:
            mount = self.root / name
            if mount.is_dir():
                return self._chain(mount, path)
        return []

    def cpu_quota(self) -> float | None:
        """CPUs' worth of time a period the cgroup may use (1.5 for ``150000 100000``);
        None when no level of it has a quota."""
        quotas = []
        for d in self._v2():
            fields = (_read(d / "cpu.max") or "").split()
            if len(fields) == 2 and fields[0] != "max":
                quotas.append(_ratio(fields[0], fields[1]))
        for d in self._v1("cpu", _V1_CPU):
            quota = _read(d / "cpu.cfs_quota_us")
            period = _read(d / "cpu.cfs_period_us")
            if quota is not None and period is not None:
                quotas.append(_ratio(quota, period))
        known = [q for q in quotas if q is not None]
        return min(known) if known else None

    def cpu_used_s(self) -> float | None:
        """CPU seconds the process's own cgroup has used since it was made (v2
        ``cpu.stat``'s ``usage_usec``, v1 ``cpuacct.usage``); None when neither is readable.
        Its rate against :meth:`cpu_quota` is what is left of the quota to use."""
        for d in self._v2()[:1]:
            used = _stat_value(d / "cpu.stat", "usage_usec", missing=-1)
            if used >= 0:
                return used / 1e6
        for d in self._v1("cpuacct", ("cpuacct", *_V1_CPU))[:1]:
            text = _read(d / "cpuacct.usage")
            if text is not None and text.isdigit():
                return int(text) / 1e9
        return None

    def memory_available(self) -> int | None:
        """Bytes the cgroup may still take before its lowest limit (what it holds in
        reclaimable page cache counted as free); None when no level of it has a limit."""
        room = []
        for d in self._v2():
            limit = _read(d / "memory.max")
            used = _read(d / "memory.current")
            if limit is None or limit == "max" or used is None:
                continue
            cache = _stat_value(d / "memory.stat", "inactive_file")
            room.append(_room(limit, used, cache))
        for d in self._v1("memory", ("memory",)):
            limit = _read(d / "memory.limit_in_bytes")
            used = _read(d / "memory.usage_in_bytes")
            if limit is None or used is None:
                continue
            cache = _stat_value(d / "memory.stat", "total_inactive_file")
            room.append(_room(limit, used, cache))
        known = [r for r in room if r is not None]
        return min(known) if known else None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _room(limit: str, used: str, cache: int) -> int | None:
    try:
        cap, held = int(limit), int(used)
    except ValueError:
        return None
    if cap >= _UNLIMITED:
        return None
    return max(0, cap - max(0, held - cache))


HOST: Final = Cgroups()
"""This machine's cgroup filesystem, as this process sees it."""


def affinity_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's cpuset counts)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def usable_cpus(cgroups: Cgroups = HOST) -> int:
    """The CPUs this process may keep busy: its affinity mask, or fewer when its cgroup's
    quota allows less time (whole CPUs, at least one: a quota of 1.5 keeps one worker
    busy and a second half of the time, which only throttles both)."""
    cpus = affinity_cpus()
    quota = cgroups.cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return cpus


def meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's ``MemAvailable`` in bytes; None where it cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def available_memory(cgroups: Cgroups = HOST, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes this process's cgroup may still take: the host's available memory, or less
    when its cgroup's limit is closer; None when neither can be read."""
    known = [m for m in (meminfo_available(meminfo), cgroups.memory_available()) if m is not None]
    return min(known) if known else None
