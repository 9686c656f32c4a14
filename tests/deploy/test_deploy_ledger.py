"""PredictionService's decision ledger as the rendered overlays deploy it: stateless prediction
Deployments on one shared ledger, and the schema migration Job that runs before them.

Every replica of every track commits each decision to the same ledger before answering, so no pod
owns state: scaling a track down, a crash or retiring the canary strands nothing. These tests hold
the render to that and to the migration's order and privileges (ledger_checks.py), and show each
check refusing the ways it goes wrong."""

from __future__ import annotations

import copy

import deploy_checks as dc
import ledger_checks as lc
import pytest

DEPLOYMENT = "Deployment/prediction-stable"
JOB = "Job/prediction-migrate"


@pytest.fixture(params=dc.OVERLAYS)
def objects(request: pytest.FixtureRequest, rendered: dict) -> list[dict]:
    return rendered[request.param]


def variant(rendered: dict, overlay: str = "prod") -> tuple[list[dict], dict, dict]:
    """A copy of an overlay's render, with its stable track and its migration Job."""
    objects = copy.deepcopy(rendered[overlay])
    stable = dc.by_name(objects, "Deployment", "prediction-stable")
    return objects, stable, dc.by_name(objects, "Job", "prediction-migrate")


def container(owner: dict) -> dict:
    return dc.pod_spec(owner)["containers"][0]


def env_var(owner: dict, name: str) -> dict:
    return next(v for v in container(owner)["env"] if v["name"] == name)


def settings_map(objects: list, workload: dict) -> dict:
    source = container(workload)["envFrom"][0]["configMapRef"]["name"]
    return dc.by_name(objects, "ConfigMap", source)["data"]


# --------------------------------------------------------------------------- the prediction pods


def test_prediction_pods_keep_no_decision_of_their_own(objects: list) -> None:
    prediction = dc.workloads(objects, "prediction")
    assert prediction
    for workload in prediction:
        assert lc.ledger_problems(workload, objects) == []
        assert workload["kind"] == "Deployment"
        # Read-only configuration mounts, and the model cache: nothing else is writable.
        writable = [m["mountPath"] for m in container(workload)["volumeMounts"] if not m.get("readOnly")]
        assert writable == [settings_map(objects, workload)["PREDICTION_MODEL_CACHE_DIR"]]
    assert not dc.of_kind(objects, "StatefulSet")


def test_every_track_records_into_the_same_ledger_and_crm(rendered: dict) -> None:
    # A canary writing a ledger of its own would decide a request id the stable pods already
    # decided, and strand its backlog when it is retired. In prod the canary's pods are a new
    # revision of the one track's template (Argo Rollout), so they read the same Secrets by
    # construction; every track of every overlay must too.
    tracks = [w for overlay in rendered.values() for w in dc.workloads(overlay, "prediction")]
    assert {dc.rollout_of(w, rendered["prod"]) is not None for w in dc.workloads(rendered["prod"], "prediction")} == {True}
    sources = {
        dc.name_of(w): {
            name: env_var(w, name)["valueFrom"]["secretKeyRef"] for name in lc.SERVING_SECRETS
        }
        for w in tracks
    }
    expected = {name: {"name": s, "key": k} for name, (s, k) in lc.SERVING_SECRETS.items()}
    assert sources == {name: expected for name in sources}


def test_ledger_check_refuses_what_would_strand_or_split_decisions(rendered: dict) -> None:
    # The previous release's shape: a StatefulSet with a claim per pod holding its outbox.
    objects, stable, _ = variant(rendered)
    stable["kind"] = "StatefulSet"
    stable["spec"]["volumeClaimTemplates"] = [{"metadata": {"name": "outbox"}, "spec": {}}]
    container(stable)["volumeMounts"].append({"name": "outbox", "mountPath": "/var/lib/outbox"})
    assert lc.ledger_problems(stable, objects) == [
        "StatefulSet/prediction-stable: a StatefulSet, not a Deployment: no pod owns state",
        "StatefulSet/prediction-stable: volumeClaimTemplates give each pod a volume of its own",
        (
            "StatefulSet/prediction-stable: /var/lib/outbox is a writable volumeClaimTemplate: "
            "whatever the pod wrote there would be stranded with it"
        ),
    ]
    # An emptyDir beside the model cache, or a writable claim.
    objects, stable, _ = variant(rendered)
    dc.pod_spec(stable)["volumes"].append({"name": "scratch", "emptyDir": {}})
    container(stable)["volumeMounts"].append({"name": "scratch", "mountPath": "/var/lib/mlpair"})
    dc.pod_spec(stable)["volumes"].append({"name": "shared", "persistentVolumeClaim": {"claimName": "x"}})
    container(stable)["volumeMounts"].append({"name": "shared", "mountPath": "/srv/shared"})
    problems = lc.ledger_problems(stable, objects)
    assert len(problems) == 2
    assert f"{DEPLOYMENT}: /srv/shared is a writable persistentVolumeClaim" in problems[0]
    assert f"{DEPLOYMENT}: /var/lib/mlpair is a writable emptyDir" in problems[1]
    # No ledger URL: the default is a SQLite file of the pod's own.
    objects, stable, _ = variant(rendered)
    container(stable)["env"].remove(env_var(stable, "PREDICTION_LEDGER_URL"))
    assert lc.ledger_problems(stable, objects) == [
        (
            f"{DEPLOYMENT}: PREDICTION_LEDGER_URL not set (the default is a SQLite file on the "
            "pod's read-only root, of this pod alone)"
        )
    ]
    # A literal SQLite ledger, a ledger Secret of the track's own, the URL in a ConfigMap.
    objects, stable, _ = variant(rendered)
    env = container(stable)["env"]
    env[env.index(env_var(stable, "PREDICTION_LEDGER_URL"))] = {
        "name": "PREDICTION_LEDGER_URL",
        "value": "sqlite+aiosqlite:////tmp/ledger.sqlite",
    }
    env_var(stable, "PREDICTION_CRM_URL")["valueFrom"]["secretKeyRef"]["name"] = "crm-stable"
    settings_map(objects, stable)["PREDICTION_OUTBOX_URL"] = "sqlite+aiosqlite:///outbox.sqlite"
    assert lc.ledger_problems(stable, objects) == [
        (
            f"{DEPLOYMENT}: PREDICTION_LEDGER_URL is the value "
            "'sqlite+aiosqlite:////tmp/ledger.sqlite', not key url of Secret prediction-ledger"
        ),
        (
            f"{DEPLOYMENT}: PREDICTION_CRM_URL is key url of Secret crm-stable, "
            "not key url of Secret prediction-crm"
        ),
        f"{DEPLOYMENT}: PREDICTION_OUTBOX_URL is a setting of the per-pod outbox, gone",
    ]
    objects, stable, _ = variant(rendered)
    container(stable)["env"].remove(env_var(stable, "PREDICTION_LEDGER_URL"))
    settings_map(objects, stable)["PREDICTION_LEDGER_URL"] = "postgresql+asyncpg://app@db/ledger"
    assert lc.ledger_problems(stable, objects) == [
        f"{DEPLOYMENT}: PREDICTION_LEDGER_URL is in a ConfigMap, not from Secret prediction-ledger"
    ]


def test_no_serving_pod_can_read_the_schema_owner_secrets(objects: list) -> None:
    # The owner's credentials could change any schema; only the migration Job holds them.
    for workload in dc.workloads(objects):
        assert not lc.secret_refs(workload) & lc.owner_secret_names(), dc.name_of(workload)
    holders = [o for o in dc.pod_owners(objects) if lc.secret_refs(o) & lc.owner_secret_names()]
    assert [dc.name_of(o) for o in holders] == [JOB]
    assert lc.secret_refs(holders[0]) == lc.owner_secret_names()
    # And the check notices a serving pod that mounts one.
    stable = copy.deepcopy(dc.by_name(objects, "Deployment", "prediction-stable"))
    dc.pod_spec(stable)["volumes"].append(
        {"name": "owner", "secret": {"secretName": "prediction-ledger-owner"}}
    )
    assert lc.ledger_problems(stable, objects) == [
        f"{DEPLOYMENT}: references the schema owner's Secret prediction-ledger-owner"
    ]


# --------------------------------------------------------------------------- rollouts


def test_prediction_tracks_roll_without_losing_capacity(objects: list) -> None:
    for workload in dc.workloads(objects, "prediction"):
        assert lc.rollout_problems(workload, objects) == []


def test_production_tracks_keep_serving_through_a_rollout_and_a_drain(rendered: dict) -> None:
    # maxUnavailable 0 during the rollout, one eviction at a time by the PDB: at least
    # minReplicas - 1 pods of each track stay Ready, never none.
    objects = rendered["prod"]
    for workload in dc.workloads(objects, "prediction"):
        name = workload["metadata"]["name"]
        minimum = dc.autoscaler_of(workload, objects)["spec"]["minReplicas"]
        budget = dc.by_name(objects, "PodDisruptionBudget", name)["spec"]["maxUnavailable"]
        rolling = workload["spec"]["strategy"]["rollingUpdate"]
        assert minimum - rolling["maxUnavailable"] - budget >= 1, name


def test_rollout_check_refuses_a_rollout_that_dips_or_mis_spreads(rendered: dict) -> None:
    objects, stable, _ = variant(rendered)  # prod: the stable track's HPA minimum is 3
    stable["spec"]["strategy"] = {"type": "Recreate"}
    assert lc.rollout_problems(stable, objects) == [
        f"{DEPLOYMENT}: strategy Recreate stops every pod before starting new ones"
    ]
    # 25% of 3 pods rounds down to 0 unavailable (accepted); 50% is one pod down.
    stable["spec"]["strategy"] = {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "25%"},
    }
    assert lc.rollout_problems(stable, objects) == []
    stable["spec"]["strategy"]["rollingUpdate"] = {"maxUnavailable": "50%", "maxSurge": 0}
    assert lc.rollout_problems(stable, objects) == [
        (
            f"{DEPLOYMENT}: maxUnavailable is 1 pod(s) at the HPA minimum (3): a rollout would serve "
            "from fewer pods than the HPA asked for"
        ),
        f"{DEPLOYMENT}: maxSurge is 0 with maxUnavailable 0: the rollout cannot start",
    ]
    objects, stable, _ = variant(rendered)
    dc.pod_spec(stable)["topologySpreadConstraints"][0]["matchLabelKeys"] = [
        "controller-revision-hash"
    ]
    assert lc.rollout_problems(stable, objects) == [
        f"{DEPLOYMENT}: matchLabelKeys controller-revision-hash is not a label of an Argo Rollout's pods"
    ]
    # Under the prod Rollout the Deployment controller's own hash is not on the pods either.
    dc.pod_spec(stable)["topologySpreadConstraints"][0]["matchLabelKeys"] = ["pod-template-hash"]
    assert lc.rollout_problems(stable, objects) == [
        f"{DEPLOYMENT}: matchLabelKeys pod-template-hash is not a label of an Argo Rollout's pods"
    ]
    objects, stable, _ = variant(rendered, "dev")
    dc.pod_spec(stable)["topologySpreadConstraints"][0]["matchLabelKeys"] = ["rollouts-pod-template-hash"]
    assert lc.rollout_problems(stable, objects) == [
        f"{DEPLOYMENT}: matchLabelKeys rollouts-pod-template-hash is not a label of a Deployment's pods"
    ]


# --------------------------------------------------------------------------- the migration Job


def test_migration_job_runs_mlpair_migrate_as_the_schema_owner(objects: list) -> None:
    assert lc.migrate_job_problems(objects) == []
    job = lc.migrate_job(objects)
    assert container(job)["args"] == ["migrate", "--serving-role", "mlpair_prediction"]
    for setting, (secret, key) in lc.OWNER_SECRETS.items():
        assert env_var(job, setting)["valueFrom"] == {"secretKeyRef": {"name": secret, "key": key}}
    # The serving pods' identity is not the Job's (InferenceService admits the former only).
    assert dc.pod_spec(job)["serviceAccountName"] != "prediction"


def test_migration_job_check_refuses_broken_jobs(rendered: dict) -> None:
    def problems_after(change) -> list[str]:
        objects, stable, job = variant(rendered)
        change(objects, stable, job)
        return lc.migrate_job_problems(objects)

    def no_role(objects, stable, job):
        container(job)["args"] = ["migrate"]

    assert problems_after(no_role) == [
        f"{JOB}: no --serving-role: the serving role would get no privileges"
    ]

    def serving_credentials(objects, stable, job):
        env_var(job, "PREDICTION_CRM_URL")["valueFrom"]["secretKeyRef"]["name"] = "prediction-crm"

    assert problems_after(serving_credentials) == [
        (
            f"{JOB}: PREDICTION_CRM_URL is key url of Secret prediction-crm, not key url "
            "of Secret prediction-crm-owner"
        ),
        f"{JOB}: references Secret prediction-crm, not only the owner's",
    ]

    def unbounded(objects, stable, job):
        del job["spec"]["activeDeadlineSeconds"], job["spec"]["ttlSecondsAfterFinished"]
        job["spec"]["backoffLimit"] = 100
        dc.pod_spec(job)["restartPolicy"] = "OnFailure"

    assert problems_after(unbounded) == [
        f"{JOB}: backoffLimit is 100, not within 0..5",
        f"{JOB}: activeDeadlineSeconds is None, not within 60..3600",
        f"{JOB}: ttlSecondsAfterFinished is None, not within 60..604800",
        f"{JOB}: restartPolicy is not Never (retries are new pods, counted)",
    ]

    def classic_sidecar(objects, stable, job):
        del job["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/nativeSidecar"]

    assert problems_after(classic_sidecar) == [
        (
            f"{JOB}: a classic Istio sidecar keeps the pod running after migrate exits: the Job never "
            "completes and the rollout never starts"
        )
    ]

    def no_sidecar(objects, stable, job):  # also sound: no proxy to keep running
        annotations = job["spec"]["template"]["metadata"]["annotations"]
        del annotations["sidecar.istio.io/nativeSidecar"]
        annotations["sidecar.istio.io/inject"] = "false"

    assert problems_after(no_sidecar) == []

    def elsewhere(objects, stable, job):
        container(job)["image"] = "registry.example.com/mlpair/prediction:0.0.9"
        dc.pod_spec(job)["nodeSelector"] = {"mlpair.io/node-pool": "gpu"}
        container(job)["securityContext"]["readOnlyRootFilesystem"] = False
        objects.remove(dc.by_name(objects, "NetworkPolicy", "prediction-migrate"))

    assert problems_after(elsewhere) == [
        f"{JOB} container migrate: securityContext.readOnlyRootFilesystem is not true",
        (
            f"{JOB}: image registry.example.com/mlpair/prediction:0.0.9 is not the prediction pods' "
            "{'registry.example.com/mlpair/prediction:0.1.0'}"
        ),
        f"{JOB}: not on the CPU pool",
        f"{JOB}: no NetworkPolicy lets it reach PostgreSQL (5432)",
    ]

    def looks_like_a_serving_pod(objects, stable, job):
        job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = "prediction"

    # Business traffic, the business callers' ingress and their authorization would reach it.
    assert problems_after(looks_like_a_serving_pod) == [
        f"{JOB}: its pods are selected by Service/prediction",
        f"{JOB}: its pods are selected by NetworkPolicy/prediction",
        f"{JOB}: its pods are selected by AuthorizationPolicy/prediction-callers",
        f"{JOB}: its pods are selected by AuthorizationPolicy/prediction-operators",
    ]


def test_migration_runs_before_the_rollout(objects: list) -> None:
    assert lc.migrate_order_problems(objects) == []
    first, rest = lc.phases(objects)
    assert sorted(dc.name_of(o) for o in first) == [
        JOB,
        "NetworkPolicy/prediction-migrate",
        "ServiceAccount/prediction-migrate",
    ]
    assert len(first) + len(rest) == len(objects)
    assert dc.workloads(rest) == dc.workloads(objects)


def test_order_check_refuses_a_job_that_would_run_with_or_after_the_rollout(rendered: dict) -> None:
    objects, stable, job = variant(rendered)
    del job["metadata"]["labels"][lc.PHASE_LABEL]
    stable["metadata"]["labels"][lc.PHASE_LABEL] = lc.PHASE_MIGRATE
    assert lc.migrate_order_problems(objects) == [
        f"{JOB}: not labelled app.kubernetes.io/component=migrate: applied with the rollout",
        f"{DEPLOYMENT} is applied with the migration, before it completes",
        f"{DEPLOYMENT} is not an Argo CD PreSync hook",
        f"{DEPLOYMENT} is not in a sync wave before {JOB}",
    ]
    objects, _, job = variant(rendered)
    account = dc.by_name(objects, "ServiceAccount", "prediction-migrate")
    del account["metadata"]["labels"][lc.PHASE_LABEL]
    policy = dc.by_name(objects, "NetworkPolicy", "prediction-migrate")
    del policy["metadata"]["annotations"][lc.SYNC_WAVE]
    job["metadata"]["annotations"][lc.HOOK_DELETE_POLICY] = "HookSucceeded"
    assert lc.migrate_order_problems(objects) == [
        f"{JOB} needs ServiceAccount/prediction-migrate, which is applied after it",
        f"NetworkPolicy/prediction-migrate is not in a sync wave before {JOB}",
        (
            f"{JOB}: no BeforeHookCreation delete policy: the next release's Job would not replace it "
            "(Jobs are immutable)"
        ),
    ]


def test_order_check_refuses_a_first_phase_that_leaves_the_job_without_dns_or_istiod(rendered: dict) -> None:
    # A first install applies the migration's objects alone, before mesh-baseline exists: the Job's
    # own policy must open DNS and istiod as well as PostgreSQL, or the Job never connects.
    objects, _, _ = variant(rendered)
    policy = dc.by_name(objects, "NetworkPolicy", "prediction-migrate")
    policy["spec"]["egress"] = [{"ports": [{"protocol": "TCP", "port": lc.POSTGRES_PORT}]}]
    assert lc.migrate_order_problems(objects) == [
        f"{JOB}: on a first install its phase alone does not let it reach DNS (UDP 53)",
        f"{JOB}: on a first install its phase alone does not let it reach DNS (TCP 53)",
        f"{JOB}: on a first install its phase alone does not let it reach istiod (TCP 15012)",
    ]
