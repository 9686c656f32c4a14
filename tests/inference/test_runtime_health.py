"""Health after start (issue 35, item 1): a model version whose runtime starts failing after start-up
goes not ready within 5 s of the first failure, is refused UNAVAILABLE MODEL_UNHEALTHY rather than
run, and is ready again within 5 s of the fault clearing; a silently wrong model is caught by the
known-answer self-test only; a sticky CUDA error fails liveness for good.

Real InferenceService processes (``tests/fault_inference.py``: the real runtime, failing as a fault
file says) under a steady sequential Infer load on 127.0.0.1; the classifier and the known-answer
tolerance are unit-tested on the real ONNX runtime.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.inference.model_health import (
    DEVICE_LOST,
    OUT_OF_MEMORY,
    RUNTIME_ERROR,
    KnownAnswer,
    classify_runtime_failure,
)
from mlpair.rpc import error_info
from tests.fault_inference import OutOfMemoryError
from tests.fault_support import faulty_inference, free_port, health_of, set_fault

MODEL = "credit-risk"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
TARGET_S = 5.0  # the targets: not ready within 5 s of the first failure, ready within 5 s of the clearing
UNHEALTHY_AFTER = 3  # the default unhealthy_after_failures


# -- the classifier and the known answer -------------------------------------------------------------


def test_classifier_names_out_of_memory_sticky_cuda_errors_and_the_rest():
    torch = pytest.importorskip("torch")
    assert (
        classify_runtime_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        == OUT_OF_MEMORY
    )
    assert (
        classify_runtime_failure(OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")) == OUT_OF_MEMORY
    )
    assert classify_runtime_failure(MemoryError()) == OUT_OF_MEMORY
    # ONNX Runtime's arena and CUDA provider words
    assert (
        classify_runtime_failure(
            RuntimeError(
                "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested buffer of size 8388608"
            )
        )
        == OUT_OF_MEMORY
    )
    for sticky in (
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered",
        "CUDA error: unspecified launch failure",
        "CUDA error: misaligned address",
        "CUDA failure 700: an illegal memory access was encountered ; GPU=0 ; hostname=x ; expr=cudaMemcpy",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA error: uncorrectable ECC error encountered",
    ):
        assert classify_runtime_failure(RuntimeError(sticky)) == DEVICE_LOST, sticky
    assert (
        classify_runtime_failure(RuntimeError("CUDA error: too many resources requested for launch")) == RUNTIME_ERROR
    )
    assert classify_runtime_failure(ValueError("shape mismatch")) == RUNTIME_ERROR


def test_known_answer_matches_its_own_runtime_and_refuses_a_shift_beyond_the_stated_tolerance(credit_entry):
    from mlpair.inference.runtimes.onnx import OnnxRuntime

    runtime = OnnxRuntime(credit_entry.model_path, provider="cpu")
    known = KnownAnswer.record(runtime.run, credit_entry.manifest.n_features, 128, 1e-4, 1e-3)
    assert known.features.shape == (8, credit_entry.manifest.n_features) and known.features.dtype == np.float32
    assert known.atol >= 1e-4 and known.rtol == 1e-3
    assert known.mismatch(runtime.run(known.features)) is None
    inside = np.vstack([np.zeros((100, known.features.shape[1]), np.float32), known.features])
    assert known.mismatch(runtime.run(inside)[-8:]) is None  # batched with others: same answer
    bound = known.atol + known.rtol * np.abs(known.logits)
    assert known.mismatch(known.logits + 0.5 * bound) is None
    assert "differ from the warm-up's by up to" in known.mismatch(known.logits + 2 * bound)
    assert "differ" in known.mismatch(known.logits + np.float32(1.0))
    assert "shape" in known.mismatch(known.logits[:4])


async def test_a_success_ends_the_failure_streak_and_only_a_streak_turns_the_version(credit_entry, holdout_x, tmp_path):
    """The tracker on a real batcher and the real ONNX runtime behind a fault file (no process)."""
    from mlpair.inference.batcher import DynamicBatcher
    from mlpair.inference.errors import ModelFailure, ModelUnhealthy
    from mlpair.inference.model_health import WRONG_OUTPUT, VersionHealth
    from mlpair.inference.runtimes.onnx import OnnxRuntime
    from mlpair.inference.settings import InferenceSettings
    from tests.fault_inference import FaultFile, FaultyRuntime

    fault = tmp_path / "fault"
    runtime = FaultyRuntime(OnnxRuntime(credit_entry.model_path, provider="cpu"), FaultFile(str(fault)), True)
    shorten = {"on": False}

    def run(x):  # a runtime that may also answer one row short
        logits = runtime.run(x)
        return logits[:-1] if shorten["on"] else logits

    settings = InferenceSettings(model_repository=tmp_path, metrics_port=0)
    known = KnownAnswer.record(run, credit_entry.manifest.n_features, 16, 1e-4, 1e-3)
    changes, lost = [], []
    health = VersionHealth(MODEL, "tracker", settings, known, lambda h: changes.append(h.healthy), lost.append)
    batcher = DynamicBatcher(
        run,
        model=MODEL,
        version="tracker",
        max_batch_size=16,
        max_queue_delay_ms=0,
        preferred_batch_sizes=[],
        max_queue_rows=64,
        inline=True,
        health=health,
    )
    batcher.start()
    x = np.ascontiguousarray(holdout_x[:2], dtype=np.float32)

    async def fails(n: int) -> None:
        for _ in range(n):
            with pytest.raises(ModelFailure):
                await batcher.submit(x, None)

    try:
        set_fault(fault, "error")
        await fails(2)
        set_fault(fault, "")
        await batcher.submit(x, None)
        assert health.failures == 0 and health.healthy
        set_fault(fault, "error")
        await fails(2)
        assert health.healthy and changes == []  # 2 + 2 with a success between: no streak of 3
        await fails(1)
        assert not health.healthy and changes == [False] and health.cause == RUNTIME_ERROR
        with pytest.raises(ModelUnhealthy):  # not run while unhealthy
            await batcher.submit(x, None)
        assert health.failures == 3
        assert await health.self_test(batcher) is False and health.failures == 4
        set_fault(fault, "")
        assert await health.self_test(batcher) is True and health.healthy and changes == [False, True]
        shorten["on"] = True
        await fails(3)
        assert not health.healthy and health.cause == WRONG_OUTPUT
        shorten["on"] = False
        assert await health.self_test(batcher) is True and health.healthy
        set_fault(fault, "device_lost")
        await fails(1)  # a sticky error: out at once, and the device reported lost
        assert not health.healthy and health.cause == DEVICE_LOST and len(lost) == 1
        assert "illegal memory access" in lost[0]
    finally:
        await health.close()
        await batcher.close()


# -- real processes --------------------------------------------------------------------------------------


@dataclass
class Load:
    """Sequential Infer calls (one in flight, so each batch holds one request) and their outcomes."""

    address: str
    x: np.ndarray
    metadata: tuple
    outcomes: list[tuple[float, str]] = field(default_factory=list)  # (monotonic, "OK" or "CODE/REASON")
    _stop: bool = False

    async def run(self) -> None:
        request = pb.InferRequest(
            model_name=MODEL,
            inputs=pb.Tensor(data_type=pb.DATA_TYPE_FP32, shape=self.x.shape, content=self.x.tobytes()),
        )
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            while not self._stop:
                try:
                    await stub.Infer(request, metadata=self.metadata, timeout=5)
                    outcome = "OK"
                except grpc.aio.AioRpcError as err:
                    info = error_info(err)
                    outcome = f"{err.code().name}/{info.reason if info else ''}"
                self.outcomes.append((time.monotonic(), outcome))

    def since(self, t: float) -> list[tuple[float, str]]:
        return [o for o in self.outcomes if o[0] >= t]


async def _ready(address: str) -> dict:
    """Every readiness and liveness signal at once."""
    async with grpc.aio.insecure_channel(address) as channel:
        oip_stub = oip_grpc.GRPCInferenceServiceStub(channel)
        model = (await oip_stub.ModelReady(oip.ModelReadyRequest(name=MODEL), timeout=2)).ready
        server = (await oip_stub.ServerReady(oip.ServerReadyRequest(), timeout=2)).ready
        live = (await oip_stub.ServerLive(oip.ServerLiveRequest(), timeout=2)).live
    return {
        "overall": await health_of(address, ""),
        "model": await health_of(address, MODEL),
        "liveness": await health_of(address, "liveness"),
        "oip_model": model,
        "oip_server": server,
        "oip_live": live,
    }


async def _until(address: str, check, timeout_s: float) -> tuple[float, dict]:
    """Polls every 50 ms until ``check(signals)``; returns (monotonic time seen, signals)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        signals = await _ready(address)
        if check(signals):
            return time.monotonic(), signals
        await asyncio.sleep(0.05)
    pytest.fail(f"not reached within {timeout_s} s: {await _ready(address)}")


def _not_ready(s: dict) -> bool:
    return s["overall"] == NOT_SERVING and s["model"] == NOT_SERVING and not s["oip_model"] and not s["oip_server"]


def _all_ready(s: dict) -> bool:
    return s["overall"] == SERVING and s["model"] == SERVING and s["oip_model"] and s["oip_server"]


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _failures(port: int, cause: str) -> float:
    return _metrics(port)[("inference_runtime_failures_total", (("cause", cause), ("model", MODEL), ("version", "1")))]


def _unavailable(port: int) -> float:
    """Infer calls answered UNAVAILABLE, under the model's name, every version (\"\" = refused before one ran)."""
    return sum(
        v
        for (name, labels), v in _metrics(port).items()
        if name == "inference_requests_total"
        and dict(labels).get("model") == MODEL
        and dict(labels).get("code") == "UNAVAILABLE"
    )


def _self_tests(port: int, result: str) -> float:
    return _metrics(port)[("inference_self_test_total", (("model", MODEL), ("result", result), ("version", "1")))]


@pytest.fixture(scope="module")
def processes(model_repository, tmp_path_factory):
    """Two faulty InferenceService processes, started together: ``quiet`` self-tests every 300 s while
    healthy (so every failing batch under load is a traffic batch, counted exactly; its device is
    lost last), ``watchful`` every second (the self-test alone must catch a wrong model)."""
    workdir = tmp_path_factory.mktemp("runtime-health")
    made = {}
    for name, interval in (("quiet", "300"), ("watchful", "1")):
        port = free_port()
        service = faulty_inference(
            workdir,
            model_repository,
            workdir / f"{name}.fault",
            INFERENCE_METRICS_PORT=str(port),
            INFERENCE_SELF_TEST_INTERVAL_S=interval,
        )
        made[name] = (service, port, workdir / f"{name}.fault")
    try:
        with ThreadPoolExecutor(len(made)) as pool:  # both start at once; each waits for its SERVING
            list(pool.map(lambda m: m[0].start(60), made.values()))
        yield made
    finally:
        for service, _, _ in made.values():
            service.kill()


@pytest.fixture
async def load_on(processes, holdout_x, good_metadata):
    loads: list[tuple[Load, asyncio.Task]] = []

    def start(name: str) -> Load:
        service, _, _ = processes[name]
        load = Load(service.address, np.ascontiguousarray(holdout_x[:4], dtype=np.float32), good_metadata)
        loads.append((load, asyncio.create_task(load.run())))
        return load

    yield start
    for load, task in loads:
        load._stop = True
        await task


async def _fault_under_load(processes, load_on, name: str, fault: str, cause: str) -> dict:
    """Switches ``fault`` on under load, waits for not ready, clears it, waits for ready; returns the
    measured times (s) and counts."""
    service, port, fault_file = processes[name]
    failures_before, fails_before = _failures(port, cause), _self_tests(port, "fail")
    passes_before, unavailable_before = _self_tests(port, "pass"), _unavailable(port)
    load = load_on(name)
    await asyncio.sleep(0.3)
    assert load.outcomes and all(o == "OK" for _, o in load.outcomes), load.outcomes[-3:]
    switched = time.monotonic()
    set_fault(fault_file, fault)
    not_ready_at, signals = await _until(service.address, _not_ready, 10)
    assert signals["liveness"] == SERVING and signals["oip_live"]  # recoverable: liveness untouched
    await asyncio.sleep(0.5)  # requests meanwhile: refused, not run
    cleared = time.monotonic()
    set_fault(fault_file, "")
    ready_at, _ = await _until(service.address, _all_ready, 10)
    await asyncio.sleep(0.3)
    during = [o for t, o in load.since(switched) if t < cleared]
    first_failure = next(t for t, o in load.since(switched) if o != "OK")
    failed = [o for o in during if o == "INTERNAL/MODEL_FAILURE"]
    assert load.since(ready_at + 0.05) and all(o == "OK" for _, o in load.since(ready_at + 0.05))
    return {
        "not_ready_s": not_ready_at - first_failure,
        "ready_s": ready_at - cleared,
        "failed": len(failed),
        "refused": sum(o == "UNAVAILABLE/MODEL_UNHEALTHY" for o in during),
        "other": sorted(
            {o for o in during if o not in ("OK", "INTERNAL/MODEL_FAILURE", "UNAVAILABLE/MODEL_UNHEALTHY")}
        ),
        "counted": _failures(port, cause) - failures_before,
        "self_test_fails": _self_tests(port, "fail") - fails_before,
        "self_test_passes": _self_tests(port, "pass") - passes_before,
        "refused_in_all": sum(o == "UNAVAILABLE/MODEL_UNHEALTHY" for _, o in load.since(switched)),
        "unavailable_counted": _unavailable(port) - unavailable_before,
    }


@pytest.mark.parametrize(("fault", "cause"), [("error", RUNTIME_ERROR), ("oom", OUT_OF_MEMORY)])
async def test_failing_runtime_is_not_ready_within_5_s_refused_meanwhile_and_ready_within_5_s_of_the_fix(
    processes, load_on, fault, cause, capsys
):
    seen = await _fault_under_load(processes, load_on, "quiet", fault, cause)
    with capsys.disabled():
        print(
            f"\n{fault}: not ready {seen['not_ready_s']:.2f} s after the first failure, ready "
            f"{seen['ready_s']:.2f} s after the fault cleared; {seen}"
        )
    assert seen["not_ready_s"] < TARGET_S and seen["ready_s"] < TARGET_S
    # one request per batch: exactly unhealthy_after_failures answered MODEL_FAILURE, then refusals
    assert seen["failed"] == UNHEALTHY_AFTER and seen["refused"] > 0 and seen["other"] == []
    # every failed batch counted by its cause: the traffic's and each failed self-test's (run alone)
    assert seen["counted"] == UNHEALTHY_AFTER + seen["self_test_fails"] and seen["self_test_fails"] >= 1
    # each refusal counted under the model's name (UNAVAILABLE), none lost to "unknown"
    assert seen["unavailable_counted"] == seen["refused_in_all"]
    assert seen["self_test_passes"] == 1  # the one that brought it back (no periodic one within 300 s)


async def test_wrong_logits_are_caught_by_the_self_test_alone_and_recover(processes, load_on, capsys):
    service, port, fault_file = processes["watchful"]
    wrong_before, fails_before = _failures(port, "wrong_output"), _self_tests(port, "fail")
    load = load_on("watchful")
    await asyncio.sleep(0.3)
    switched = time.monotonic()
    set_fault(fault_file, "wrong")
    not_ready_at, signals = await _until(service.address, _not_ready, 10)
    assert signals["liveness"] == SERVING
    await asyncio.sleep(0.3)
    cleared = time.monotonic()
    set_fault(fault_file, "")
    ready_at, _ = await _until(service.address, _all_ready, 10)
    during = [o for t, o in load.since(switched) if t < cleared]
    with capsys.disabled():
        print(
            f"\nwrong: not ready {not_ready_at - switched:.2f} s after the switch (self-test every 1 s), ready "
            f"{ready_at - cleared:.2f} s after the fault cleared"
        )
    # no request failed: wrong numbers raise nothing; once the self-test saw them, requests are refused
    assert set(during) <= {"OK", "UNAVAILABLE/MODEL_UNHEALTHY"} and "UNAVAILABLE/MODEL_UNHEALTHY" in during
    assert not_ready_at - switched < 1.0 + 2.0  # within the self-test interval (plus polling and a busy machine)
    assert ready_at - cleared < TARGET_S
    fails = _self_tests(port, "fail") - fails_before
    assert fails >= 1 and _failures(port, "wrong_output") - wrong_before == fails
    assert _failures(port, RUNTIME_ERROR) == 0


async def test_sticky_cuda_error_fails_liveness_for_good(processes, load_on):
    service, port, fault_file = processes["quiet"]
    load = load_on("quiet")
    await asyncio.sleep(0.3)
    switched = time.monotonic()
    set_fault(fault_file, "device_lost")
    lost_at, _ = await _until(service.address, lambda s: s["liveness"] == NOT_SERVING, 10)
    signals = await _ready(service.address)  # read after the change, every signal (one poll reads them in turn)
    assert not signals["oip_live"] and _not_ready(signals)
    first_failure = next(t for t, o in load.since(switched) if o != "OK")
    assert lost_at - first_failure < TARGET_S
    # the first failing batch takes the version out at once: one MODEL_FAILURE, then refusals
    assert [o for _, o in load.since(switched)].count("INTERNAL/MODEL_FAILURE") == 1
    set_fault(fault_file, "")
    await asyncio.sleep(2.5)  # self-tests pass again on the (simulated) device: the process stays dead
    signals = await _ready(service.address)
    assert signals["liveness"] == NOT_SERVING and not signals["oip_live"]
    assert signals["overall"] == NOT_SERVING and not signals["oip_server"]
    assert _failures(port, DEVICE_LOST) >= 1
    assert service.alive()  # the kubelet restarts it, not the process itself
