"""Several serving processes on one port under one supervisor (``--workers N``), and the port checks.

Each service is one asyncio event loop: one core of Python, whatever the pod requests. With
``workers`` above 1, ``mlpair serve`` becomes a supervisor that starts that many serving
processes (``multiprocessing`` spawn: fresh interpreters, no forked gRPC state) which bind the
same gRPC port with ``SO_REUSEPORT``; the kernel spreads new connections across them (by a hash
of each connection's addresses, so one long-lived connection stays on one worker).

Who may share the port:

* a single process (``workers = 1``) binds with ``grpc.so_reuseport = 0``, so a second server on
  its port fails to bind instead of silently taking part of the traffic;
* a supervisor first takes a lock named after the port (an abstract Unix socket: one per
  network namespace, released by the kernel when the supervisor dies, even by ``kill -9``), then
  checks that no other socket holds the port, and only then starts its workers with
  ``so_reuseport = 1``. A second supervisor on the port fails at the lock, a single process
  started on it fails at its exclusive bind, and a supervisor started on a port any other
  process holds fails at the check: every case is a :class:`~mlpair.startup.StartupError`
  naming the port (``mlpair serve`` prints it as one line and exits 2).

Lifecycle: SIGTERM or SIGINT to the supervisor is forwarded to every worker, each drains as a
single process does (health NOT_SERVING, calls in flight finish within ``shutdown_grace_s``);
the supervisor exits 0 when all have exited (workers still running 10 s past the grace are
killed). A worker that exits by itself (a crash, an out-of-memory kill, a start-up refusal)
is not restarted: the supervisor drains the others and exits non-zero (2 when the worker
refused to start with a :class:`~mlpair.startup.StartupError`, else 1), so the orchestrator
restarts the container and counts the restart where operators look, rather than a
half-capacity pod hiding a crash loop. Workers die with the supervisor (``PR_SET_PDEATHSIG``).

Readiness: the kernel may send a new connection to any worker, so the port is ready only when
every worker is. Each worker marks itself ready in a folder the supervisor made, and reports its
readiness names SERVING only once every worker has (:class:`mlpair.rpc.health.Health`); a client
that waited for SERVING never meets a worker still loading its models.

Metrics: the supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh, empty folder before
starting the workers (removed when it exits) and serves ``metrics_port`` itself with
prometheus-client's ``MultiProcessCollector``: counters and histograms are the sums over the
workers (those of a worker that exited included), gauges follow each one's ``multiprocess_mode``.
A file of that folder the collector cannot read (empty, truncated, not a metrics file) is left
out of the sums and counted in ``<layer>_metrics_files_unreadable`` (:class:`TolerantCollector`),
so one bad file does not turn every scrape into an error.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlpair.startup import StartupError
from mlpair.worker_metrics import TolerantCollector

logger = logging.getLogger(__name__)

KILL_MARGIN_S = 10.0  # workers still running this long after the grace are killed
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU limit of this process's cgroup, in CPUs (quota / period), or None when unlimited.

    Reads cgroup v2's ``cpu.max`` ("max 100000" or "<quota> <period>" in µs) or cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1 = none): at the container's root (a
    container sees its own cgroup there) and along this process's own cgroup path, smallest wins.
    A Kubernetes ``resources.limits.cpu`` of 4 is a quota of 400000 per period of 100000.
    """
    limits: list[float] = []
    for folder in _cgroup_folders(root, proc_cgroup):
        limit = _read_limit(folder)
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def _cgroup_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """The folders whose CPU limit applies: each hierarchy's root, then this process's cgroup and its ancestors."""
    mounts = [root, root / "cpu", root / "cpu,cpuacct"]  # v2 unified; v1 cpu controller (either name)
    folders = list(mounts)
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers != "" and "cpu" not in controllers.split(","):
                continue
            for mount in mounts[:1] if controllers == "" else mounts[1:]:
                folder = mount / path.lstrip("/")
                while folder != mount:
                    folders.append(folder)
                    folder = folder.parent
    return folders


def _read_limit(folder: Path) -> float | None:
    try:
        max_quota, max_period = (folder / "cpu.max").read_text().split()
        return None if max_quota == "max" else int(max_quota) / int(max_period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    """CPUs this process may use: the cgroup limit rounded down (never above what can run at once
    without being throttled; at least 1), else the CPUs it may run on (affinity), else ``os.cpu_count()``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cpus, math.floor(limit))) if limit is not None else max(1, cpus)


def gpu_visible() -> bool:
    """True when an NVIDIA device node is present (a GPU pod); cheap, imports no runtime."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def worker_count(workers: int, *, uses_gpu: bool = False) -> int:
    """The serving processes to start: ``workers`` when set (> 0), else one per available CPU
    (:func:`available_cpus`), or 1 when the process would use a GPU (each worker would load its
    own copy of every model onto the device).

    Raises:
        StartupError: ``workers`` is negative.
    """
    if workers < 0:
        raise StartupError(f"workers must be 0 (one per CPU of the container's limit) or more, not {workers}")
    if workers:
        return workers
    return 1 if uses_gpu else available_cpus()


def _socket_family(host: str) -> tuple[socket.AddressFamily, str]:
    host = host.strip("[]")
    return (socket.AF_INET6, host) if ":" in host else (socket.AF_INET, host)


def check_port_free(host: str, port: int, what: str = "port") -> int:
    """Binds ``host:port`` once, exclusively, and lets go: raises if any socket holds the port.

    ``SO_REUSEADDR`` is set (as gRPC sets it) so that connections of a previous server still in
    TIME_WAIT do not count; a listening socket does, with or without ``SO_REUSEPORT``.
    Returns the port (a free one when ``port`` is 0).

    Raises:
        StartupError: the port is in use, or the address cannot be bound (one line naming it).
    """
    family, address = _socket_family(host)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise port_error(host, port, exc, what) from exc
        return probe.getsockname()[1]


def port_error(host: str, port: int, exc: OSError, what: str = "port") -> StartupError:
    """The one-line start-up refusal for an address that cannot be bound (``what``: "port", "metrics port")."""
    import errno

    setting = what.replace(" ", "_")
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"{what} {port} is in use on {host} (another server is bound to it); stop it or choose another {setting}"
        )
    return StartupError(
        f"cannot bind {what} {port} on {host}: {exc.strerror or exc}; check the host and {setting} settings"
    )


class PortLock:
    """Exclusive claim of a TCP port by one supervisor: an abstract Unix socket named after the
    port (Linux; one namespace per network namespace, like the port; freed when the process dies).

    Raises:
        StartupError: another supervisor holds the port.
    """

    def __init__(self, port: int) -> None:
        self._socket: socket.socket | None = None
        if not sys.platform.startswith("linux"):
            return  # no abstract namespace: the port check alone guards (see check_port_free)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.bind(f"\0mlpair-port-{port}")
        except OSError as exc:
            self._socket.close()
            raise StartupError(
                f"port {port} is in use (another mlpair supervisor serves it); stop it or choose another port"
            ) from exc

    def release(self) -> None:
        """Frees the port's lock so another supervisor may take it; safe to call more than once."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def die_with_parent(parent_pid: int) -> None:
    """Asks Linux to SIGKILL this process when its parent dies; exits at once if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


READY_DIR_ENV = "MLPAIR_WORKERS_READY_DIR"
WORKERS_ENV = "MLPAIR_WORKERS"
"""Set in each worker (never in the supervisor): where the workers mark themselves ready, and how
many there are (:class:`mlpair.rpc.health.Health` reports ready only once all of them are)."""


def _worker_main(run: Callable[[object], int], settings, parent_pid: int, ready_dir: str, workers: int) -> None:
    die_with_parent(parent_pid)
    os.environ[READY_DIR_ENV], os.environ[WORKERS_ENV] = ready_dir, str(workers)
    sys.exit(run(settings))


def serve_metrics(host: str, port: int, folder: Path, layer: str = "mlpair") -> None:
    """Serves the workers' metrics, aggregated from ``folder`` (:class:`TolerantCollector`), on
    ``host:port`` (a daemon thread); ``layer`` names the unreadable-files gauge.

    Raises:
        StartupError: the metrics port cannot be bound.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(TolerantCollector(layer, folder))
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise port_error(host, port, exc, "metrics port") from exc


def supervise(
    layer: str,
    settings,
    workers: int,
    run_worker: Callable[[object], int],
    preflight: Callable[[Any], object] | None = None,
) -> int:
    """Runs ``workers`` processes of ``run_worker(settings)`` (picklable; serves on the shared port and
    returns an exit code) until SIGTERM/SIGINT or until one exits; see the module docstring. Port 0
    picks one free port for all of them. ``preflight(settings)``, once the port is known to be free
    and before any worker starts, checks what every worker would refuse alike (the configuration),
    so such a refusal is one line from one process.

    Returns:
        0 after a signal when every worker drained; 2 or 1 when a worker exited by itself.

    Raises:
        StartupError: the port (or the metrics port) is in use or cannot be bound, or ``preflight``
            refused the configuration.
    """
    port = check_port_free(settings.host, settings.port)
    settings = settings.model_copy(update={"port": port})
    lock = PortLock(port)
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"mlpair-{layer}-metrics-"))
    except OSError as exc:
        lock.release()
        raise StartupError(
            f"{workers} workers need a writable folder for their metrics, and {tempfile.gettempdir()} "
            f"is not ({exc.strerror}); mount one there (or set TMPDIR), or set workers to 1"
        ) from exc
    try:
        check_port_free(settings.host, port)  # again, now that no other supervisor can start on it
        if preflight is not None:
            preflight(settings)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)  # inherited by the workers
        if settings.metrics_port:
            serve_metrics(settings.host, settings.metrics_port, folder, layer)
        return _Supervisor(layer, settings, workers, run_worker, folder).run()
    finally:
        lock.release()
        shutil.rmtree(folder, ignore_errors=True)


class _Supervisor:
    def __init__(self, layer: str, settings, workers: int, run_worker: Callable[[object], int], folder: Path) -> None:
        self.layer, self.settings, self.folder = layer, settings, folder
        context = multiprocessing.get_context("spawn")
        ready = folder / "ready"  # not a metrics file: the collector reads only *.db
        ready.mkdir()
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(run_worker, settings, os.getpid(), str(ready), workers),
                name=f"{layer}-worker-{i}",
            )
            for i in range(workers)
        ]
        self.stop = threading.Event()
        self.stopping_since: float | None = None
        self.exit_code = 0

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        for process in self.processes:
            process.start()
        logger.info(
            "%s supervisor %d: %d workers on port %d (pids %s)",
            self.layer,
            os.getpid(),
            len(self.processes),
            self.settings.port,
            ", ".join(str(p.pid) for p in self.processes),
        )
        live = list(self.processes)
        while live:
            exited = multiprocessing.connection.wait([p.sentinel for p in live], timeout=0.1)
            for process in [p for p in live if p.sentinel in exited]:
                process.join()
                live.remove(process)
                self._reap(process)
            if self.stop.is_set() and self.stopping_since is None:
                logger.info("termination signal received; draining %d workers", len(live))
                self._stop_all(live)
            if (
                self.stopping_since is not None
                and time.monotonic() - self.stopping_since > self.settings.shutdown_grace_s + KILL_MARGIN_S
            ):
                for process in live:
                    logger.error("worker %d still running after the grace period; killing it", process.pid)
                    process.kill()
                self.exit_code = self.exit_code or 1
        # after a worker's start-up refusal (exit 2) its one line, already on stderr, stays the last
        logger.log(logging.DEBUG if self.exit_code == 2 else logging.INFO, "%s supervisor stopped", self.layer)
        return self.exit_code

    def _reap(self, process) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(process.pid, str(self.folder))  # its live* gauges leave the sums
        code = process.exitcode
        if self.stopping_since is not None and code in (0, -signal.SIGTERM):
            return
        if self.stopping_since is None:
            # exit 2: the worker refused to start and printed why (a configuration error) — not repeated
            logger.log(
                logging.DEBUG if code == 2 else logging.ERROR,
                "worker %d exited with code %s; draining the others and exiting",
                process.pid,
                code,
            )
            self.exit_code = 2 if code == 2 else 1
            self._stop_all([p for p in self.processes if p.is_alive()])
        else:
            logger.log(
                logging.DEBUG if code == 2 else logging.ERROR,
                "worker %d exited with code %s while draining",
                process.pid,
                code,
            )
            self.exit_code = self.exit_code or (2 if code == 2 else 1)

    def _stop_all(self, processes) -> None:
        self.stopping_since = time.monotonic()
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
