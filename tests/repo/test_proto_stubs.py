"""The committed gRPC stubs are exactly what ``scripts/gen_proto.py`` makes of the .proto."""

from __future__ import annotations

import importlib.metadata
import pickle
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "client" / "src" / "batchd" / "_proto"
GRPC_STUB = COMMITTED / "batchd" / "v1" / "loader_pb2_grpc.py"
PB2 = COMMITTED / "batchd" / "v1" / "loader_pb2.py"
REGENERATE = "run `python scripts/gen_proto.py` and commit the result"


def _generated_with() -> str:
    """The grpcio-tools version the committed stubs say they were generated with."""
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", GRPC_STUB.read_text(), re.M)
    assert match, f"{GRPC_STUB} has no GRPC_GENERATED_VERSION; {REGENERATE}"
    return match.group(1)


def _protobuf_gencode_version() -> str:
    match = re.search(r"^# Protobuf Python Version: (\S+)$", PB2.read_text(), re.M)
    assert match, f"{PB2} has no 'Protobuf Python Version' header; {REGENERATE}"
    return match.group(1)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    """Regenerating into a temp dir reproduces the committed stubs byte for byte."""
    wanted = _generated_with()
    try:
        installed = importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            "grpcio-tools is not installed, so the stubs cannot be checked against "
            f"proto/; install the test requirements (pip install grpcio-tools=={wanted})",
            pytrace=False,
        )
    out = tmp_path / "_proto"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"scripts/gen_proto.py failed:\n{result.stderr}"

    fresh, committed = _files(out), _files(COMMITTED)
    problems = [f"missing from the tree: {p}" for p in sorted(fresh.keys() - committed.keys())]
    problems += [f"not generated any more: {p}" for p in sorted(committed.keys() - fresh.keys())]
    problems += [
        f"differs: {p}" for p in sorted(fresh.keys() & committed.keys()) if fresh[p] != committed[p]
    ]
    if problems and installed != wanted:
        problems.append(
            f"(the committed stubs come from grpcio-tools {wanted}, this environment has "
            f"{installed}: install grpcio-tools=={wanted}, or regenerate and raise the client's "
            "grpcio/protobuf lower bounds)"
        )
    assert not problems, (
        f"the stubs in {COMMITTED.relative_to(REPO)} are stale; {REGENERATE}:\n  "
        + "\n  ".join(problems)
    )


def test_client_requires_the_runtimes_its_stubs_check_for() -> None:
    """client/pyproject.toml's grpcio and protobuf lower bounds are the versions the
    generated code refuses to import below."""
    meta = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())
    deps = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0]: d for d in meta["project"]["dependencies"]}
    assert deps["grpcio"] == f"grpcio>={_generated_with()}"
    assert deps["protobuf"] == f"protobuf>={_protobuf_gencode_version()}"


def test_generated_messages_live_in_the_batchd_proto_package() -> None:
    """The stubs import as batchd._proto.batchd.v1 and their messages pickle under that name."""
    from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc

    assert loader_pb2.Dataset.__module__ == "batchd._proto.batchd.v1.loader_pb2"
    assert loader_pb2_grpc.batchd_dot_v1_dot_loader__pb2 is loader_pb2
    msg = loader_pb2.Dataset(name="cats", classes=["cat"], splits=[loader_pb2.Split(name="t")])
    assert pickle.loads(pickle.dumps(msg)) == msg
