"""docker-compose.yml, run without Docker: each batchd service's own command, with its own
environment, as a local process, in the order its depends_on says (Postgres is the tests'
throwaway one, given the postgres service's user, password and database), and the trainer
must train through batchd and exit 0.

Nothing is copied from the compose file: a service's argv is its image's ENTRYPOINT (read
from the Dockerfile that builds the image) followed by its ``command``; its environment is
its Dockerfile's ``ENV``, its ``env_file``s, then its ``environment``. What a container
would see is mapped onto this machine, and only that: named volumes become directories here
(``/dev/shm`` stays this machine's), files a Dockerfile COPYs are read where they are in the
repository, the database host ``postgres`` is the throwaway server, a published port's
``0.0.0.0:P`` is a free port on 127.0.0.1, and the image's commands are this Python's."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from deploy_support import REPO

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
COMMANDS = {
    "batchd-server": [sys.executable, "-m", "batchd_server.cli"],
    "python": [sys.executable],
}
"""What the images' executables are here."""


def dockerfile_of(name: str) -> Path:
    """The Dockerfile that builds ``name``'s image (its own build, or the service's that
    builds the same image)."""
    image = SERVICES[name]["image"]
    builder = next(s for s in SERVICES.values() if s.get("image") == image and "build" in s)
    return REPO / builder["build"]["context"] / builder["build"]["dockerfile"]


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip()[0] != "#"]
    return [(ln.split()[0].upper(), ln.partition(" ")[2].strip()) for ln in lines]


def env_files(name: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for path in SERVICES[name].get("env_file", []):
        for line in (REPO / path).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                key, _, value = line.partition("=")
                values[key.strip()] = value.strip()
    return values


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """Maps what the compose file says a container sees onto this machine."""

    def __init__(self, root: Path, database_url: str) -> None:
        self.root = root
        self.database_url = database_url
        self.ports: dict[str, int] = {}
        """``0.0.0.0:P`` of a published container port P -> the local port used instead."""

    def paths(self, name: str) -> dict[str, str]:
        """Container path -> local path for ``name``: its volumes and its image's files."""
        out: dict[str, str] = {}
        for entry in SERVICES[name].get("volumes", []):
            source, target = entry.split(":")[:2]
            if target != "/dev/shm":  # the tests' /dev/shm is the shared memory here
                local = self.root / "volumes" / source
                local.mkdir(parents=True, exist_ok=True)
                out[target] = str(local)
        for word, rest in instructions(dockerfile_of(name)):
            if word == "COPY" and "--from" not in rest:
                source, target = rest.split()
                if target.startswith("/") and not target.startswith("/tmp"):
                    out[target] = str(REPO / source)
            if word == "ENV" and "BATCHD_HOME=" in rest:
                home = rest.split("BATCHD_HOME=")[1].split()[0]
                out[home] = str(self.root / "home" / name)
        return out

    def local(self, name: str, value: str) -> str:
        """``value`` as ``name``'s container would mean it, on this machine."""
        for container, here in sorted(self.paths(name).items(), key=lambda kv: -len(kv[0])):
            value = re.sub(rf"(?<![\w.]){re.escape(container)}(?=/|$)", here, value)
        for published, port in self.ports.items():
            value = value.replace(published, f"127.0.0.1:{port}")
        if value.startswith("postgresql"):
            value = self.database_url
        return value

    def publish(self, name: str) -> None:
        for mapping in SERVICES[name].get("ports", []):
            container_port = mapping.rpartition(":")[2]
            self.ports.setdefault(f"0.0.0.0:{container_port}", free_port())

    def argv(self, name: str, command: list[str] | None = None) -> list[str]:
        """The image's ENTRYPOINT + the service's command, or ``command`` (a healthcheck's
        ``CMD`` form), as local argv."""
        if command is None:
            entrypoint = next(
                yaml.safe_load(rest)
                for word, rest in reversed(instructions(dockerfile_of(name)))
                if word == "ENTRYPOINT"
            )
            command = [*entrypoint, *SERVICES[name]["command"]]
        head = COMMANDS.get(command[0], [command[0]])
        return [*head, *(self.local(name, str(a)) for a in command[1:])]

    def env(self, name: str) -> dict[str, str]:
        """Dockerfile ENV (batchd's), env_file, environment: later ones win."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
        image_env: dict[str, str] = {}
        for word, rest in instructions(dockerfile_of(name)):
            if word == "ENV":
                image_env.update(kv.split("=", 1) for kv in rest.split() if kv.startswith("BATCHD"))
        for values in (image_env, env_files(name), SERVICES[name].get("environment", {})):
            env.update({k: self.local(name, str(v)) for k, v in values.items()})
        return env


def start_order() -> list[str]:
    """The services in an order depends_on allows (a topological sort)."""
    done: list[str] = []

    def visit(name: str) -> None:
        if name not in done:
            for dependency in SERVICES[name].get("depends_on", {}):
                visit(dependency)
            done.append(name)

    for name in SERVICES:
        visit(name)
    return done


def awaited_as(name: str) -> set[str]:
    """How the services that depend on ``name`` wait for it."""
    conditions = set()
    for service in SERVICES.values():
        depends = service.get("depends_on", {})
        if isinstance(depends, dict) and name in depends:
            conditions.add(depends[name]["condition"])
    return conditions


@pytest.fixture
def compose_database(pg_admin_url: str) -> Iterator[str]:
    """A database on the throwaway Postgres made as the postgres service would make it (its
    POSTGRES_USER owns it), and the compose catalog URL pointed at it."""
    credentials = env_files("postgres")
    user, password = credentials["POSTGRES_USER"], credentials["POSTGRES_PASSWORD"]
    name = f"batchd_compose_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :u"), {"u": user})
            if exists.first() is None:
                conn.exec_driver_sql(f"CREATE ROLE \"{user}\" LOGIN PASSWORD '{password}'")
            conn.exec_driver_sql(f'CREATE DATABASE "{name}" OWNER "{user}"')
        served = make_url(pg_admin_url)
        compose_url = make_url(env_files("batchd-server")["BATCHD_DATABASE_URL"])
        assert compose_url.host == "postgres", "the catalog URL names the postgres service"
        yield compose_url.set(
            host=served.host, port=served.port, database=name, query=served.query
        ).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def _batches_served(address: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "batchd_batches_total"
    )


def test_the_compose_stack_runs_as_local_processes_and_the_trainer_exits_0(
    compose_database: str, tmp_path: Path
) -> None:
    """migrate and demo-data exit 0, the server passes its compose healthcheck, the trainer
    trains its epochs through batchd and exits 0, the server's metrics (what Prometheus
    scrapes) counted its batches, and SIGTERM stops the server cleanly."""
    stack = Stack(tmp_path, compose_database)
    order = [n for n in start_order() if n not in ("postgres", "prometheus", "grafana")]
    assert order == ["migrate", "demo-data", "batchd-server", "trainer"]
    running: dict[str, subprocess.Popen[bytes]] = {}
    outputs: dict[str, str] = {}
    try:
        for name in order:
            stack.publish(name)
            argv, env = stack.argv(name), stack.env(name)
            if "service_healthy" in awaited_as(name):
                log = (tmp_path / f"{name}.log").open("wb")
                running[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
                _wait_healthy(stack, name, running[name], tmp_path / f"{name}.log")
                continue
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
            outputs[name] = done.stdout + done.stderr
            assert done.returncode == 0, f"{name}: {argv}\n{outputs[name]}"
        assert "epoch 1:" in outputs["trainer"], outputs["trainer"]
        metrics = stack.ports["0.0.0.0:9400"]
        assert _batches_served(f"127.0.0.1:{metrics}") >= 2 * 6  # 2 epochs of >= 6 batches
    finally:
        # As `docker compose down`: SIGTERM, then a kill after the stop grace period.
        for name, proc in running.items():
            proc.send_signal(signal.SIGTERM)
            grace_s = int(SERVICES[name].get("stop_grace_period", "10s").removesuffix("s"))
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    log = (tmp_path / "batchd-server.log").read_text()
    assert running["batchd-server"].returncode == 0, log


def _wait_healthy(stack: Stack, name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Run ``name``'s compose healthcheck until it passes, as Docker would."""
    check = SERVICES[name]["healthcheck"]
    test = check["test"]
    assert test[0] == "CMD", test
    argv = stack.argv(name, test[1:])
    deadline = time.monotonic() + 120
    while True:
        result = subprocess.run(
            argv, env=stack.env(name), capture_output=True, text=True, timeout=60, check=False
        )
        if result.returncode == 0:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{name} never became healthy ({result.stdout}):\n{log.read_text()}")
        time.sleep(0.5)
