"""The client distribution installs on its own, without any of the server's dependencies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVER_ONLY = {"sqlalchemy", "psycopg2", "psycopg2-binary", "prometheus-client", "torch"}

# Run inside the fresh venv: what is installed, and what `import batchd` pulls in.
PROBE = """
import importlib.metadata as md, json, sys
import batchd
from batchd._proto.batchd.v1 import loader_pb2_grpc
batchd.Catalog, batchd.DatasetInfo, batchd.SplitInfo
stub_dir = batchd.__file__.rsplit("/", 1)[0] + "/_proto/batchd/v1"
print(json.dumps({
    "installed": sorted(d.metadata["Name"].lower().replace("_", "-") for d in md.distributions()),
    "modules": sorted(m.split(".")[0] for m in sys.modules),
    "batchd_file": batchd.__file__,
    "pyi": __import__("os").path.exists(stub_dir + "/loader_pb2.pyi"),
}))
"""


def _run(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, (
        f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
        f"{result.stderr[-4000:]}"
    )
    return result


@pytest.mark.slow(seconds=15)
@pytest.mark.timeout(1200)
def test_client_installs_without_server_dependencies_and_imports(tmp_path: Path) -> None:
    """pip install client/ into a fresh venv brings no SQLAlchemy, psycopg2, Prometheus client
    or torch, and `import batchd` works there (stubs and their .pyi included)."""
    # Build from a copy: pip builds in the source tree, and a build/ left in the repo
    # would race other runs and can smuggle stale modules into later wheels.
    source = tmp_path / "client"
    shutil.copytree(
        REPO / "client",
        source,
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"),
    )
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout_s=300)
    python = str(venv / "bin" / "python")
    _run(
        [python, "-m", "pip", "install", "--no-input", str(source)],
        cwd=tmp_path,
        timeout_s=900,
    )

    # cwd is tmp_path, so `import batchd` cannot find the source tree by accident.
    report = json.loads(_run([python, "-c", PROBE], cwd=tmp_path, timeout_s=120).stdout)
    assert report["batchd_file"].startswith(str(venv)), report["batchd_file"]
    assert "batchd" in report["installed"]
    assert not SERVER_ONLY & set(report["installed"]), report["installed"]
    assert not {"sqlalchemy", "psycopg2", "prometheus_client", "torch"} & set(report["modules"])
    assert report["pyi"], "loader_pb2.pyi is missing from the installed client"
