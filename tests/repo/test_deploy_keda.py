"""deploy/k8s/overlays/pool-keda: the pool autoscaled by KEDA, down to zero between jobs.

The ScaledObject that ``kubectl kustomize`` renders validates against the schema KEDA
publishes for it (tests/data/keda, vendored from KEDA's CRD), applied strictly as the API
server applies it, plus the CRD's CEL rule and the admission webhook's rules that concern
it; a broken one fails the same validation. And the design holds together: the HPA is gone,
KEDA owns the replica count, the triggers read metrics the server really exports, and the
pods that wake a pool at zero are the trainers that use it, never the pool's own pods."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from batchd_server.metrics.admission import SESSIONS
from batchd_server.metrics.stall import DATA_STALL_RATIO

from deploy_support import (
    K8S,
    OVERLAYS,
    REPO,
    Doc,
    assert_hardened,
    docs,
    env,
    find,
    named,
    pods,
    tool,
)

OVERLAY = "pool-keda"
SCHEMA = REPO / "tests" / "data" / "keda" / "scaledobject.schema.json"
TRAINER = K8S / "examples" / "pool-trainer-job.yaml"


def strict(schema: Any) -> Any:
    """``schema`` as the API server applies it with strict field validation (``kubectl
    apply``'s default): an object with ``properties`` takes no field it does not list."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def problems(scaled: Doc) -> list[str]:
    """Why the API server (KEDA's schema, strictly, and the CRD's CEL rule) or KEDA's
    admission webhook would refuse ``scaled``; [] when neither would."""
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(strict(schema))
    found = [
        f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in validator.iter_errors(scaled)
    ]
    if (scaled["apiVersion"], scaled["kind"]) != ("keda.sh/v1alpha1", "ScaledObject"):
        found.append(f"not a keda.sh/v1alpha1 ScaledObject: {scaled['apiVersion']}")
    spec = scaled.get("spec", {})
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if isinstance(low, int) and isinstance(high, int) and low > high:  # the CRD's CEL rule
        found.append("minReplicaCount must be less than or equal to maxReplicaCount")
    triggers = [t for t in spec.get("triggers", []) if isinstance(t, dict)]
    names = [t["name"] for t in triggers if t.get("name")]
    found += [
        f"triggerName {n!r} is defined more than once" for n in set(names) if names.count(n) > 1
    ]
    if low == 0 and triggers and all(t.get("type") in ("cpu", "memory") for t in triggers):
        found.append("only cpu/memory triggers with minReplicaCount 0: it never scales to zero")
    return found


def scaled_object() -> Doc:
    (found,) = [d for d in docs(OVERLAY) if d["kind"] == "ScaledObject"]
    return found


def triggers(scaled: Doc) -> dict[str, Doc]:
    return {t["name"]: t for t in scaled["spec"]["triggers"]}


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Whether an equality-based label selector (``k=v,k2=v2``, KEDA's podSelector) selects a
    pod with ``labels``."""
    pairs = [term.split("=", 1) for term in selector.split(",")]
    assert all(len(p) == 2 and "!" not in p[0] for p in pairs), f"not equality-based: {selector}"
    return all(labels.get(k.strip()) == v.strip() for k, v in pairs)


def test_the_rendered_scaled_object_validates_against_kedas_published_schema() -> None:
    assert OVERLAY in OVERLAYS, "the overlay is rendered and checked with the others"
    assert problems(scaled_object()) == []


@pytest.mark.parametrize(
    ("why", "break_it", "said"),
    [
        ("the HPA's word", lambda s: s["spec"].update(minReplicas=0), "minReplicas"),
        ("a negative minimum", lambda s: s["spec"].update(minReplicaCount=-1), "minimum"),
        (
            "a number, not a string",
            lambda s: s["spec"]["triggers"][2]["metadata"].update(threshold=0.2),
            "0.2 is not of type 'string'",
        ),
        ("no metadata", lambda s: s["spec"]["triggers"][0].pop("metadata"), "'metadata'"),
        ("no target", lambda s: s["spec"].pop("scaleTargetRef"), "'scaleTargetRef'"),
        ("min above max", lambda s: s["spec"].update(minReplicaCount=20), "less than or equal"),
        (
            "a name twice",
            lambda s: s["spec"]["triggers"][1].update(name="trainers"),
            "defined more than once",
        ),
        (
            "cpu alone",
            lambda s: s["spec"].update(triggers=[triggers(s)["cpu"]]),
            "never scales to zero",
        ),
    ],
)
def test_a_broken_scaled_object_fails_the_same_validation(
    why: str, break_it: Any, said: str
) -> None:
    """The validation is not a rubber stamp: each mistake is refused, and says what."""
    broken = copy.deepcopy(scaled_object())
    break_it(broken)
    found = problems(broken)
    assert any(said in p for p in found), (why, found)


def test_keda_replaces_the_hpa_and_owns_the_replica_count() -> None:
    """No HPA in the overlay (two autoscalers on one Deployment fight); the Deployment names
    no replica count (an apply would reset what KEDA scaled to); the ScaledObject targets it,
    from 0 replicas to the HPA's maximum; the rest of the pool is the pool overlay's."""
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs(OVERLAY)}
    assert not [k for k in kinds if k[0] == "HorizontalPodAutoscaler"]
    pool = {(d["kind"], d["metadata"]["name"]) for d in docs("pool")}
    assert kinds == pool - {("HorizontalPodAutoscaler", "batchd-server")} | {
        ("ScaledObject", "batchd-server")
    }
    deployment = find(OVERLAY, "Deployment", "batchd-server")
    assert "replicas" not in deployment["spec"]
    spec = scaled_object()["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "batchd-server",
    }
    hpa = find("pool", "HorizontalPodAutoscaler", "batchd-server")["spec"]
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] == hpa["maxReplicas"]
    server = named(deployment["spec"]["template"]["spec"]["containers"], "batchd-server")
    assert server["resources"]["requests"]["cpu"], "KEDA's cpu trigger needs a CPU request"


def test_the_triggers_size_on_the_stall_ratio_and_keep_a_replica_while_sessions_are_open() -> None:
    """The Prometheus triggers query metrics the server exports under those names: the stall
    ratio sizes the pool as the HPA does (0.2 a replica); open sessions keep one replica and
    never ask for more (clamped at 1, as a striping trainer holds one on every replica)."""
    found = triggers(scaled_object())
    assert set(found) == {"trainers", "open-sessions", "stall-ratio", "cpu"}
    stall, sessions = found["stall-ratio"], found["open-sessions"]
    assert {stall["type"], sessions["type"]} == {"prometheus"}
    assert f"{DATA_STALL_RATIO._name}{{" in stall["metadata"]["query"]
    assert float(stall["metadata"]["threshold"]) == 0.2
    query = sessions["metadata"]["query"]
    assert query.startswith("clamp_max(") and query.endswith(", 1)")
    assert f"sum({SESSIONS._name}{{" in query
    assert sessions["metadata"]["threshold"] == "1"
    assert sessions["metadata"]["activationThreshold"] == "0"
    assert found["cpu"]["metricType"] == "Utilization"


def _trainer() -> Doc:
    (job,) = [d for d in yaml.safe_load_all(TRAINER.read_text()) if d]
    return job


def test_what_wakes_a_pool_at_zero_is_its_trainers_and_nothing_of_its_own() -> None:
    """At zero no replica exports a metric, so the wake is the kubernetes-workload trigger
    on pods labelled as the pool's trainers: it selects the example trainer's pod, and no pod
    any overlay runs (the pool's own pods would keep it up forever, the sidecar trainer has a
    server of its own); it asks for one replica, never more."""
    wake = triggers(scaled_object())["trainers"]
    assert wake["type"] == "kubernetes-workload"
    selector = wake["metadata"]["podSelector"]
    assert selects(selector, _trainer()["spec"]["template"]["metadata"]["labels"])
    for overlay in OVERLAYS:
        for workload, pod in pods(overlay):
            assert not selects(selector, pod["metadata"].get("labels", {})), (overlay, workload)
    assert wake["metadata"]["activationValue"] == "0"
    assert float(wake["metadata"]["value"]) >= 1000, "a wake, not a size: one replica"


def test_the_example_trainer_stripes_over_the_pool_and_waits_for_it() -> None:
    """The example trainer Job (deploy/k8s/examples) is hardened like the pool's pods; its
    Loader stripes over the overlay's headless Service with the pool's token, and waits for a
    replica longer than KEDA takes to notice it (its polling interval) with room for the
    replica's start."""
    job = _trainer()
    assert_hardened(job["metadata"]["name"], job["spec"]["template"])
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    variables = env(trainer)
    headless = find(OVERLAY, "Service", "batchd-headless")["spec"]
    port = named(headless["ports"], "grpc")["port"]
    assert variables["BATCHD_TARGET"] == f"dns:///batchd-headless:{port}"
    assert variables["BATCHD_AUTH_TOKEN"]["secretKeyRef"] == {
        "name": "batchd-secrets",
        "key": "auth-token",
    }
    polling = scaled_object()["spec"]["pollingInterval"]
    assert float(variables["BATCHD_WAIT_FOR_SERVER_S"]) >= polling + 300


def test_the_component_also_scales_the_object_store_pool(tmp_path: Path) -> None:
    """components/keda is not tied to overlays/pool: added to pool-object-store in an
    overlay of one's own, it renders and validates the same way."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / "pool-object-store", mine)],
                "components": [os.path.relpath(K8S / "components" / "keda", mine)],
            }
        )
    )
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(mine)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert not [d for d in rendered if d["kind"] == "HorizontalPodAutoscaler"]
    (scaled,) = [d for d in rendered if d["kind"] == "ScaledObject"]
    assert problems(scaled) == []
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    assert "replicas" not in deployment["spec"]
