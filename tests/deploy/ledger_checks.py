"""Offline checks of PredictionService's decision ledger in deploy/: stateless prediction pods, the
shared ledger and CRM Secrets, and the schema migration Job that runs before the rollout.

Like deploy_checks, each check returns a list of problems (empty when the render is right), so
the tests run it on the rendered overlays and on broken variants of them.

What the render must say (docs/deployment.md, "The decision ledger"):

* Every decision is committed to one ledger that all replicas of all tracks share, so no pod owns
  state: prediction pods are Deployments that mount nothing writable but the model cache, and read the ledger and CRM
  URLs from the serving Secrets (the same for every track), never from a literal or a ConfigMap.
* The serving process never migrates. A Job runs `mlpair migrate --serving-role ROLE` with the
  schema owner's URLs, from Secrets no serving pod references, before the Deployments roll: its
  objects form the first phase of deploy/k8s/apply.sh (label app.kubernetes.io/component=migrate)
  and are Argo CD PreSync hooks.
"""

from __future__ import annotations

import math
import re
from typing import Any

import deploy_checks as dc

Obj = dict[str, Any]

# setting -> (Secret, key). Serving URLs connect as the serving role; owner URLs as the schema owner.
SERVING_SECRETS = {
    "PREDICTION_LEDGER_URL": ("prediction-ledger", "url"),
    "PREDICTION_CRM_URL": ("prediction-crm", "url"),
}
OWNER_SECRETS = {
    "PREDICTION_LEDGER_URL": ("prediction-ledger-owner", "url"),
    "PREDICTION_CRM_URL": ("prediction-crm-owner", "url"),
}
MIGRATE_JOB = "prediction-migrate"
# deploy/k8s/apply.sh applies `PHASE_LABEL=PHASE_MIGRATE` first, then `PHASE_LABEL!=PHASE_MIGRATE`.
PHASE_LABEL = "app.kubernetes.io/component"
PHASE_MIGRATE = "migrate"
HOOK = "argocd.argoproj.io/hook"
HOOK_DELETE_POLICY = "argocd.argoproj.io/hook-delete-policy"
SYNC_WAVE = "argocd.argoproj.io/sync-wave"
# Volume kinds whose mounts Kubernetes always makes read-only.
READ_ONLY_VOLUMES = ("configMap", "secret", "projected", "downwardAPI")
POSTGRES_PORT = 5432
ISTIOD_PORT = 15012  # istiod: a sidecar's xDS configuration and workload certificates
# Labels the Deployment controller sets on its pods, usable in matchLabelKeys.
DEPLOYMENT_POD_LABELS = ("pod-template-hash",)
ROLLOUT_POD_LABELS = ("rollouts-pod-template-hash",)  # what Argo Rollouts sets on its pods instead


def secret_refs(owner: Obj) -> set[str]:
    """Names of every Secret a pod template references (env, envFrom, volumes, pull secrets)."""
    spec = dc.pod_spec(owner)
    found = {ref["name"] for ref in spec.get("imagePullSecrets", ())}
    for container in dc.containers(owner):
        for variable in container.get("env", ()):
            ref = (variable.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                found.add(ref["name"])
        for source in container.get("envFrom", ()):
            if "secretRef" in source:
                found.add(source["secretRef"]["name"])
    for volume in spec.get("volumes", ()):
        if "secret" in volume:
            found.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", ()):
            if "secret" in source:
                found.add(source["secret"]["name"])
    return found


def _env_problems(where: str, owner: Obj, objects: list[Obj], expected: dict) -> list[str]:
    """Each setting of `expected` comes from its Secret and key, and from nowhere else."""
    problems = []
    container = dc.pod_spec(owner)["containers"][0]
    env = {variable["name"]: variable for variable in container.get("env", ())}
    from_config_maps = set(dc.settings_of(owner, objects)) - {
        v["name"] for v in container.get("env", ()) if "value" in v
    }
    for setting, (secret, key) in expected.items():
        variable = env.get(setting)
        if setting in from_config_maps:
            problems.append(f"{where}: {setting} is in a ConfigMap, not from Secret {secret}")
        if variable is None:
            if setting not in from_config_maps:
                problems.append(
                    f"{where}: {setting} not set (the default is a SQLite file on the pod's "
                    "read-only root, of this pod alone)"
                )
            continue
        ref = (variable.get("valueFrom") or {}).get("secretKeyRef")
        if ref != {"name": secret, "key": key}:
            shown = (
                f"key {ref.get('key')} of Secret {ref.get('name')}"
                if ref
                else f"the value {variable.get('value')!r}"
            )
            problems.append(f"{where}: {setting} is {shown}, not key {key} of Secret {secret}")
    return problems


def ledger_problems(workload: Obj, objects: list[Obj]) -> list[str]:
    """Whether a prediction workload keeps its decisions only in the shared ledger.

    A pod that held a decision (or a backlog) on a volume of its own would strand it when it is
    scaled down, crashes for good or is retired with a canary track; the ledger every replica
    shares cannot. So: a Deployment (a StatefulSet exists to give pods state), no claim templates,
    nothing mounted writable but the model cache, the ledger and CRM URLs from the serving Secrets, no owner Secret,
    and no setting of the per-pod outbox of earlier releases.
    """
    where = dc.name_of(workload)
    problems: list[str] = []
    if workload["kind"] != "Deployment":
        problems.append(f"{where}: a {workload['kind']}, not a Deployment: no pod owns state")
    if workload["spec"].get("volumeClaimTemplates"):
        problems.append(f"{where}: volumeClaimTemplates give each pod a volume of its own")
    # The model cache is the one writable volume: copies of published versions, fetched again by
    # any pod, never a decision (deploy_checks.model_source_problems checks its shape).
    cache_dir = dc.settings_of(workload, objects).get("PREDICTION_MODEL_CACHE_DIR")
    for path, (mount, volume) in sorted(dc.mounts_by_path(workload).items()):
        kind = next(iter(set(volume or {}) - {"name"}), "nothing")
        if path == cache_dir and kind == "emptyDir":
            continue
        if kind not in READ_ONLY_VOLUMES and not mount.get("readOnly"):
            problems.append(
                f"{where}: {path} is a writable {kind}: whatever the pod wrote there would be "
                "stranded with it"
            )
    problems += _env_problems(where, workload, objects, SERVING_SECRETS)
    for secret in sorted(secret_refs(workload) & owner_secret_names()):
        problems.append(f"{where}: references the schema owner's Secret {secret}")
    for setting in sorted(dc.settings_of(workload, objects)):
        if setting.startswith("PREDICTION_OUTBOX_"):
            problems.append(f"{where}: {setting} is a setting of the per-pod outbox, gone")
    return problems


def owner_secret_names() -> set[str]:
    return {secret for secret, _ in OWNER_SECRETS.values()}


def _scaled(value: int | str, replicas: int, round_up: bool) -> int:
    """maxSurge / maxUnavailable at `replicas` pods: percentages round up for the surge and down
    for unavailability, as the Deployment controller does."""
    if isinstance(value, int):
        return value
    fraction = replicas * int(str(value).rstrip("%")) / 100
    return math.ceil(fraction) if round_up else math.floor(fraction)


def rollout_problems(workload: Obj, objects: list[Obj]) -> list[str]:
    """Whether a prediction Deployment rolls without serving from fewer pods than the HPA asks for.

    A new pod becomes Ready before an old one stops (maxUnavailable 0 at the HPA minimum, a surge
    of at least one pod), so during a rollout and one voluntary eviction that the PDB allows at
    the same time, minReplicas - maxUnavailable(PDB) pods still serve. Topology spread keys must
    be labels the pods' controller sets (pod-template-hash; rollouts-pod-template-hash under an
    Argo Rollout), or a rollout's new pods are spread as one group with the old ones.
    """
    where = dc.name_of(workload)
    strategy = workload["spec"].get("strategy") or {}
    if strategy.get("type", "RollingUpdate") != "RollingUpdate":
        return [f"{where}: strategy {strategy['type']} stops every pod before starting new ones"]
    hpa = dc.autoscaler_of(workload, objects)
    minimum = hpa["spec"]["minReplicas"]
    rolling = strategy.get("rollingUpdate") or {}
    problems = []
    unavailable = _scaled(rolling.get("maxUnavailable", "25%"), minimum, round_up=False)
    if unavailable != 0:
        problems.append(
            f"{where}: maxUnavailable is {unavailable} pod(s) at the HPA minimum ({minimum}): "
            "a rollout would serve from fewer pods than the HPA asked for"
        )
    if _scaled(rolling.get("maxSurge", "25%"), minimum, round_up=True) < 1:
        problems.append(f"{where}: maxSurge is 0 with maxUnavailable 0: the rollout cannot start")
    # Under an Argo Rollout (workloadRef) the pods are the Rollout's ReplicaSets', which carry its
    # revision hash, not the Deployment controller's.
    owner, labels = (
        ("an Argo Rollout's", ROLLOUT_POD_LABELS)
        if dc.rollout_of(workload, objects) is not None
        else ("a Deployment's", DEPLOYMENT_POD_LABELS)
    )
    for constraint in dc.pod_spec(workload).get("topologySpreadConstraints", ()):
        for key in constraint.get("matchLabelKeys", ()):
            if key not in labels:
                problems.append(f"{where}: matchLabelKeys {key} is not a label of {owner} pods")
    return problems


def migrate_job(objects: list[Obj]) -> Obj | None:
    """The Job that runs `mlpair migrate`, if the render has exactly one."""
    found = [
        job
        for job in dc.jobs(objects)
        if (dc.pod_spec(job)["containers"][0].get("args") or [None])[0] == "migrate"
    ]
    return found[0] if len(found) == 1 else None


def migrate_job_problems(objects: list[Obj]) -> list[str]:
    """Whether the migration Job runs this release's `mlpair migrate` safely and can complete.

    The pods' image (the migrations of the code that will serve), `--serving-role` naming a plain
    PostgreSQL role, the owner URLs from the owner Secrets and no other Secret, bounded retries
    and run time, cleanup, the CPU pool, the same pod hardening as the services, a sidecar that
    stops when migrate exits (native) or none, egress to PostgreSQL, and no serving selector
    (Service, PDB, policies) picking its pods.
    """
    job = migrate_job(objects)
    if job is None:
        return ["no single Job runs `mlpair migrate`"]
    where = dc.name_of(job)
    problems = dc.lint_pod(job)
    spec, pod = job["spec"], dc.pod_spec(job)
    container = pod["containers"][0]
    images = {dc.pod_spec(w)["containers"][0]["image"] for w in dc.workloads(objects, "prediction")}
    if images != {container["image"]}:
        problems.append(f"{where}: image {container['image']} is not the prediction pods' {images}")
    args = container.get("args") or []
    role = args[args.index("--serving-role") + 1] if "--serving-role" in args[:-1] else None
    if role is None:
        problems.append(f"{where}: no --serving-role: the serving role would get no privileges")
    elif not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", role):
        problems.append(f"{where}: serving role {role!r} is not a plain SQL identifier")
    problems += _env_problems(where, job, objects, OWNER_SECRETS)
    for secret in sorted(secret_refs(job) - owner_secret_names()):
        problems.append(f"{where}: references Secret {secret}, not only the owner's")
    for field, low, high in (
        ("backoffLimit", 0, 5),
        ("activeDeadlineSeconds", 60, 3600),
        ("ttlSecondsAfterFinished", 60, 7 * 86400),
    ):
        value = spec.get(field)
        if not isinstance(value, int) or not low <= value <= high:
            problems.append(f"{where}: {field} is {value!r}, not within {low}..{high}")
    if pod.get("restartPolicy") != "Never":
        problems.append(f"{where}: restartPolicy is not Never (retries are new pods, counted)")
    if pod.get("nodeSelector") != {"mlpair.io/node-pool": "cpu"}:
        problems.append(f"{where}: not on the CPU pool")
    annotations = job["spec"]["template"]["metadata"].get("annotations") or {}
    injected = annotations.get("sidecar.istio.io/inject", "true") != "false"
    if injected and annotations.get("sidecar.istio.io/nativeSidecar") != "true":
        problems.append(
            f"{where}: a classic Istio sidecar keeps the pod running after migrate exits: the Job "
            "never completes and the rollout never starts"
        )
    if POSTGRES_PORT not in egress_ports(objects, job):
        problems.append(f"{where}: no NetworkPolicy lets it reach PostgreSQL ({POSTGRES_PORT})")
    for obj in serving_selectors_of(objects, dc.pod_labels(job)):
        problems.append(f"{where}: its pods are selected by {dc.name_of(obj)}")
    return problems


def serving_selectors_of(objects: list[Obj], labels: dict) -> list[Obj]:
    """Objects that would treat pods with `labels` as serving pods: Services (traffic), PDBs,
    AuthorizationPolicies and NetworkPolicies that let callers in, DestinationRule subsets.
    Namespace-wide selectors (empty: default-deny, mesh-baseline, allow-nothing) are meant for
    every pod and do not count."""
    found = []
    for obj in objects:
        spec = obj.get("spec") or {}
        if obj["kind"] in ("Service", "PodDisruptionBudget", "AuthorizationPolicy"):
            selectors = [spec.get("selector")]
        elif obj["kind"] == "NetworkPolicy" and spec.get("ingress"):
            selectors = [spec.get("podSelector")]
        elif obj["kind"] == "DestinationRule":
            selectors = [subset.get("labels") for subset in spec.get("subsets", ())]
        else:
            continue
        if any(_names_labels(s) and dc.selector_matches(s, labels) for s in selectors):
            found.append(obj)
    return found


def _names_labels(selector: dict | None) -> bool:
    """Whether a selector (a plain map or matchLabels/matchExpressions) names any label."""
    selector = selector or {}
    if "matchLabels" in selector or "matchExpressions" in selector:
        return bool(selector.get("matchLabels") or selector.get("matchExpressions"))
    return bool(selector)


def egress_ports(objects: list[Obj], owner: Obj) -> set[int]:
    """TCP ports a pod may open connections to, from every NetworkPolicy selecting it."""
    ports = set()
    for policy in dc.of_kind(objects, "NetworkPolicy"):
        if dc.selector_matches(policy["spec"]["podSelector"], dc.pod_labels(owner)):
            for rule in policy["spec"].get("egress", ()):
                ports |= {p["port"] for p in rule.get("ports", ()) if p["protocol"] == "TCP"}
    return ports


def egress_allowed(objects: list[Obj], owner: Obj, protocol: str, port: int) -> bool:
    """Whether the NetworkPolicies among ``objects`` let ``owner``'s pods open ``protocol``/``port``
    somewhere: none selecting the pod for Egress (no restriction), or one rule listing that port
    (or no ports at all, which allows every port)."""
    selecting = [
        policy
        for policy in dc.of_kind(objects, "NetworkPolicy")
        if dc.selector_matches(policy["spec"]["podSelector"], dc.pod_labels(owner))
        and "Egress" in policy["spec"].get("policyTypes", ())
    ]
    if not selecting:
        return True
    return any(
        not rule.get("ports")
        or any(p.get("protocol", "TCP") == protocol and p.get("port") == port for p in rule["ports"])
        for policy in selecting
        for rule in policy["spec"].get("egress", ())
    )


def phases(objects: list[Obj]) -> tuple[list[Obj], list[Obj]]:
    """What deploy/k8s/apply.sh applies first (-l component=migrate) and then (component!=migrate)."""
    first = [
        o for o in objects if o["metadata"].get("labels", {}).get(PHASE_LABEL) == PHASE_MIGRATE
    ]
    return first, [o for o in objects if o not in first]


def migrate_order_problems(objects: list[Obj]) -> list[str]:
    """Whether the Job runs, to completion, before anything that rolls the pods is applied.

    The first phase must hold the Job and what it needs from the render (its ServiceAccount, the
    NetworkPolicy that opens PostgreSQL to it) and no workload. For Argo CD each of them is a
    PreSync hook, the Job's dependencies in an earlier wave, and the Job is deleted before it is
    recreated (BeforeHookCreation: Jobs are immutable).
    """
    job = migrate_job(objects)
    if job is None:
        return ["no single Job runs `mlpair migrate`"]
    where = dc.name_of(job)
    first, _ = phases(objects)
    problems = []
    if job not in first:
        problems.append(
            f"{where}: not labelled {PHASE_LABEL}={PHASE_MIGRATE}: applied with the rollout"
        )
    for workload in dc.workloads(first):
        problems.append(
            f"{dc.name_of(workload)} is applied with the migration, before it completes"
        )
    account = dc.pod_spec(job).get("serviceAccountName")
    needed = [o for o in dc.of_kind(objects, "ServiceAccount") if o["metadata"]["name"] == account]
    needed += [
        policy
        for policy in dc.of_kind(objects, "NetworkPolicy")
        if policy["spec"]["podSelector"]
        and dc.selector_matches(policy["spec"]["podSelector"], dc.pod_labels(job))
    ]
    for obj in needed:
        if obj not in first:
            problems.append(f"{where} needs {dc.name_of(obj)}, which is applied after it")
    # A first install has nothing else yet (no mesh-baseline): the first phase alone must let the
    # Job's pod resolve names, fetch its sidecar's configuration and reach the databases.
    annotations = job["spec"]["template"]["metadata"].get("annotations") or {}
    injected = annotations.get("sidecar.istio.io/inject", "true") != "false"
    reach = [("UDP", 53, "DNS"), ("TCP", 53, "DNS"), ("TCP", POSTGRES_PORT, "PostgreSQL")]
    reach += [("TCP", ISTIOD_PORT, "istiod")] if injected else []
    for protocol, port, what in reach:
        if not egress_allowed(first, job, protocol, port):
            problems.append(
                f"{where}: on a first install its phase alone does not let it reach {what} "
                f"({protocol} {port})"
            )
    wave = int(job["metadata"].get("annotations", {}).get(SYNC_WAVE, "0"))
    for obj in first:
        annotations = obj["metadata"].get("annotations") or {}
        if annotations.get(HOOK) != "PreSync":
            problems.append(f"{dc.name_of(obj)} is not an Argo CD PreSync hook")
        if obj is not job and int(annotations.get(SYNC_WAVE, "0")) >= wave:
            problems.append(f"{dc.name_of(obj)} is not in a sync wave before {where}")
    policies = (job["metadata"].get("annotations") or {}).get(HOOK_DELETE_POLICY, "")
    if "BeforeHookCreation" not in policies.split(","):
        problems.append(
            f"{where}: no BeforeHookCreation delete policy: the next release's Job would not "
            "replace it (Jobs are immutable)"
        )
    return problems
