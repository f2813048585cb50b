"""The images: deploy/Dockerfile (the server) and examples/Dockerfile (a trainer, the client
only) start from a base pinned by tag and digest, install torch's CPU build at batchd's pin
and everything else at deploy/constraints.txt's versions, run as uid 10001, keep their
writable paths in volumes, and (the server) check health with ``batchd-server
healthcheck`` behind the ``batchd-server`` entrypoint. No Docker here: the files are read."""

from __future__ import annotations

import importlib.metadata
import json
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deploy_support import REPO, SERVER_UID

SERVER_IMAGE = REPO / "deploy" / "Dockerfile"
TRAINER_IMAGE = REPO / "examples" / "Dockerfile"
CONSTRAINTS = REPO / "deploy" / "constraints.txt"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def instructions(path: object) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments out."""
    text = re.sub(r"\\\n", " ", REPO.joinpath(str(path)).read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def args_of(path: object) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in instructions(path) if word == "ARG")


def bases(path: object) -> list[str]:
    """Every FROM's image, ``${ARG}`` resolved (build stages named AS are not images)."""
    values = args_of(path)
    out = []
    for word, rest in instructions(path):
        if word == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], rest.split()[0])
            out.append(image)
    return out


def runs(path: object) -> str:
    return "\n".join(rest for word, rest in instructions(path) if word == "RUN")


def last(path: object, word: str) -> str:
    return [rest for w, rest in instructions(path) if w == word][-1]


def torch_pin() -> str:
    client = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())
    (pin,) = client["project"]["optional-dependencies"]["torch"]
    return str(Requirement(pin).specifier).removeprefix("==")


def test_both_images_start_from_one_base_pinned_by_tag_and_digest() -> None:
    """Every FROM is python:<patch version>-slim-<release>@sha256:<64 hex>, the same one in
    both images."""
    images = bases(SERVER_IMAGE) + bases(TRAINER_IMAGE)
    assert len(images) == 3
    assert len(set(images)) == 1
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+@sha256:[0-9a-f]{64}", images[0]), images[0]


def test_torch_is_the_cpu_build_at_batchds_pin_and_the_rest_comes_from_the_constraints() -> None:
    """torch==<the client's pin>+cpu from PyTorch's CPU index without dependencies, then
    pip with ``-c`` deploy/constraints.txt; the server image runs ``pip check``."""
    for image in (SERVER_IMAGE, TRAINER_IMAGE):
        text = runs(image)
        assert f"--no-deps --index-url {TORCH_CPU_INDEX}" in text, image
        assert f"torch=={torch_pin()}+cpu" in text, image
        installs = [c for c in text.split("&&") if "pip install" in c and "-c " in c]
        assert installs and all("-c /tmp/constraints.txt" in c for c in installs), image
        copied = [rest for word, rest in instructions(image) if word == "COPY"]
        assert "deploy/constraints.txt /tmp/constraints.txt" in copied, image
    assert "pip check" in runs(SERVER_IMAGE)


def test_the_trainer_image_installs_the_client_only() -> None:
    """examples/Dockerfile installs ``client[torch]`` and never the server."""
    copied = " ".join(rest for word, rest in instructions(TRAINER_IMAGE) if word == "COPY")
    assert "server" not in copied.split() and "/src/server" not in runs(TRAINER_IMAGE)
    assert '"/src/client[torch]"' in runs(TRAINER_IMAGE)


def test_both_images_run_as_uid_10001_with_an_entrypoint_and_the_server_checks_health() -> None:
    """USER 10001:10001 in both (the shm transport needs one user on both sides); the
    server's entrypoint is batchd-server, its HEALTHCHECK runs batchd-server healthcheck,
    and its writable paths (socket, /tmp, BATCHD_HOME) are declared volumes."""
    for image in (SERVER_IMAGE, TRAINER_IMAGE):
        assert last(image, "USER") == f"{SERVER_UID}:{SERVER_UID}", image
    assert json.loads(last(SERVER_IMAGE, "ENTRYPOINT")) == ["batchd-server"]
    assert json.loads(last(TRAINER_IMAGE, "ENTRYPOINT")) == ["python", "/app/train_demo.py"]
    check = last(SERVER_IMAGE, "HEALTHCHECK")
    assert json.loads(check.partition(" CMD ")[2]) == ["batchd-server", "healthcheck"]
    assert set(json.loads(last(SERVER_IMAGE, "VOLUME"))) == {
        "/var/lib/batchd",
        "/run/batchd",
        "/tmp",
    }
    assert "BATCHD_HOME=/var/lib/batchd" in last(SERVER_IMAGE, "ENV")


def test_the_constraints_pin_exactly_the_servers_dependency_closure() -> None:
    """Every distribution batchd-server needs (its requirements and theirs, batchd[torch]
    included, as installed here) is pinned with ==, and nothing else is listed."""
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pinned[canonicalize_name(requirement.name)] = spec.version
    closure: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [("batchd-server", ())]
    while todo:
        name, extras = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            environments = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in environments):
                todo.append((canonicalize_name(req.name), tuple(req.extras)))
    assert set(pinned) == closure - {"batchd", "batchd-server"}
    assert pinned["torch"] == f"{torch_pin()}+cpu"
