"""GPU signals (mlpair.inference.gpu_signals): the no-GPU path of a real server on this machine, and
the sampler's logic against NVML stood in for by a small object with pynvml's surface (pynvml's own
constants and error classes; the device calls answer what each test sets) and torch's allocator
figures, driving a real InferenceServer's readiness and liveness."""

from __future__ import annotations

import asyncio
import logging
import os
from types import SimpleNamespace

import pynvml
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY, generate_latest

from mlpair.inference import gpu_signals, metrics
from tests.inference.helpers import channel_to, make_settings, running

GIB = 2**30
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GPU_SERIES = [m for m in vars(metrics).values() if getattr(m, "_name", "").startswith("inference_gpu_")]


@pytest.fixture(autouse=True)
def clean_gpu_series():
    """The registry is the process's: each test starts and ends without GPU series."""

    def clear():
        for metric in GPU_SERIES:
            if metric._labelnames:
                metric.clear()

    clear()
    yield
    clear()


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def gpu_samples() -> list[str]:
    return [
        line
        for line in generate_latest(REGISTRY).decode().splitlines()
        if line.startswith("inference_gpu_") and not line.startswith("inference_gpu_xid_errors_created")
    ]


class FakeNvml:
    """pynvml's surface over devices described by dicts: a key missing from a device's dict makes its
    call raise NVMLError_NotSupported, as the driver does for a field it does not report."""

    def __init__(self, devices: list[dict], *, init_error: Exception | None = None) -> None:
        self.devices, self.init_error = devices, init_error
        self.events: list[SimpleNamespace] = []
        self.shutdowns = 0

    def __getattr__(self, name: str):  # constants and error classes: pynvml's own
        return getattr(pynvml, name)

    def _field(self, handle: int, key: str):
        device = self.devices[handle]
        if device.get("lost"):
            raise pynvml.NVMLError_GpuIsLost()
        if key not in device:
            raise pynvml.NVMLError_NotSupported()
        return device[key]

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetIndex(self, handle):
        return handle

    def nvmlDeviceGetUtilizationRates(self, h):
        gpu, memory = self._field(h, "utilization")
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetMemoryInfo(self, h):
        used, total = self._field(h, "memory")
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self._field(h, "processes")]

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._field(h, "temperature")

    def nvmlDeviceGetPowerUsage(self, h):
        return self._field(h, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._field(h, "power_limit_mw")

    def nvmlDeviceGetClockInfo(self, h, clock):
        assert clock == pynvml.NVML_CLOCK_SM
        return self._field(h, "sm_mhz")

    def nvmlDeviceGetSupportedClocksEventReasons(self, h):
        return self._field(h, "supported_reasons")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._field(h, "reasons")

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter):
        assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return self._field(h, "ecc_uncorrected")

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceRegisterEvents(self, h, types, events):
        assert types == pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        assert timeout_ms == 0  # never waits: the sampler's thread only drains what is there
        if not self.events:
            raise pynvml.NVMLError_Timeout()
        return self.events.pop(0)

    def nvmlEventSetFree(self, events):
        pass


def full_device() -> dict:
    return dict(
        utilization=(87, 41),
        memory=(30 * GIB, 80 * GIB),
        processes=[(os.getpid(), 3 * GIB), (1, 20 * GIB)],
        temperature=71,
        power_mw=250_000,
        power_limit_mw=350_000,
        sm_mhz=1980,
        supported_reasons=pynvml.nvmlClocksEventReasonAll,
        reasons=pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        ecc_uncorrected=0,
    )


class FakeTorch:
    """torch's allocator figures as the torch runtime on CUDA would report them (bytes per device)."""

    def __init__(self, reserved: int, allocated: int) -> None:
        self.reserved, self.allocated = reserved, allocated
        self.cuda = SimpleNamespace(
            is_initialized=lambda: True,
            device_count=lambda: 1,
            memory_reserved=lambda i: self.reserved,
            memory_allocated=lambda i: self.allocated,
        )


async def overall_health(server) -> int:
    async with channel_to(server) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return reply.status


# -- no GPU: this machine, the real NVML bindings ------------------------------------------------------------


async def test_without_a_gpu_the_server_says_so_once_and_samples_nothing(model_repository, caplog):
    caplog.set_level(logging.INFO, logger="mlpair.inference.gpu_signals")
    async with running(make_settings(model_repository, models=["credit-risk"])) as server:
        assert server.gpu is None
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "gpu-signals"]
        lines = [r.getMessage() for r in caplog.records if r.name == "mlpair.inference.gpu_signals"]
        assert len(lines) == 1, lines
        # pynvml is installed; without a driver NVML itself says why
        assert lines[0].startswith("no NVIDIA GPU visible (NVML: ") and "inference_gpu_* not exported" in lines[0]
        assert gpu_samples() == ["inference_gpu_present 0.0"]


async def test_nvml_without_devices_or_bindings_counts_as_no_gpu(caplog):
    caplog.set_level(logging.INFO, logger="mlpair.inference.gpu_signals")
    settings = make_settings(".")
    assert await gpu_signals.start_gpu_signals(None, settings, nvml=FakeNvml([])) is None
    assert value("inference_gpu_present") == 0
    assert caplog.records[-1].getMessage() == "no NVIDIA GPU visible (no device): inference_gpu_* not exported"
    broken = FakeNvml([full_device()], init_error=pynvml.NVMLError_DriverNotLoaded())
    assert await gpu_signals.start_gpu_signals(None, settings, nvml=broken) is None
    assert "NVML: Driver Not Loaded" in caplog.records[-1].getMessage()


def test_cuda_visible_devices_picks_and_relabels_the_devices(monkeypatch):
    nvml = FakeNvml([full_device(), full_device(), full_device()])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [(d.label, d.handle) for d in gpu_signals._visible_devices(nvml)] == [("0", 2), ("1", 0)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "leaves none" in gpu_signals._visible_devices(nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [d.label for d in gpu_signals._visible_devices(nvml)] == ["0", "1", "2"]


# -- the sampler against NVML's surface ---------------------------------------------------------------------


async def test_sample_exports_what_nvml_reports_and_leaves_out_what_it_does_not(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    partial = {  # a device whose driver reports utilisation, memory and two throttle reasons only
        "utilization": (5, 1),
        "memory": (1 * GIB, 16 * GIB),
        "supported_reasons": pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonSwPowerCap,
        "reasons": pynvml.nvmlClocksEventReasonGpuIdle,
    }
    nvml = FakeNvml([full_device(), partial])
    signals = await gpu_signals.start_gpu_signals(
        None, make_settings(".", gpu_sample_interval_s=0), nvml=nvml, torch_module=lambda: None
    )
    assert signals is not None and signals._task is None  # interval 0: nothing sampled on a timer
    signals.sample()
    assert value("inference_gpu_present") == 1
    assert value("inference_gpu_utilization_ratio", device="0") == 0.87
    assert value("inference_gpu_memory_utilization_ratio", device="0") == 0.41
    assert value("inference_gpu_memory_used_bytes", device="0") == 30 * GIB
    assert value("inference_gpu_memory_total_bytes", device="0") == 80 * GIB
    assert value("inference_gpu_process_memory_bytes", device="0") == 3 * GIB  # our PID only
    assert value("inference_gpu_temperature_celsius", device="0") == 71
    assert value("inference_gpu_power_watts", device="0") == 250
    assert value("inference_gpu_power_limit_watts", device="0") == 350
    assert value("inference_gpu_sm_clock_hertz", device="0") == 1.98e9
    assert value("inference_gpu_ecc_uncorrected_errors", device="0") == 0  # reported: a real zero
    throttled = {r: value("inference_gpu_throttled", device="0", reason=r) for r in gpu_signals.THROTTLE_REASONS}
    assert {r for r, v in throttled.items() if v == 1} == {"sw_power_cap", "hw_thermal_slowdown"}
    assert all(v == 0 for r, v in throttled.items() if r not in ("sw_power_cap", "hw_thermal_slowdown"))
    # device 1: the fields its driver does not report are absent, not zero
    device1 = sorted(line.split(" ")[0] for line in gpu_samples() if 'device="1"' in line)
    assert device1 == [
        'inference_gpu_memory_total_bytes{device="1"}',
        'inference_gpu_memory_used_bytes{device="1"}',
        'inference_gpu_memory_utilization_ratio{device="1"}',
        'inference_gpu_throttled{device="1",reason="gpu_idle"}',
        'inference_gpu_throttled{device="1",reason="sw_power_cap"}',
        'inference_gpu_utilization_ratio{device="1"}',
    ]
    assert value("inference_gpu_throttled", device="1", reason="gpu_idle") == 1
    # no torch on CUDA: no allocator series
    assert not [line for line in gpu_samples() if "torch" in line or "ghost_memory_bytes" in line]
    # a field that stops being reported disappears from the export
    del nvml.devices[0]["temperature"]
    signals.sample()
    assert value("inference_gpu_temperature_celsius", device="0") is None
    await signals.stop()
    assert nvml.shutdowns == 1


async def test_ghost_memory_over_the_setting_takes_the_server_out_and_back(model_repository, caplog):
    settings = make_settings(model_repository, models=["credit-risk"], gpu_ghost_memory_max_bytes=4 * GIB)
    torch = FakeTorch(reserved=6 * GIB, allocated=1 * GIB)
    async with running(settings) as server:
        assert await overall_health(server) == SERVING
        signals = gpu_signals.GpuSignals(
            server.engine, settings, FakeNvml([full_device()]), [gpu_signals.Device("0", 0)], torch_module=lambda: torch
        )
        await signals.tick()
        assert value("inference_gpu_torch_reserved_bytes", device="0") == 6 * GIB
        assert value("inference_gpu_torch_allocated_bytes", device="0") == 1 * GIB
        assert value("inference_gpu_ghost_memory_bytes", device="0") == 5 * GIB
        assert value("inference_gpu_ghost_memory_limit_bytes", device="0") == 4 * GIB
        problem = server.engine.conditions()[gpu_signals.CONDITION]
        assert problem.startswith("device 0: torch holds 5.00 GiB reserved but unallocated")
        assert not server.engine.ready() and await overall_health(server) == NOT_SERVING
        assert server.engine.live()  # a readiness matter only
        torch.allocated = 3 * GIB  # ghost 3 GiB: under the limit
        await signals.tick()
        assert gpu_signals.CONDITION not in server.engine.conditions()
        assert server.engine.ready() and await overall_health(server) == SERVING
        warnings = [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "ghost" in r.getMessage()
        ]
        assert len(warnings) == 1, warnings
        await signals.stop()


async def test_xid_events_are_counted_and_a_fatal_one_fails_liveness(model_repository):
    settings = make_settings(model_repository, models=["credit-risk"])
    nvml = FakeNvml([full_device()])
    async with running(settings) as server:
        signals = gpu_signals.GpuSignals(
            server.engine, settings, nvml, [gpu_signals.Device("0", 0)], torch_module=lambda: None
        )
        nvml.events = [SimpleNamespace(device=0, eventData=13, eventType=pynvml.nvmlEventTypeXidCriticalError)]
        await signals.tick()
        assert value("inference_gpu_xid_errors_total", device="0") == 1
        assert server.engine.live()
        nvml.events = [SimpleNamespace(device=0, eventData=79, eventType=pynvml.nvmlEventTypeXidCriticalError)]
        await signals.tick()
        assert value("inference_gpu_xid_errors_total", device="0") == 2
        assert not server.engine.live()
        assert server.engine.device_lost == "device 0: Xid 79 (GPU has fallen off the bus)"
        await signals.stop()


async def test_a_lost_gpu_fails_liveness_and_the_timer_keeps_sampling(model_repository):
    settings = make_settings(model_repository, models=["credit-risk"], gpu_sample_interval_s=0.05)
    nvml = FakeNvml([full_device()])
    async with running(settings) as server:
        signals = gpu_signals.GpuSignals(
            server.engine, settings, nvml, [gpu_signals.Device("0", 0)], torch_module=lambda: None
        )
        signals.start()
        await asyncio.sleep(0.2)
        assert server.engine.live() and value("inference_gpu_temperature_celsius", device="0") == 71
        nvml.devices[0]["lost"] = True
        for _ in range(50):
            if not server.engine.live():
                break
            await asyncio.sleep(0.05)
        assert server.engine.device_lost == "device 0: NVML reports the GPU is lost"
        assert not signals._task.done()
        await signals.stop()
        assert signals._task is None
