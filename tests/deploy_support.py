"""Helpers of the deployment tests: the repository's paths, the validators' commands, and
sizes as Kubernetes, compose and batchd write them."""

from __future__ import annotations

import re
import shutil
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("sidecar", "pool", "pool-object-store")
SERVER_UID = 10001

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 2**10,  # compose (docker's units) counts kb, mb, gb in powers of 2
    "mb": 2**20,
    "gb": 2**30,
}


def size_bytes(text: object, *, compose: bool = False) -> int:
    """``"2Gi"``, ``"1536Mi"``, ``"1792MiB"``, ``"1g"`` (compose: 2**30), in bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    assert match, f"not a size: {text!r}"
    unit = match.group(2).lower()
    if compose and unit in ("k", "m", "g"):
        unit += "b"
    assert unit in _UNITS, f"unknown unit in {text!r}"
    return int(float(match.group(1)) * _UNITS[unit])


def tool(name: str) -> str:
    """A command installed by requirements/test.txt (beside this Python, or on PATH)."""
    beside = Path(sysconfig.get_path("scripts")) / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -r requirements/test.txt"
    return found
