"""The rendered pods start and serve: each overlay's schema migration Job, InferenceService and
every PredictionService track run here as real processes and servers from exactly the rendered
commands, settings, mounts and ConfigMaps (laid out under a local folder, see pods.py).

In the order a release runs them: a prediction pod started before the migration refuses to start
and names `mlpair migrate` (the service never migrates); the Job's command, with the schema
owner's URL where its Secrets would put it, creates the ledger and CRM schemas and grants the
serving role; then the pods, connected as that serving role, answer their probes' health names,
decide for every model family with the version their track names, and record every decision in
the one ledger they share. The first prediction pod decides while the CRM is unreachable and goes
away with its decisions undelivered (the canary track retired in prod, a replica scaled away in
dev); the next one returns those decisions for their request ids and its relay delivers them: the
CRM ends with every decision exactly once. The serving role can change no schema, and no pod
writes anywhere a read-only root filesystem would refuse.

Only what a laptop cannot have is replaced: addresses (127.0.0.1, free ports), the URLs the
Secrets would hold (a fresh database on the test PostgreSQL holding ledger and CRM, a serving role
of this test alone, the test Redis), no trace collector, and the GPU (ONNX Runtime falls back to
its CPU provider: ``execution_provider=cuda`` refuses to start without CUDA, so the test sets
``auto`` where no CUDA provider is installed), and the bucket: a moto S3 server started here
stands for it, at the overlay's own ``*_MODEL_SOURCE`` URI, holding credit-risk versions 1 and 2
and churn version 1 (trained here, published with `mlpair publish`'s code). Its connection reaches
the pods as the rendered ``secretKeyRef`` entries of Secret mlpair-model-source say: each variable a
pod references is given the value that Secret's key holds here, so a pod that lost a reference
cannot reach the bucket. Each pod downloads its versions into its own emptyDir cache and writes
nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import uuid
from pathlib import Path

import deploy_checks as dc
import pods
import pytest

pytest.importorskip("mlpair.prediction.server", reason="mlpair is not installed")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client import to_attributes
from tests.support import CREDIT_SCHEMA, POSTGRES_HOST, POSTGRES_PORT, require_service

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def release_repository(model_repository: Path, tmp_path_factory) -> Path:
    """credit-risk 1 and churn 1 (the session's models) and credit-risk 2 (another seed, the same
    split and features): every version the overlays mount."""
    from mlpair.training.pipeline import load_train_config, train_family

    root = tmp_path_factory.mktemp("release")
    for family in ("credit-risk", "churn"):
        shutil.copytree(model_repository / family / "1", root / family / "1")
    base = load_train_config(CREDIT_SCHEMA)
    train_family(
        CREDIT_SCHEMA,
        root,
        dataclasses.replace(base, seed=base.seed + 7),
        force=True,
        show_progress=False,
    )
    assert sorted(p.name for p in (root / "credit-risk").iterdir()) == ["1", "2"]
    return root


# The published versions: what InferenceService serves (INFERENCE_VERSION_POLICY=all) and what
# each prediction pod fetches (its deciding and shadow versions and each family's latest).
PUBLISHED = {("credit-risk", "1"), ("credit-risk", "2"), ("churn", "1")}


@pytest.fixture(scope="module")
def model_source_secret(release_repository: Path, rendered: dict, tmp_path_factory) -> dict[str, str]:
    """A moto S3 server holding the release at every overlay's model source; yields the keys the
    Secret mlpair-model-source holds for it."""
    import boto3

    from mlpair.sources.publish import publish
    from mlpair.sources.s3 import split_s3_uri
    from tests.support.stores import moto_s3, s3_env

    uris = {
        dc.model_source_of(workload, objects)
        for objects in rendered.values()
        for workload in dc.workloads(objects, "inference")
    }
    with moto_s3(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint, pytest.MonkeyPatch.context() as mp:
        env = s3_env(endpoint)
        for name, value in env.items():
            mp.setenv(name, value)
        for bucket in sorted({split_s3_uri(uri)[0] for uri in uris}):
            boto3.client("s3").create_bucket(Bucket=bucket)
        for uri in sorted(uris):
            for family, version in sorted(PUBLISHED):
                publish(release_repository / family / version, uri)
        yield {
            "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
            "AWS_REGION": env["AWS_DEFAULT_REGION"],
            "AWS_ENDPOINT_URL": endpoint,
        }


def secret_env(workload: dict, secret: dict[str, str]) -> dict[str, str]:
    """The variables a pod takes from Secret mlpair-model-source, with the values ``secret`` holds."""
    env = {}
    for variable in dc.pod_spec(workload)["containers"][0].get("env", ()):
        ref = (variable.get("valueFrom") or {}).get("secretKeyRef") or {}
        if ref.get("name") == dc.MODEL_SOURCE_SECRET and ref["key"] in secret:
            env[variable["name"]] = secret[ref["key"]]
    return env


def cached_versions(pod: pods.Pod) -> set[tuple[str, str]]:
    """(family, version) of every version in the pod's model cache (``<digest>/<family>/<version>``;
    not the staging folders, nor PredictionService's ``views`` of links into the cache)."""
    prefix = dc.PREFIX[dc.app_of(pod.workload)]
    cache = Path(pod.env[f"{prefix}_MODEL_CACHE_DIR"])
    return {
        (p.parent.name, p.name)
        for p in cache.glob("*/*/*")
        if p.is_dir() and not p.is_symlink() and len(p.parts[-3]) == 64
    }


@pytest.fixture
def redis_prefix():
    """A key prefix of this test alone; its keys are deleted afterwards."""
    require_service("Redis", "127.0.0.1", 6379)
    prefix = f"mlpair-test-deploy-{uuid.uuid4().hex[:8]}:"
    yield prefix
    import redis

    client = redis.Redis(host="127.0.0.1", port=6379)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


@dataclasses.dataclass(frozen=True)
class Databases:
    """One fresh database holding the ledger (schema prediction) and the CRM (as production may),
    reached as the schema owner and as a serving role of this test alone."""

    owner_url: str
    serving_url: str
    serving_role: str


@pytest.fixture
def databases():
    from sqlalchemy import make_url

    from tests.support.pair import postgres_admin, scratch_postgres

    require_service("PostgreSQL", POSTGRES_HOST, POSTGRES_PORT)
    role = f"mlpair_prediction_{uuid.uuid4().hex[:8]}"
    # LOGIN and nothing else: what it may do, the migration Job grants.
    postgres_admin(f'CREATE ROLE "{role}" LOGIN')
    try:
        with scratch_postgres(prefix="mlpair_test_deploy") as owner_url:
            serving_url = make_url(owner_url).set(username=role)
            yield Databases(owner_url, serving_url.render_as_string(hide_password=False), role)
    finally:
        postgres_admin(f'DROP ROLE IF EXISTS "{role}"')  # its database is gone by now


async def run_mlpair(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """`mlpair ARGS` as a container runs it: a process of its own, only the given environment."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mlpair.cli",
        *args,
        env={"PATH": os.environ.get("PATH", ""), **env},
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, output.decode()


async def run_migrate_job(job: dict, databases: Databases, cwd: Path) -> str:
    """The Job's container command, its owner Secrets standing for the owner's URL, granting the
    test's serving role instead of the Job's (roles are shared by every database of the server)."""
    container = dc.pod_spec(job)["containers"][0]
    args = list(container["args"])
    args[args.index("--serving-role") + 1] = databases.serving_role
    owner = {
        secret: databases.owner_url
        for secret in ("prediction-ledger-owner", "prediction-crm-owner")
    }
    env = {v["name"]: owner[v["valueFrom"]["secretKeyRef"]["name"]] for v in container["env"]}
    code, output = await run_mlpair(args, env, cwd)
    assert code == 0, output
    return output


def local_services(
    inference_target: str, databases: Databases, redis_prefix: str, ledger_url: str | None = None
) -> dict[str, str]:
    """A prediction pod's local replacements (module docstring): where InferenceService, the
    ledger (default: the test database, as the serving role), the CRM and Redis are."""
    return {
        "inference_target": inference_target,
        "ledger_url": ledger_url or databases.serving_url,
        "crm_url": databases.serving_url,
        "redis_url": "redis://127.0.0.1:6379/0",
        "redis_key_prefix": redis_prefix,
    }


def serving_env(pod: pods.Pod, **local: str) -> dict[str, str]:
    """The pod's environment with the local replacements of the module docstring."""
    prefix = dc.PREFIX[dc.app_of(pod.workload)] + "_"
    return {**pod.env, **{prefix + k.upper(): v for k, v in local.items()}}


def settings_for(cls, pod: pods.Pod, monkeypatch: pytest.MonkeyPatch, secret: dict[str, str] | None = None,
                 **local: str):
    """The service's settings class read from the pod's environment, as in the container, with
    the local replacements named in the module docstring (the model source's Secret: ``secret``)."""
    prefix = dc.PREFIX[dc.app_of(pod.workload)] + "_"
    for name in [n for n in os.environ if n.startswith((prefix, "AWS_"))]:
        monkeypatch.delenv(name)
    for name, value in secret_env(pod.workload, secret or {}).items():
        monkeypatch.setenv(name, value)
    for name, value in serving_env(pod, **local).items():
        monkeypatch.setenv(name, value)
    return cls()


async def health_of(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return reply.status


async def assert_probes_pass(workload: dict, target: str) -> None:
    container = dc.pod_spec(workload)["containers"][0]
    for probe in PROBES:
        service = container[probe]["grpc"].get("service", "")
        assert await health_of(target, service) == SERVING, (dc.name_of(workload), probe)


def _has_gpu() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@contextlib.asynccontextmanager
async def inference_pod(pod: pods.Pod, monkeypatch: pytest.MonkeyPatch, secret: dict[str, str]):
    from mlpair.inference.server import InferenceServer
    from mlpair.inference.settings import InferenceSettings

    settings = settings_for(
        InferenceSettings,
        pod,
        monkeypatch,
        secret,
        host="127.0.0.1",
        port="0",
        metrics_port="0",
        otlp_endpoint="",
        # no GPU here: execution_provider=cuda (the pods' setting) would refuse to start
        execution_provider="cuda" if _has_gpu() else "auto",
    )
    server = InferenceServer(settings)
    await server.start()
    try:
        await server.load()
        yield f"127.0.0.1:{server.port}", server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def prediction_pod(pod: pods.Pod, monkeypatch: pytest.MonkeyPatch, secret: dict[str, str], **local: str):
    from mlpair.prediction.server import start, stop
    from mlpair.prediction.settings import PredictionSettings

    settings = settings_for(
        PredictionSettings,
        pod,
        monkeypatch,
        secret,
        host="127.0.0.1",
        port="0",
        metrics_port="0",
        otlp_endpoint="",
        **local,
    )
    # As the container does: the schemas are the migration Job's, never the server's.
    server, port, health, predictor = await start(settings)
    try:
        yield f"127.0.0.1:{port}", predictor
    finally:
        await stop(server, health, predictor, 1.0)


@contextlib.asynccontextmanager
async def relay_pod(pod: pods.Pod, monkeypatch: pytest.MonkeyPatch, **local: str):
    """The rendered prediction-relay pod's `mlpair relay`, in this process, its probes passing."""
    from mlpair.prediction import relay_server
    from mlpair.prediction.settings import PredictionSettings

    settings = settings_for(
        PredictionSettings, pod, monkeypatch, host="127.0.0.1", relay_port="0", **local
    )
    server, port, health, recorder = await relay_server.start(settings)
    try:
        await assert_probes_pass(pod.workload, f"127.0.0.1:{port}")
        yield recorder
    finally:
        await relay_server.stop(server, health, recorder, 1.0)


def shadow_count(family: str, primary: str, shadow: str) -> float:
    labels = {"model": family, "primary_version": primary, "shadow_version": shadow}
    return sum(
        REGISTRY.get_sample_value("prediction_shadow_decisions_total", {**labels, "agreement": a})
        or 0.0
        for a in ("agree", "disagree")
    )


def deciding_versions(objects: list) -> set[tuple[str, str]]:
    """(family, version) of every version some prediction track decides with."""
    return {
        (family, version)
        for workload in dc.workloads(objects, "prediction")
        for family, versions in dc.json_setting(
            dc.settings_of(workload, objects), "PREDICTION_ENSEMBLES", {}
        ).items()
        for version in versions
    }


def adapter_series(release: set) -> dict[tuple[str, str, str, str, bool], float | None]:
    """This process's value of every series a shipped prometheus-adapter rule reads, per model
    version of the release: (rule's metric, series, family, version, read through rate()) ->
    value, None when absent."""
    (config_map,) = dc.load_file(dc.ADAPTER_DIR / "config-map.yaml")
    values = {}
    for rule in dc.adapter_config(config_map)["rules"]:
        series, name = dc.adapter_rule_metric(rule)
        for family, version in release:
            key = (name, series, family, version, "rate(" in rule["metricsQuery"])
            values[key] = REGISTRY.get_sample_value(series, {"model": family, "version": version})
    return values


async def decide(target: str, request_id: str, family: str, record) -> pb.PredictResponse:
    entity_id, attributes = record
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.PredictionServiceStub(channel).Predict(
            pb.PredictRequest(
                request_id=request_id,
                entity_id=entity_id,
                attributes=to_attributes(attributes),
                model_name=family,
            ),
            timeout=5,
        )


async def crm_and_ledger(databases: Databases, request_ids: list[str]) -> tuple[int, int, int]:
    """(CRM rows, distinct request ids among them, ledger rows not delivered) for the ids."""
    import asyncpg

    conn = await asyncpg.connect(databases.owner_url.replace("+asyncpg", ""))
    try:
        rows, distinct = await conn.fetchrow(
            "SELECT count(*), count(DISTINCT request_id) FROM decisions "
            "WHERE request_id = ANY($1::text[])",
            request_ids,
        )
        undelivered = await conn.fetchval(  # the outbox's, and any of a previous release
            "SELECT (SELECT count(*) FROM prediction.decision_ledger WHERE delivered_at IS NULL) "
            "+ (SELECT COALESCE(sum(n), 0) FROM prediction.decision_outbox)"
        )
    finally:
        await conn.close()
    return rows, distinct, undelivered


# Statements the service never needs: schema changes in either database, and deleting or
# rewriting decisions (the ledger's rows are only inserted, or a previous release's marked delivered,
# the CRM's only inserted).
NOT_THE_SERVICES_BUSINESS = (
    "CREATE TABLE prediction.scratch (i int)",
    "ALTER TABLE prediction.decision_ledger ADD COLUMN x int",
    "DELETE FROM prediction.decision_ledger",
    "DROP TABLE prediction.decision_outbox",
    "DROP TABLE decisions",
    "UPDATE decisions SET decision = 'APPROVE'",
    "CREATE TABLE public.scratch (i int)",
)


async def serving_role_refusals(databases: Databases) -> list[str]:
    """The statements of NOT_THE_SERVICES_BUSINESS the serving role is refused."""
    import asyncpg

    refused = []
    conn = await asyncpg.connect(databases.serving_url.replace("+asyncpg", ""))
    try:
        for statement in NOT_THE_SERVICES_BUSINESS:
            try:
                await conn.execute(statement)
            except asyncpg.InsufficientPrivilegeError:
                refused.append(statement)
    finally:
        await conn.close()
    return refused


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlay", dc.OVERLAYS)
async def test_rendered_pods_migrate_start_answer_their_probes_and_decide(
    rendered: dict,
    overlay: str,
    release_repository: Path,
    model_source_secret: dict[str, str],
    credit_holdout,
    churn_holdout,
    databases: Databases,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.support.pair import free_port

    objects = rendered[overlay]
    records = {
        "credit-risk": (credit_holdout.entity_ids[0], credit_holdout.records[0]),
        "churn": (churn_holdout.entity_ids[0], churn_holdout.records[0]),
    }
    tracks = sorted(dc.workloads(objects, "prediction"), key=dc.name_of)
    # prod: the canary track is retired, the stable one stays; dev: one replica of the only track
    # goes away, another takes over.
    leaving, *staying = tracks
    pods_in_order = [leaving, *(staying or [leaving])]
    (job,) = dc.jobs(objects)
    (inference,) = dc.workloads(objects, "inference")
    (relayer,) = dc.workloads(objects, dc.RELAY)
    inference_fs = pods.materialise(inference, objects, tmp_path / "inference", release_repository)
    monkeypatch.chdir(inference_fs.root)  # a relative path would land in the pod's root
    async with inference_pod(inference_fs, monkeypatch, model_source_secret) as (inference_target, server):
        await assert_probes_pass(inference, inference_target)
        release = PUBLISHED
        series_before = {key: value or 0.0 for key, value in adapter_series(release).items()}
        serving = {(f, v) for f, vs in server.engine.repository.serving().items() for v in vs}
        assert serving == release  # every published version, nothing else
        assert cached_versions(inference_fs) == release  # downloaded into the pod's own cache
        local = local_services(inference_target, databases, redis_prefix)

        # Before the Job: the pod refuses to start, and says what to run.
        early = pods.materialise(leaving, objects, tmp_path / "before-migrate", release_repository)
        env = serving_env(
            early, host="127.0.0.1", port="0", metrics_port="0", otlp_endpoint="", **local
        ) | secret_env(leaving, model_source_secret)
        code, output = await run_mlpair(
            dc.pod_spec(leaving)["containers"][0]["args"], env, early.root
        )
        assert code == 1 and "run `mlpair migrate`" in output, output

        report = await run_migrate_job(job, databases, tmp_path)
        assert f"serving role {databases.serving_role} granted" in report

        request_ids: dict[str, list[str]] = {}
        answers: dict[str, pb.PredictResponse] = {}
        for index, workload in enumerate(pods_in_order):
            name = f"{workload['metadata']['name']}-{index}"
            pod = pods.materialise(workload, objects, tmp_path / name, release_repository)
            monkeypatch.chdir(pod.root)
            settings = dc.settings_of(workload, objects)
            deciding = dc.json_setting(settings, "PREDICTION_ENSEMBLES", {})
            shadows = dc.json_setting(settings, "PREDICTION_SHADOWS", {})
            before = {f: shadow_count(f, deciding[f][0], v) for f, v in shadows.items()}
            # The first pod decides while the CRM is unreachable: only the ledger holds them.
            crm_down = f"postgresql+asyncpg://{databases.serving_role}@127.0.0.1:{free_port()}/crm"
            pod_local = {**local, "crm_url": crm_down} if index == 0 else local
            # The prediction pods only record (PREDICTION_RELAY_IN_PROCESS=false): the rendered
            # relay pod delivers, here once the CRM is back.
            relay = pods.materialise(relayer, objects, tmp_path / f"relay-{index}", release_repository)
            async with contextlib.AsyncExitStack() as stack:
                if index > 0:
                    await stack.enter_async_context(
                        relay_pod(relay, monkeypatch, ledger_url=local["ledger_url"], crm_url=local["crm_url"])
                    )
                    monkeypatch.chdir(pod.root)
                target, predictor = await stack.enter_async_context(
                    prediction_pod(pod, monkeypatch, model_source_secret, **pod_local)
                )
                assert predictor.recorder.relay is None
                await assert_probes_pass(workload, target)
                for family, record in records.items():
                    request_id = f"{redis_prefix}{name}-{family}"
                    reply = await decide(target, request_id, family, record)
                    # A real decision (never the fallback) by the version the track names.
                    assert not reply.fallback, (name, family, reply.degraded_reason)
                    assert [reply.model_version] == deciding[family], (name, family)
                    request_ids.setdefault(name, []).append(request_id)
                    answers[request_id] = reply
                if index > 0:
                    # The leaving pod's decisions, asked again here: the ones recorded there.
                    for request_id in request_ids[f"{leaving['metadata']['name']}-0"]:
                        family = "churn" if request_id.endswith("-churn") else "credit-risk"
                        again = await decide(target, request_id, family, records[family])
                        first = answers[request_id]
                        assert again.replayed and not first.replayed
                        assert (again.decision_id, again.decision, again.model_version) == (
                            first.decision_id,
                            first.decision,
                            first.model_version,
                        )
                await predictor.predictor.drain_background()
                if index > 0:
                    assert await predictor.recorder.wait_delivered(10)
            for family, version in shadows.items():
                assert shadow_count(family, deciding[family][0], version) == before[family] + 1
            assert pod.written_outside_writable_mounts() == [], name
            # Nothing mounted writable but the model cache, which holds the versions the track
            # names and each family's latest.
            assert pod.writable == [settings["PREDICTION_MODEL_CACHE_DIR"]], name
            assert cached_versions(pod) == PUBLISHED, name
            if index == 0:
                # Gone with its decisions undelivered: they wait in the shared ledger.
                assert await crm_and_ledger(databases, request_ids[name]) == (0, 0, len(records))
        # The series the inference HPA's adapter rules read, as the serving pod exports them: one
        # per version of the release, and those read through rate() (calls in flight: the
        # latency sum) moved by the calls to the versions that decide.
        for key, value in adapter_series(release).items():
            _, _, family, version, counted = key
            assert value is not None, key
            if counted and (family, version) in deciding_versions(objects):
                assert value > series_before[key], key
    everything = [request_id for ids in request_ids.values() for request_id in ids]
    assert await crm_and_ledger(databases, everything) == (len(everything), len(everything), 0)
    # The serving role may do what the service needs and nothing more.
    assert await serving_role_refusals(databases) == list(NOT_THE_SERVICES_BUSINESS)
    assert inference_fs.written_outside_writable_mounts() == []


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
async def test_a_prediction_pod_started_during_a_ledger_outage_waits_unready_and_is_not_restarted(
    rendered: dict,
    overlay: str,
    release_repository: Path,
    model_source_secret: dict[str, str],
    databases: Databases,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rollout, a scale-up or a node drain during a database failover starts pods whose shared
    # ledger does not answer. The probes that restart a pod (startup, liveness) must pass, and
    # only readiness fail: the pod takes no traffic, is not killed when the outage outlasts the
    # startup window (then held in CrashLoopBackOff after the ledger is back), and turns ready by
    # itself once the ledger answers.
    from sqlalchemy import make_url

    from tests.fault_support import eventually
    from tests.support.pair import TcpProxy, free_port

    objects = rendered[overlay]
    (job,) = dc.jobs(objects)
    await run_migrate_job(job, databases, tmp_path)
    workload = sorted(dc.workloads(objects, "prediction"), key=dc.name_of)[-1]
    container = dc.pod_spec(workload)["containers"][0]
    name = {probe: container[probe]["grpc"].get("service", "") for probe in PROBES}
    ledger = TcpProxy(POSTGRES_HOST, POSTGRES_PORT)  # not listening yet: the ledger is down
    ledger_url = make_url(databases.serving_url).set(host="127.0.0.1", port=ledger.port)
    pod = pods.materialise(workload, objects, tmp_path / "pod", release_repository)
    monkeypatch.chdir(pod.root)
    local = local_services(  # InferenceService down too: degraded, not unready
        f"127.0.0.1:{free_port()}", databases, redis_prefix, ledger_url.render_as_string(hide_password=False)
    )
    try:
        async with prediction_pod(pod, monkeypatch, model_source_secret, **local) as (target, _):
            assert await health_of(target, name["startupProbe"]) == SERVING
            assert await health_of(target, name["livenessProbe"]) == SERVING
            assert await health_of(target, name["readinessProbe"]) == NOT_SERVING
            await asyncio.sleep(2.5)  # several health checks later: still waiting, still alive
            assert await health_of(target, name["startupProbe"]) == SERVING
            assert await health_of(target, name["readinessProbe"]) == NOT_SERVING
            await ledger.restore()

            async def ready() -> bool:
                return await health_of(target, name["readinessProbe"]) == SERVING

            await eventually(ready, timeout_s=20)
            await assert_probes_pass(workload, target)
    finally:
        await ledger.close()
