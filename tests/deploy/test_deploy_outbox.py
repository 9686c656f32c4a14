"""PredictionService's outbox: on a claim of each pod, writable under a read-only root filesystem.

Each pod commits every decision to its local SQLite outbox before answering; what the relay has
not delivered to the CRM yet exists nowhere else. These tests hold the rendered StatefulSets to
that (and show the check refusing the ways it goes wrong), then open the real outbox at the
rendered URL inside the pod's laid-out filesystem."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path

import deploy_checks as dc
import pods
import pytest


def stable(rendered: dict, overlay: str = "prod") -> dict:
    return copy.deepcopy(dc.by_name(rendered[overlay], "StatefulSet", "prediction-stable"))


def with_setting(objects: list, workload: dict, name: str, value: str | None) -> list:
    """The render with one setting of the workload's ConfigMap changed (None: removed)."""
    objects = copy.deepcopy(objects)
    source = dc.pod_spec(workload)["containers"][0]["envFrom"][0]["configMapRef"]["name"]
    data = dc.by_name(objects, "ConfigMap", source)["data"]
    if value is None:
        data.pop(name)
    else:
        data[name] = value
    return objects


def mount(workload: dict, name: str) -> dict:
    return next(
        m for m in dc.pod_spec(workload)["containers"][0]["volumeMounts"] if m["name"] == name
    )


def test_outbox_check_refuses_what_would_lose_decisions(rendered: dict) -> None:
    objects = rendered["prod"]
    where = "StatefulSet/prediction-stable"

    # The setting left at its default: a relative path, under the read-only root.
    workload = stable(rendered)
    assert dc.outbox_problems(
        workload, with_setting(objects, workload, "PREDICTION_OUTBOX_URL", None)
    ) == [f"{where}: PREDICTION_OUTBOX_URL not set (the default is a relative path)"]
    relative = with_setting(
        objects, workload, "PREDICTION_OUTBOX_URL", "sqlite+aiosqlite:///var/outbox.sqlite"
    )
    assert "is relative" in dc.outbox_problems(workload, relative)[0]
    # A path no volume holds (the image's filesystem).
    elsewhere = with_setting(
        objects, workload, "PREDICTION_OUTBOX_URL", "sqlite+aiosqlite:////srv/outbox.sqlite"
    )
    assert dc.outbox_problems(workload, elsewhere) == [
        f"{where}: outbox /srv/outbox.sqlite is on the read-only root filesystem, no volume holds it"
    ]
    # On /tmp: an emptyDir, gone with the pod.
    on_tmp = with_setting(
        objects, workload, "PREDICTION_OUTBOX_URL", "sqlite+aiosqlite:////tmp/outbox.sqlite"
    )
    (problem,) = dc.outbox_problems(workload, on_tmp)
    assert "is on emptyDir, not a claim of its own" in problem
    # Mounted read-only.
    read_only = stable(rendered)
    mount(read_only, "outbox")["readOnly"] = True
    assert (
        f"{where}: outbox /var/lib/mlpair/outbox/prediction-outbox.sqlite is on a read-only mount"
        in (dc.outbox_problems(read_only, objects))
    )
    # Claims deleted on scale-down: a removed pod's undelivered decisions with them.
    deleting = stable(rendered)
    deleting["spec"]["persistentVolumeClaimRetentionPolicy"]["whenScaled"] = "Delete"
    assert dc.outbox_problems(deleting, objects) == [
        f"{where}: outbox claims are deleted whenScaled: undelivered decisions too"
    ]
    # One claim shared by several writers.
    shared = stable(rendered)
    shared["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] = ["ReadWriteMany"]
    assert dc.outbox_problems(shared, objects) == [
        f"{where}: outbox claim is not ReadWriteOnce (one writer per outbox)"
    ]
    # The same pod template as a Deployment: no claim per pod.
    deployment = stable(rendered)
    deployment["kind"] = "Deployment"
    (problem,) = dc.outbox_problems(deployment, objects)
    assert "is on volumeClaimTemplate, not a claim of its own" in problem


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
async def test_outbox_takes_writes_inside_its_claim_under_a_read_only_root(
    rendered: dict, overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlpair.prediction.crm.outbox import Outbox
    from mlpair.prediction.crm.store import StoredDecision

    objects = rendered[overlay]
    empty_repository = tmp_path / "models"
    for workload in dc.workloads(objects, "prediction"):
        for family, version in dc.mounted_versions(workload, "/models")[0]:
            (empty_repository / family / version).mkdir(parents=True, exist_ok=True)
        pod = pods.materialise(
            workload, objects, tmp_path / workload["metadata"]["name"], empty_repository
        )
        # Relative paths would resolve against the working folder: make that the pod's root too.
        monkeypatch.chdir(pod.root)
        outbox = Outbox(pod.env["PREDICTION_OUTBOX_URL"])
        await outbox.migrate()
        try:
            recorded = await outbox.record(
                StoredDecision(
                    decision_id="",
                    request_id=str(uuid.uuid4()),
                    entity_id="applicant-1",
                    model_name="credit-risk",
                    model_version="1",
                    feature_schema_version="credit-risk/v1",
                    policy_version="p",
                    probability=0.2,
                    decision="APPROVE",
                    reason_codes=("LOW_DEFAULT_RISK",),
                )
            )
            assert await outbox.probe()
            assert await outbox.backlog() == (1, pytest.approx(0, abs=60))
        finally:
            await outbox.close()
        assert not recorded.replayed
        outbox_path = dc.sqlite_path(dc.settings_of(workload, objects)["PREDICTION_OUTBOX_URL"])
        assert pod.path(outbox_path).is_file()
        # Nothing outside the pod's writable volumes (the claim, /tmp) was written.
        assert pod.written_outside_writable_mounts() == []
