"""deploy/k8s/batch-scoring: `mlpair score --engine ray` as a KubeRay RayJob, checked offline.

There is no RayJob CRD schema here: the test checks what the job relies on instead: the fields
KubeRay requires (entrypoint, rayClusterSpec with a head group and named worker groups, each with
rayStartParams and a pod template whose containers have an image), that each pod template is a
valid Kubernetes pod template (the official schema, strict) hardened as the project's other pods
are, that the entrypoint is a command line `mlpair score` itself accepts, and that its target is
the PredictionService the pair's release serves, reachable from the job's namespace through the
mesh (the AuthorizationPolicy and the NetworkPolicy both admit it).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import deploy_checks as dc
import pytest

FOLDER = dc.K8S_DIR / "batch-scoring"


@pytest.fixture(scope="module")
def batch(kubectl: Path) -> list[dict]:
    return dc.render(kubectl, FOLDER)


@pytest.fixture(scope="module")
def rayjob(batch: list[dict]) -> dict:
    (job,) = dc.of_kind(batch, "RayJob")
    return job


def pod_templates(rayjob: dict) -> dict[str, dict]:
    """Each pod template of the RayJob by role: submitter, head, and each worker group by name."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = {"submitter": rayjob["spec"]["submitterPodTemplate"], "head": cluster["headGroupSpec"]["template"]}
    templates.update({f"worker {g['groupName']}": g["template"] for g in cluster["workerGroupSpecs"]})
    return templates


def entrypoint_args(rayjob: dict):
    from mlpair.cli import build_parser

    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[0] == "mlpair"
    return build_parser().parse_args(argv[1:])


def test_the_rayjob_has_what_kuberay_requires(rayjob: dict) -> None:
    assert rayjob["apiVersion"] == "ray.io/v1"
    spec = rayjob["spec"]
    assert spec["entrypoint"].strip() and spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    major, minor, *_ = (int(part) for part in cluster["rayVersion"].split("."))
    assert (major, minor) >= (2, 50)  # the score-ray extra's lowest Ray
    assert isinstance(cluster["headGroupSpec"]["rayStartParams"], dict)
    groups = cluster["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups) >= 1
    for group in groups:
        assert isinstance(group["rayStartParams"], dict)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for role, template in pod_templates(rayjob).items():
        for container in template["spec"]["containers"]:
            assert container["image"].startswith("registry.example.com/mlpair/score-ray:"), role


@pytest.mark.parametrize("version", dc.KUBERNETES_VERSIONS)
def test_every_pod_template_is_a_valid_kubernetes_pod_template(
    rayjob: dict, kubernetes_validate_installed: None, version: str
) -> None:
    problems = []
    for role, template in pod_templates(rayjob).items():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.replace(" ", "-")},
                   "template": template}
        problems += dc.kubernetes_schema_errors(wrapped, version)
    assert problems == []


def test_the_other_objects_match_the_official_schemas(batch: list[dict], kubernetes_validate_installed: None) -> None:
    objects = [obj for obj in batch if obj["kind"] != "RayJob"]
    assert {obj["kind"] for obj in objects} == {"ServiceAccount", "PersistentVolumeClaim"}
    assert [p for obj in objects for version in dc.KUBERNETES_VERSIONS for p in dc.kubernetes_schema_errors(obj, version)] == []


def test_every_pod_is_hardened_as_the_project_pods_are(rayjob: dict, batch: list[dict]) -> None:
    problems = []
    for role, template in pod_templates(rayjob).items():
        owner = {"kind": "RayJob", "metadata": {"name": f"batch-scoring {role}"}, "spec": {"template": template}}
        problems += dc.lint_pod(owner)
        assert template["spec"]["serviceAccountName"] == "batch-scoring"
    assert problems == []
    (account,) = dc.of_kind(batch, "ServiceAccount")
    assert account["metadata"]["name"] == "batch-scoring"


def test_the_entrypoint_is_a_ray_scoring_job_mlpair_score_accepts(rayjob: dict) -> None:
    args = entrypoint_args(rayjob)
    assert (args.command, args.engine) == ("score", "ray")
    assert args.input and args.output and args.key and args.job_id and args.query is None
    assert args.ray_address is None  # KubeRay sets RAY_ADDRESS for the entrypoint
    cluster = rayjob["spec"]["rayClusterSpec"]
    for template in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
        mounts = {m["mountPath"] for c in template["spec"]["containers"] for m in c.get("volumeMounts", ())}
        assert "/data" in mounts  # the driver lists the input, the workers read and write it
    for path in (args.input, args.output):
        assert path.startswith("/data/")


def test_the_target_is_the_prediction_service_and_the_mesh_admits_the_job(
    rayjob: dict, rendered: dict, rendered_istio: list
) -> None:
    args = entrypoint_args(rayjob)
    host, port = args.target.rsplit(":", 1)
    namespace = rayjob["metadata"]["namespace"]
    assert host == dc.fqdn("prediction")
    for objects in rendered.values():
        service = dc.by_name(objects, "Service", "prediction")
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
        policy = dc.by_name(objects, "NetworkPolicy", "prediction")
        admitted = {value for rule in policy["spec"]["ingress"] for peer in rule["from"]
                    for expression in (peer.get("namespaceSelector") or {}).get("matchExpressions", ())
                    for value in expression["values"] if any(p["port"] == int(port) for p in rule["ports"])}
        assert namespace in admitted
    callers = dc.by_name(rendered_istio, "AuthorizationPolicy", "prediction-callers")
    rules = [r for r in callers["spec"]["rules"] if any(namespace in s["source"].get("namespaces", ())
                                                        for s in r["from"])]
    assert rules and any("/mlpair.prediction.v1.PredictionService/*" in op["operation"]["paths"]
                         for r in rules for op in r["to"])
    # the sidecar carries the calls to PredictionService's port, and nothing of Ray's own traffic
    cluster = rayjob["spec"]["rayClusterSpec"]
    for template in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
        annotations = template["metadata"]["annotations"]
        assert annotations["sidecar.istio.io/inject"] == "true"
        assert annotations["traffic.sidecar.istio.io/includeOutboundPorts"] == port
        assert annotations["traffic.sidecar.istio.io/includeOutboundIPRanges"] == ""
