"""C65: the services bind loopback unless told otherwise (services/*/settings.py), so every place that
runs one in a pod says where to listen: each rendered overlay's serving containers (both services and
`mlpair relay`) get ``*_HOST=0.0.0.0``, the address kubelet's probes, the mesh and Prometheus reach
them on, and so does each image's runtime stage."""

from __future__ import annotations

import re

import deploy_checks as dc
import pytest

WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "Rollout"}
# `mlpair <args>` → the settings prefix whose HOST the process binds.
PREFIX = {("serve", "inference"): "INFERENCE", ("serve", "prediction"): "PREDICTION", ("relay",): "PREDICTION"}


def serving_hosts(objects: list[dict]) -> dict[tuple[str, str], str | None]:
    """(workload, container) → its ``<PREFIX>_HOST`` as the pod sees it (envFrom ConfigMaps, then env),
    for every container that runs a service or the relay."""
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    hosts = {}
    for o in objects:
        if o["kind"] not in WORKLOADS or "template" not in o["spec"]:
            continue
        for c in o["spec"]["template"]["spec"].get("containers", []):
            prefix = PREFIX.get(tuple(c.get("args", [])))
            if prefix is None:
                continue
            env: dict[str, str] = {}
            for source in c.get("envFrom", []):
                env.update(config_maps.get(source.get("configMapRef", {}).get("name"), {}))
            env.update({e["name"]: e.get("value") for e in c.get("env", [])})
            hosts[(o["metadata"]["name"], c["name"])] = env.get(f"{prefix}_HOST")
    return hosts


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_c65_every_serving_container_listens_on_the_pod_address(rendered, overlay):
    hosts = serving_hosts(rendered[overlay])
    assert hosts == {
        ("inference", "inference"): "0.0.0.0",
        ("prediction-stable", "prediction"): "0.0.0.0",
        ("prediction-relay", "relay"): "0.0.0.0",
    }


def test_c65_the_host_check_sees_a_container_left_on_the_default(rendered):
    objects = [dict(o) for o in rendered["prod"]]
    for o in objects:
        if o["kind"] == "ConfigMap" and "INFERENCE_HOST" in o.get("data", {}):
            o["data"] = {k: v for k, v in o["data"].items() if k != "INFERENCE_HOST"}
    assert serving_hosts(objects)[("inference", "inference")] is None


@pytest.mark.parametrize(("dockerfile", "variable"), [("inference", "INFERENCE_HOST"), ("prediction", "PREDICTION_HOST")])
def test_c65_each_image_listens_on_the_container_address(dockerfile, variable):
    text = (dc.DEPLOY_DIR / "docker" / f"{dockerfile}.Dockerfile").read_text()
    runtime = text.rsplit("\nFROM ", 1)[1]
    assert re.search(rf"^\s*(ENV\s+)?{variable}=0\.0\.0\.0\b", runtime, re.MULTILINE), f"{dockerfile}: no {variable}=0.0.0.0"
