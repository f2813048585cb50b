"""docker-compose.yml validates against the compose specification and keeps batchd's
invariants: Postgres with a volume, a healthcheck and its password in an env file; the
one-shot migration the server waits for; /dev/shm sized and shared with the trainer together
with the socket; hardened batchd containers; pinned images; ports on 127.0.0.1; Prometheus
and Grafana wired to the server and the dashboard."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.engine import make_url

from deploy_support import REPO, SERVER_UID, size_bytes, tool

COMPOSE = REPO / "docker-compose.yml"
BATCHD_SERVICES = ("migrate", "demo-data", "batchd-server", "trainer")
THIRD_PARTY = ("postgres", "prometheus", "grafana")


@functools.cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def env_file(name: str) -> dict[str, str]:
    """The variables of ``name``'s env files, as compose reads them."""
    values: dict[str, str] = {}
    for path in service(name).get("env_file", []):
        for line in (REPO / path).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                key, _, value = line.partition("=")
                values[key.strip()] = value.strip()
    return values


def volumes(name: str) -> dict[str, str]:
    """Mount path -> source (a named volume, or a path) of ``name``'s volumes."""
    out = {}
    for entry in service(name).get("volumes", []):
        source, target = entry.split(":")[:2]
        out[target] = source
    return out


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def flag_value(args: list[str], name: str) -> str:
    """The value of ``name=value`` in ``args``."""
    return next(a.partition("=")[2] for a in args if a.startswith(f"{name}="))


def test_the_compose_file_validates_against_the_compose_specification() -> None:
    """check-jsonschema with its vendored compose-spec schema (offline) accepts the file,
    and rejects the same file with an unknown service key."""
    command = [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec"]
    ok = subprocess.run(
        [*command, str(COMPOSE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_a_broken_compose_file_fails_the_same_validation(tmp_path: Path) -> None:
    """The validator is not a rubber stamp: ``shm-size`` (a typo of shm_size) fails."""
    broken = compose() | {"services": {"batchd-server": service("batchd-server") | {"shm-size": 1}}}
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(broken))
    command = [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0 and "shm-size" in result.stdout


def test_postgres_keeps_its_data_checks_its_health_and_reads_its_password_from_a_file() -> None:
    """A named volume for the data, pg_isready as healthcheck, no password inline; the
    password in postgres.env is the one in the catalog URL batchd reads."""
    postgres = service("postgres")
    assert volumes("postgres")["/var/lib/postgresql/data"] in compose()["volumes"]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert "POSTGRES_PASSWORD" not in str(postgres.get("environment", ""))
    credentials = env_file("postgres")
    url = make_url(env_file("batchd-server")["BATCHD_DATABASE_URL"])
    assert credentials["POSTGRES_PASSWORD"] and url.password == credentials["POSTGRES_PASSWORD"]
    assert (url.username, url.database, url.host) == (
        credentials["POSTGRES_USER"],
        credentials["POSTGRES_DB"],
        "postgres",
    )


def test_jobs_run_once_in_order_and_the_server_waits_for_the_migration() -> None:
    """migrate (after Postgres is healthy) -> demo-data; the server starts only once the
    migration completed; the trainer once the server is healthy and the data is in."""
    ran_once = {"migrate": ["migrate"], "demo-data": ["demo-data"]}
    for name, command in ran_once.items():
        assert service(name)["command"][: len(command)] == command
        assert service(name)["restart"] == "no"
    depends = {name: service(name).get("depends_on", {}) for name in compose()["services"]}
    assert depends["migrate"]["postgres"]["condition"] == "service_healthy"
    assert depends["demo-data"]["migrate"]["condition"] == "service_completed_successfully"
    assert depends["batchd-server"]["migrate"]["condition"] == "service_completed_successfully"
    assert depends["trainer"]["batchd-server"]["condition"] == "service_healthy"
    assert depends["trainer"]["demo-data"]["condition"] == "service_completed_successfully"
    assert "migrate" not in service("batchd-server")["command"]


def test_shm_is_sized_and_shared_with_the_trainer_together_with_the_socket() -> None:
    """The server and the trainer mount one tmpfs volume at /dev/shm and one at the socket's
    directory; the trainer's target is the server's --listen; the shm budget fits the
    volume; the server's memory limit holds the volume plus its working set; the healthcheck
    asks the server over that socket."""
    server, trainer = service("batchd-server"), service("trainer")
    listen = flag(server["command"], "--listen")
    socket_dir = str(Path(listen.removeprefix("unix://")).parent)
    for path in ("/dev/shm", socket_dir):
        assert volumes("batchd-server")[path] == volumes("trainer")[path], path
        options = compose()["volumes"][volumes("trainer")[path]]["driver_opts"]
        assert options["type"] == "tmpfs"
    shm_options = compose()["volumes"][volumes("trainer")["/dev/shm"]]["driver_opts"]["o"]
    shm_bytes = size_bytes(dict(o.split("=") for o in shm_options.split(","))["size"])
    assert size_bytes(server["environment"]["BATCHD_SHM_BUDGET"]) < shm_bytes
    working_set = size_bytes(server["labels"]["dev.batchd.working-set"])
    assert size_bytes(server["mem_limit"], compose=True) >= shm_bytes + working_set
    assert trainer["environment"]["BATCHD_TARGET"] == listen
    assert server["healthcheck"]["test"] == [
        "CMD",
        "batchd-server",
        "healthcheck",
        "--target",
        listen,
    ]


def test_batchd_containers_are_hardened_and_run_as_one_user() -> None:
    """Every batchd container: uid 10001 (the same on the server and the trainer), a
    read-only root with /tmp in memory, no capabilities, no privilege escalation."""
    for name in BATCHD_SERVICES:
        s = service(name)
        assert s["user"] == f"{SERVER_UID}:{SERVER_UID}", name
        assert s["read_only"] is True and s["tmpfs"] == ["/tmp"], name
        assert s["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in s["security_opt"], name


def test_images_are_pinned_and_ports_are_bound_to_loopback() -> None:
    """Third-party images by tag and sha256 digest; batchd's images built here with an
    explicit version tag; every published port on 127.0.0.1."""
    for name in THIRD_PARTY:
        image = service(name)["image"]
        reference, _, digest = image.partition("@sha256:")
        assert len(digest) == 64 and ":" in reference, f"{name}: {image} is not pinned"
    for name in BATCHD_SERVICES:
        tag = service(name)["image"].rpartition(":")[2]
        assert tag not in ("", "latest") and tag[0].isdigit(), name
    assert service("migrate")["build"]["dockerfile"] == "deploy/Dockerfile"
    assert service("trainer")["build"]["dockerfile"] == "examples/Dockerfile"
    for name, s in compose()["services"].items():
        for port in s.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_prometheus_scrapes_the_server_and_grafana_provisions_the_dashboard() -> None:
    """Prometheus's only target is the server's --metrics-listen port; Grafana mounts the
    provisioning folder, the dashboard where its provider looks, and a default Prometheus
    data source at the prometheus service."""
    port = flag(service("batchd-server")["command"], "--metrics-listen").rpartition(":")[2]
    config_file = flag_value(service("prometheus")["command"], "--config.file")
    config = yaml.safe_load((REPO / volumes("prometheus")[config_file]).read_text())
    jobs = config["scrape_configs"]
    targets = [t for job in jobs for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"batchd-server:{port}"]
    grafana = volumes("grafana")
    provisioning = REPO / grafana["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "batchd.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert (REPO / grafana[f"{folder}/batchd.json"]).resolve() == (
        REPO / "deploy" / "grafana" / "batchd.json"
    )
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    datasource = source["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in service("prometheus")["ports"]
