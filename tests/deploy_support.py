"""Helpers of the deployment tests: the repository's paths, the validators' commands, and
sizes as Kubernetes, compose and batchd write them."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("sidecar", "pool", "pool-object-store", "pool-keda")
CUSTOM_KINDS = {"keda.sh/v1alpha1": {"ScaledObject"}}
"""Kinds of custom resources the manifests use (apiVersion -> kinds), which the Kubernetes
schemas do not have: each is validated against its own published schema
(tests/repo/test_deploy_keda.py)."""
SERVER_UID = 10001

Doc = dict[str, Any]

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


@functools.cache
def rendered(overlay: str) -> str:
    """``kubectl kustomize deploy/k8s/overlays/<overlay>``'s output."""
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def docs(overlay: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(rendered(overlay)) if d]


def find(overlay: str, kind: str, name: str) -> Doc:
    found = [d for d in docs(overlay) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay} renders {len(found)} {kind}/{name}"
    return found[0]


def containers(pod: Doc) -> list[Doc]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def named(items: list[Doc], name: str) -> Doc:
    return next(i for i in items if i["name"] == name)


def mounts(container: Doc) -> dict[str, str]:
    """Volume name -> mount path."""
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def env(container: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def pods(overlay: str) -> list[tuple[str, Doc]]:
    """(workload name, pod template metadata + spec) of every workload of ``overlay``."""
    return [
        (d["metadata"]["name"], d["spec"]["template"])
        for d in docs(overlay)
        if d["kind"] in ("Deployment", "Job")
    ]


def assert_hardened(workload: str, pod: Doc) -> None:
    """Pod: non-root uid 10001, seccomp RuntimeDefault, no service-account token. Every
    container: no privilege escalation, read-only root, all capabilities dropped, /tmp a
    volume, an image with an explicit version tag (never :latest or none)."""
    spec = pod["spec"]
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == SERVER_UID
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for c in containers(spec):
        where = f"{workload}/{c['name']}"
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert mounts(c).get("tmp") == "/tmp", where
        name, _, tag = c["image"].split("@")[0].rpartition(":")
        assert name and tag not in ("", "latest") and "/" not in tag, (
            f"{where}: image {c['image']!r} has no version tag"
        )
