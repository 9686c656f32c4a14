"""mlpair.workers without processes: the CPU limit read from cgroup files, the worker count, the port checks."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mlpair.startup import StartupError
from mlpair.workers import PortLock, cgroup_cpu_limit, check_port_free, worker_count


def _cgroup(tmp_path: Path, files: dict[str, str], proc: str = "0::/\n") -> tuple[Path, Path]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "proc-cgroup").write_text(proc)
    return tmp_path / "fs", tmp_path / "proc-cgroup"


@pytest.mark.parametrize(("files", "proc", "expected"), [
    ({"fs/cpu.max": "400000 100000\n"}, "0::/\n", 4.0),  # cgroup v2, limits.cpu: 4
    ({"fs/cpu.max": "150000 100000\n"}, "0::/\n", 1.5),
    ({"fs/cpu.max": "max 100000\n"}, "0::/\n", None),  # no limit
    ({"fs/cpu/cpu.cfs_quota_us": "200000\n", "fs/cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n", 2.0),  # v1
    ({"fs/cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "fs/cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, "1:cpu,cpuacct:/\n",
     None),
    # outside a cgroup namespace: the process's own cgroup and its parents count, the smallest wins
    ({"fs/kubepods/pod1/cpu.max": "300000 100000\n", "fs/kubepods/cpu.max": "800000 100000\n"},
     "0::/kubepods/pod1\n", 3.0),
    ({}, "0::/\n", None),  # nothing to read
])
def test_cpu_limit_comes_from_the_cgroup(tmp_path, files, proc, expected) -> None:
    root, proc_cgroup = _cgroup(tmp_path, files, proc)
    assert cgroup_cpu_limit(root, proc_cgroup) == expected


def test_worker_count_is_the_setting_else_the_cpus_else_one_on_a_gpu(monkeypatch) -> None:
    import mlpair.workers as workers

    monkeypatch.setattr(workers, "available_cpus", lambda: 4)
    assert worker_count(3) == 3
    assert worker_count(0) == 4
    assert worker_count(0, uses_gpu=True) == 1
    assert worker_count(2, uses_gpu=True) == 2  # explicit wins: the operator accepts N copies on the device
    with pytest.raises(StartupError, match="workers"):
        worker_count(-1)


def test_available_cpus_rounds_the_limit_down_and_never_below_one(monkeypatch) -> None:
    import mlpair.workers as workers

    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4, 5, 6, 7})
    for limit, expected in ((None, 8), (4.0, 4), (2.5, 2), (0.5, 1), (16.0, 8)):
        monkeypatch.setattr(workers, "cgroup_cpu_limit", lambda limit=limit: limit)
        assert workers.available_cpus() == expected, limit


def test_a_port_someone_listens_on_is_refused_naming_it() -> None:
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as gRPC's default binds it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(StartupError, match=f"port {port} is in use"):
            check_port_free("127.0.0.1", port)
    assert check_port_free("127.0.0.1", port) == port  # free again once closed


def test_one_supervisor_per_port() -> None:
    first = PortLock(47_913)
    try:
        with pytest.raises(StartupError, match="port 47913 is in use"):
            PortLock(47_913)
    finally:
        first.release()
    PortLock(47_913).release()  # free once the first let go


async def test_a_single_server_binds_its_port_exclusively() -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: without port_sharing_options(False) a second
    server would start on the port and take part of its connections."""
    import grpc

    from mlpair.rpc import bind_port, port_sharing_options

    first = grpc.aio.server(options=port_sharing_options(False))
    port = bind_port(first, "127.0.0.1:0", None)
    await first.start()
    try:
        for shared in (False, True):  # neither another single server nor a supervisor's worker
            second = grpc.aio.server(options=port_sharing_options(shared))
            with pytest.raises(StartupError, match=f"port {port} is in use"):
                bind_port(second, f"127.0.0.1:{port}", None)
    finally:
        await first.stop(0)


def test_a_supervisor_without_a_writable_temp_folder_says_so(monkeypatch) -> None:
    """A read-only root filesystem without a writable /tmp: the workers' metrics have nowhere to go."""
    import errno
    import types

    import mlpair.workers as workers

    def read_only(**_):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(workers.tempfile, "mkdtemp", read_only)
    settings = types.SimpleNamespace(host="127.0.0.1", port=0, metrics_port=0,
                                     model_copy=lambda update: types.SimpleNamespace(host="127.0.0.1", **update))
    with pytest.raises(StartupError, match="writable folder .*Read-only file system.*workers to 1"):
        workers.supervise("inference", settings, 2, lambda s: 0)


async def test_a_worker_reports_ready_only_once_every_worker_is(tmp_path, monkeypatch) -> None:
    # The kernel spreads new connections over a supervisor's workers: a client that waited for
    # SERVING on one connection met a worker still loading its models on the next (an OTLP test
    # got UNAVAILABLE "model 'credit-risk' is not ready yet" right after SERVING).
    import asyncio

    from grpc_health.v1 import health_pb2

    from mlpair.rpc.health import Health, WorkerReadiness
    from mlpair.workers import READY_DIR_ENV, WORKERS_ENV

    monkeypatch.setenv(READY_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(WORKERS_ENV, "2")
    health = Health(["svc"])

    async def status() -> int:
        reply = await health.servicer.Check(health_pb2.HealthCheckRequest(service="svc"), None)
        return reply.status

    await health.set_serving(True)  # this worker is ready, the other one is not yet
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    await asyncio.sleep(3 * WorkerReadiness.POLL_S)
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    (tmp_path / "4242").touch()  # the other worker marks itself ready
    for _ in range(50):
        if await status() == health_pb2.HealthCheckResponse.SERVING:
            break
        await asyncio.sleep(WorkerReadiness.POLL_S)
    assert await status() == health_pb2.HealthCheckResponse.SERVING
    await health.set_serving(False)  # this worker loses readiness: so does the port, and its mark goes
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4242"]
    await health.begin_drain()


async def test_a_single_process_reports_its_own_readiness_at_once(monkeypatch) -> None:
    from grpc_health.v1 import health_pb2

    from mlpair.rpc.health import Health
    from mlpair.workers import READY_DIR_ENV, WORKERS_ENV

    monkeypatch.delenv(READY_DIR_ENV, raising=False)
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    health = Health(["svc"])
    assert health.workers is None
    await health.set_serving(True)
    reply = await health.servicer.Check(health_pb2.HealthCheckRequest(service="svc"), None)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
