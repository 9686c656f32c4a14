"""GPU signals: the devices this process serves on, sampled on a timer and exported as ``inference_gpu_*``.

What is read, every ``gpu_sample_interval_s`` seconds (never per request), in a thread (NVML calls
block), through NVIDIA's NVML bindings (``nvidia-ml-py``, imported as ``pynvml``):

* per device: utilisation of the GPU and of its memory (``nvmlDeviceGetUtilizationRates``, percent
  over the driver's last sample period, exported as a 0-1 ratio), memory used and total
  (``nvmlDeviceGetMemoryInfo``, bytes), this process's memory on it
  (``nvmlDeviceGetComputeRunningProcesses`` filtered by our PID, bytes), core temperature (°C), power
  draw and enforced limit (NVML reports milliwatts, exported as watts), SM clock (NVML reports MHz,
  exported as hertz), the clock-event (throttle) reasons (``nvmlDeviceGetCurrentClocksEventReasons``,
  a bitmask split into one 0/1 series per named reason the device supports), uncorrected ECC errors
  since the driver loaded (volatile counter) and critical Xid events (an NVML event set, drained at
  each sample without waiting);
* torch's caching allocator, when torch is already imported and has initialised CUDA (the torch
  runtime on a GPU; this module never imports torch): ``memory_reserved`` and ``memory_allocated``
  per CUDA device, and their difference, "ghost memory": device memory torch holds from every other
  process but no tensor uses.

ONNX Runtime exposes no figure for its CUDA arena through its Python API (the arena shows only in a
profiling trace), so under the onnx runtime device memory is NVML's per-process figure alone.

A field the driver does not report (``NVMLError_NotSupported``, ``NoPermission``, …) is absent from
the export, never a zero. Where no NVML or no GPU exists, :func:`start_gpu_signals` says so once
(``inference_gpu_present 0`` and one log line) and starts no sampler.

Readiness: ghost memory above ``gpu_ghost_memory_max_bytes`` on any device makes the server not ready
(the ``gpu_ghost_memory`` condition of :meth:`InferenceEngine.set_condition`) until it falls back
under. Liveness: an NVML ``GpuIsLost`` error or a fatal Xid (:data:`FATAL_XIDS`) marks the device lost
(:meth:`InferenceEngine.mark_device_lost`), so the kubelet restarts the pod.

Device labels are the CUDA ordinals this process sees: positions in ``CUDA_VISIBLE_DEVICES`` (indices
or ``GPU-`` UUIDs) when it is set, else NVML's indices (which are CUDA's with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``). MIG instances are not resolved (their parent's figures would
mislead): a ``MIG-`` entry is skipped with a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mlpair.background import stop_task
from mlpair.inference import metrics

if TYPE_CHECKING:
    from mlpair.inference.engine import InferenceEngine
    from mlpair.inference.settings import InferenceSettings

logger = logging.getLogger(__name__)

CONDITION = "gpu_ghost_memory"
"""The engine readiness condition ghost memory over its setting raises."""

# Label -> the NVML constant's suffix (nvmlClocksEventReason<X>, nvmlClocksThrottleReason<X> on older
# bindings); the label set is fixed here, so the `reason` label stays bounded.
THROTTLE_REASONS = {
    "gpu_idle": "GpuIdle",
    "applications_clocks_setting": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal_slowdown": "SwThermalSlowdown",
    "hw_thermal_slowdown": "HwThermalSlowdown",
    "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
    "display_clock_setting": "DisplayClockSetting",
}

FATAL_XIDS = {79: "GPU has fallen off the bus"}
"""Xid codes after which this process can run nothing on the device again: NVIDIA's Xid catalog
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) lists 79 as the GPU no longer
reachable on PCIe. Other critical Xids are counted and logged; their resolution (restart the
application, reset the GPU) is the operator's call."""


@dataclass
class Device:
    """One device this process may run on: its label (CUDA ordinal) and NVML handle."""

    label: str
    handle: Any
    reasons: dict[str, int] = field(default_factory=dict)
    """Throttle reasons the device reports: label -> bit."""
    nvml_index: int | None = None
    """NVML's index of the device (Xid events name devices by handle)."""


@dataclass
class Observation:
    """What one sampling pass found that readiness or liveness acts on."""

    ghost_bytes: dict[str, int] = field(default_factory=dict)
    """torch reserved minus allocated per device label (empty when torch is not on CUDA)."""
    lost: str | None = None
    """Why the device is lost for good, when it is."""


def _import_nvml() -> ModuleType | str:
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    return pynvml


def _visible_devices(nvml: Any) -> list[Device] | str:
    """The devices CUDA shows this process, with NVML handles; a reason string when there are none.

    Raises:
        pynvml.NVMLError: NVML failed to enumerate devices.
    """
    count = nvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        devices = [Device(str(i), nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    else:
        devices = []
        for entry in (e.strip() for e in visible.split(",")):
            if entry.isdigit() and int(entry) < count:
                handle = nvml.nvmlDeviceGetHandleByIndex(int(entry))
            elif entry.startswith("GPU-"):
                handle = nvml.nvmlDeviceGetHandleByUUID(entry)
            else:  # CUDA stops at the first entry it cannot use; so does this
                if entry.startswith("MIG-"):
                    logger.info("CUDA_VISIBLE_DEVICES entry %s is a MIG instance: not sampled", entry)
                break
            devices.append(Device(str(len(devices)), handle))
    if not devices:
        return f"NVML sees {count} device(s), CUDA_VISIBLE_DEVICES={visible!r} leaves none" if count else "no device"
    return devices


def _throttle_bits(nvml: Any) -> dict[str, int]:
    bits = {}
    for label, suffix in THROTTLE_REASONS.items():
        value = getattr(nvml, f"nvmlClocksEventReason{suffix}", None)
        if value is None:
            value = getattr(nvml, f"nvmlClocksThrottleReason{suffix}", None)
        if value is not None:
            bits[label] = int(value)
    return bits


class GpuSignals:
    """Samples ``devices`` through ``nvml`` (an initialised ``pynvml`` or an object with its surface)
    and sets the ``inference_gpu_*`` gauges; acts on ghost memory and lost devices through ``engine``.

    Args:
        engine: the server's engine (readiness conditions, liveness).
        settings: ``gpu_sample_interval_s`` and ``gpu_ghost_memory_max_bytes`` are read.
        nvml: the NVML bindings, already initialised.
        devices: from :func:`_visible_devices`.
        torch_module: returns torch when it is imported (default: ``sys.modules``), else None.
        pid: the process whose device memory is exported (default: this one).
    """

    def __init__(
        self,
        engine: InferenceEngine,
        settings: InferenceSettings,
        nvml: Any,
        devices: list[Device],
        *,
        torch_module: Callable[[], Any] = lambda: sys.modules.get("torch"),
        pid: int | None = None,
    ) -> None:
        self.engine, self.nvml, self.devices = engine, nvml, devices
        self.interval_s = settings.gpu_sample_interval_s
        self.ghost_limit = settings.gpu_ghost_memory_max_bytes
        self._torch = torch_module
        self._pid = os.getpid() if pid is None else pid
        self._task: asyncio.Task | None = None
        self._ghost_problem: str | None = None
        bits = _throttle_bits(nvml)
        # NVML 12.2 renamed "throttle reasons" to "clocks event reasons"; older bindings have the old name
        self._supported_reasons = (
            getattr(nvml, "nvmlDeviceGetSupportedClocksEventReasons", None)
            or nvml.nvmlDeviceGetSupportedClocksThrottleReasons
        )
        self._current_reasons = (
            getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        for device in devices:
            device.nvml_index = self._read(nvml.nvmlDeviceGetIndex, device.handle)
            supported = self._read(self._supported_reasons, device.handle)
            device.reasons = {r: b for r, b in bits.items() if supported is None or supported & b}
        self._events = self._register_xid_events()
        metrics.GPU_PRESENT.set(1)

    # -- reading ---------------------------------------------------------------------------------

    def _read(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, or None when NVML does not report it (any NVMLError but GpuIsLost).

        Raises:
            pynvml.NVMLError_GpuIsLost: the device is gone.
        """
        try:
            return call(*args)
        except self.nvml.NVMLError_GpuIsLost:
            raise
        except self.nvml.NVMLError:
            return None

    def _register_xid_events(self) -> Any:
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            logger.info("NVML event sets unavailable (%s): Xid events not counted", exc)
            return None
        for device in self.devices:
            try:
                nvml.nvmlDeviceRegisterEvents(device.handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError as exc:
                logger.info("device %s: Xid events not reported by the driver (%s)", device.label, exc)
        return events

    def _drain_xids(self) -> str | None:
        """Counts the Xid events waiting (no wait); returns why the device is lost on a fatal one."""
        nvml, lost = self.nvml, None
        labels = {d.nvml_index: d.label for d in self.devices}
        while self._events is not None:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # NVMLError_Timeout: nothing waiting
                return lost
            label = labels.get(self._read(nvml.nvmlDeviceGetIndex, event.device), "unknown")
            xid = int(event.eventData)
            metrics.GPU_XID_ERRORS.labels(label).inc()
            logger.error("device %s: Xid %d reported by the driver", label, xid)
            if xid in FATAL_XIDS:
                lost = f"device {label}: Xid {xid} ({FATAL_XIDS[xid]})"
        return lost

    def sample(self) -> Observation:
        """Reads every device and torch's allocator once and sets the gauges (blocking: run it in a
        thread). A field NVML does not report is removed from the export, never set to 0."""
        observation = Observation()
        for device in self.devices:
            try:
                self._sample_device(device)
            except self.nvml.NVMLError_GpuIsLost:
                observation.lost = f"device {device.label}: NVML reports the GPU is lost"
        observation.lost = self._drain_xids() or observation.lost
        observation.ghost_bytes = self._sample_torch()
        return observation

    def _sample_device(self, device: Device) -> None:
        nvml, h, d = self.nvml, device.handle, device.label
        rates = self._read(nvml.nvmlDeviceGetUtilizationRates, h)
        _put(metrics.GPU_UTILIZATION, d, None if rates is None else rates.gpu / 100)
        _put(metrics.GPU_MEMORY_UTILIZATION, d, None if rates is None else rates.memory / 100)
        memory = self._read(nvml.nvmlDeviceGetMemoryInfo, h)
        _put(metrics.GPU_MEMORY_USED, d, None if memory is None else memory.used)
        _put(metrics.GPU_MEMORY_TOTAL, d, None if memory is None else memory.total)
        processes = self._read(nvml.nvmlDeviceGetComputeRunningProcesses, h)
        mine = [p.usedGpuMemory for p in processes or [] if p.pid == self._pid]
        # None: the driver does not say (e.g. no access to other PID namespaces); absent: not on it
        _put(metrics.GPU_PROCESS_MEMORY, d, sum(mine) if mine and None not in mine else None)
        _put(metrics.GPU_TEMPERATURE, d, self._read(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU))
        power = self._read(nvml.nvmlDeviceGetPowerUsage, h)
        _put(metrics.GPU_POWER, d, None if power is None else power / 1000)
        limit = self._read(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
        _put(metrics.GPU_POWER_LIMIT, d, None if limit is None else limit / 1000)
        clock = self._read(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)
        _put(metrics.GPU_SM_CLOCK, d, None if clock is None else clock * 1e6)
        mask = self._read(self._current_reasons, h)
        for reason, bit in device.reasons.items():
            _put(metrics.GPU_THROTTLED, (d, reason), None if mask is None else int(bool(mask & bit)))
        ecc = self._read(
            nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
        _put(metrics.GPU_ECC_UNCORRECTED, d, ecc)

    def _sample_torch(self) -> dict[str, int]:
        torch = self._torch()
        if torch is None or not torch.cuda.is_initialized():
            return {}
        ghost = {}
        for index in range(torch.cuda.device_count()):
            reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
            label = str(index)
            metrics.GPU_TORCH_RESERVED.labels(label).set(reserved)
            metrics.GPU_TORCH_ALLOCATED.labels(label).set(allocated)
            metrics.GPU_GHOST_MEMORY.labels(label).set(reserved - allocated)
            metrics.GPU_GHOST_MEMORY_LIMIT.labels(label).set(self.ghost_limit)
            ghost[label] = reserved - allocated
        return ghost

    # -- acting ----------------------------------------------------------------------------------

    async def tick(self) -> Observation:
        """One sample in a thread, then readiness (ghost memory) and liveness (a lost device)."""
        observation = await asyncio.to_thread(self.sample)
        over = {d: b for d, b in observation.ghost_bytes.items() if self.ghost_limit and b > self.ghost_limit}
        problem = None
        if over:
            device, ghost = max(over.items(), key=lambda item: item[1])
            problem = (
                f"device {device}: torch holds {ghost / 2**30:.2f} GiB reserved but unallocated, over "
                f"gpu_ghost_memory_max_bytes ({self.ghost_limit / 2**30:.2f} GiB)"
            )
        if problem != self._ghost_problem:
            if problem:
                logger.warning("not ready: %s", problem)
            else:
                logger.info("ghost memory back under gpu_ghost_memory_max_bytes: ready as far as the GPU goes")
            self._ghost_problem = problem
        await self.engine.set_condition(CONDITION, problem)
        if observation.lost:
            logger.critical("device lost, liveness fails: %s", observation.lost)
            await self.engine.mark_device_lost(observation.lost)
        return observation

    def start(self) -> None:
        """Samples every ``interval_s`` from now on (0 = no sampling; the present gauge stays)."""
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gpu-signals")

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001  (a failed sample must not end sampling)
                logger.warning("GPU sample failed", exc_info=True)
                metrics.OBSERVABILITY_ERRORS.labels("gpu_sample").inc()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Stops sampling and releases NVML."""
        await stop_task(self._task)
        self._task = None
        with contextlib.suppress(Exception):
            if self._events is not None:
                self.nvml.nvmlEventSetFree(self._events)
            await asyncio.to_thread(self.nvml.nvmlShutdown)


def _put(gauge: Any, labels: str | tuple[str, ...], value: float | None) -> None:
    """Sets ``gauge{labels}`` to ``value``, or removes that series when ``value`` is None."""
    labels = (labels,) if isinstance(labels, str) else labels
    if value is None:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)
    else:
        gauge.labels(*labels).set(value)


def _probe(nvml: Any) -> list[Device] | str:
    """Initialises NVML and lists the devices; a one-line reason when there is no GPU to sample."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return f"NVML: {exc}"
    try:
        devices = _visible_devices(nvml)
    except nvml.NVMLError as exc:
        devices = f"NVML: {exc}"
    if isinstance(devices, str):
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return devices


async def start_gpu_signals(
    engine: InferenceEngine, settings: InferenceSettings, *, nvml: Any = None, **kwargs: Any
) -> GpuSignals | None:
    """Starts the GPU sampler when NVML sees a device; otherwise exports ``inference_gpu_present 0``,
    logs why once and returns None (nothing is sampled).

    Args:
        nvml: the NVML bindings (default: ``pynvml``); tests pass an object with its surface.
        kwargs: passed to :class:`GpuSignals`.
    """
    found = _import_nvml() if nvml is None else nvml
    devices = found if isinstance(found, str) else await asyncio.to_thread(_probe, found)
    if isinstance(devices, str):
        metrics.GPU_PRESENT.set(0)
        logger.info("no NVIDIA GPU visible (%s): inference_gpu_* not exported", devices)
        return None
    signals = GpuSignals(engine, settings, found, devices, **kwargs)
    logger.info(
        "GPU signals: %d device(s) sampled every %.1f s, ghost memory limit %d bytes (0 = off)",
        len(devices),
        settings.gpu_sample_interval_s,
        settings.gpu_ghost_memory_max_bytes,
    )
    signals.start()
    return signals
