"""The two services as real processes on loopback, and real workloads for them (bench and soak).

* :class:`Service` — one ``mlpair serve inference|prediction`` process on a fixed free port:
  start, wait for ``grpc.health.v1`` SERVING, SIGTERM or SIGKILL by PID, restart on the same
  port, resident memory (RSS).
* :func:`pair` — InferenceService and PredictionService (one or several replicas sharing one
  decision ledger) wired together under a work folder (logs there; the ledger and the CRM at any
  SQLAlchemy URL, SQLite files in the folder by default), migrated with ``mlpair migrate``.
* :func:`credit_workload` — Predict requests built from the real credit-risk holdout
  applicants with one numeric attribute perturbed, so that every request is a distinct
  feature row (a cache miss), checked by assembling each row with the served preprocessing.
* :func:`scratch_postgres` — a throw-away PostgreSQL database on 127.0.0.1, dropped afterwards.
* :class:`TcpProxy` — a loopback TCP proxy (e.g. in front of PostgreSQL) whose connections
  can be cut and restored, to take a database away from a service and give it back.

Everything here binds 127.0.0.1 and ends only the processes it started, by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "config"
MODEL = "credit-risk"
SCHEMA = CONFIG_DIR / MODEL / "feature-schema.toml"
# Loan amount: continuous, range [0, 20000]; a step of 1 changes the standardised float32 value.
PERTURBED_ATTRIBUTE = "Amount"
POSTGRES_ADMIN_URL = os.environ.get("MLPAIR_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


@dataclass
class Service:
    """One service process (``mlpair serve <role>``) on a fixed loopback port, restartable."""

    role: str
    env: dict[str, str]
    port: int
    log_path: Path
    process: subprocess.Popen | None = None
    starts: int = 0
    # what the interpreter runs after ``-P``; None = ``-m mlpair.cli serve <role>`` (a test may run
    # a launcher of its own, e.g. tests/fault_inference.py, that serves the same way)
    command: list[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready_timeout_s: float = 90.0) -> float:
        """Starts the process and waits for SERVING; returns seconds from spawn to SERVING.

        Raises:
            RuntimeError: the process exited or was not SERVING within ``ready_timeout_s``.
        """
        with open(self.log_path, "a") as log:
            started = time.monotonic()
            # -P: the working directory is not put first on sys.path, so a PYTHONPATH naming another
            # release's package (the A/B phase) is what runs, not this checkout's mlpair/
            command = self.command or ["-m", "mlpair.cli", "serve", self.role]
            self.process = subprocess.Popen([sys.executable, "-P", *command],
                                            env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1
        self.wait_serving(ready_timeout_s)
        return time.monotonic() - started

    def wait_serving(self, timeout_s: float) -> None:
        from mlpair.rpc import wait_until_serving

        if not wait_until_serving(self.address, timeout_s, self.alive):
            raise RuntimeError(f"{self.role} at {self.address} not SERVING; log tail:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (``kill -9``): no drain, no clean-up; waits for the process to be gone."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(30)

    def terminate(self, grace_s: float = 60.0) -> int:
        """SIGTERM, then wait for the process to exit by itself; returns its exit code (-9 if it had to be killed)."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                return -9
        return self.process.returncode if self.process is not None else 0

    def wait_exit(self, timeout_s: float) -> int:
        """Waits for the process to exit by itself (after a signal sent elsewhere); SIGKILL past
        ``timeout_s``. Returns its exit code (-9 if it had to be killed)."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            return -9

    def processes(self) -> list:
        """The process and its descendants (a supervisor's workers), as psutil processes."""
        import psutil

        if not self.alive():
            return []
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def rss_bytes(self) -> int:
        """Resident set size of the process and its workers, summed (0 when it is not running)."""
        import psutil

        total = 0
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
        return total

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the process and its workers."""
        import psutil

        total = 0.0
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                total += sum(process.cpu_times()[:2])
        return total

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""


@dataclass
class Pair:
    """InferenceService and PredictionService processes wired together."""

    inference: Service
    prediction: Service
    workdir: Path
    crm_url: str
    ledger_url: str
    startup_s: dict[str, float] = field(default_factory=dict)
    # further PredictionService replicas (own port and metrics port, the same ledger and CRM), as
    # a Service of several pods would run them; empty unless pair(..., prediction_replicas=n > 1)
    more_predictions: list[Service] = field(default_factory=list)

    @property
    def predictions(self) -> list[Service]:
        return [self.prediction, *self.more_predictions]

    def migrate(self) -> None:
        """``mlpair migrate`` for the ledger and the CRM, as the pre-deploy job does.

        Raises:
            RuntimeError: the command failed (its one-line reason).
        """
        done = subprocess.run([sys.executable, "-m", "mlpair.cli", "migrate", "--ledger-url", self.ledger_url,
                               "--crm-url", self.crm_url], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"mlpair migrate failed: {done.stderr.strip()}")

    def start(self) -> None:
        self.migrate()
        self.startup_s["inference"] = self.inference.start()
        for i, replica in enumerate(self.predictions):
            self.startup_s["prediction" if i == 0 else f"prediction-{i + 1}"] = replica.start()

    def stop(self) -> dict[str, int]:
        """SIGTERM to PredictionService first (it drains its callers), then InferenceService."""
        codes = {"prediction" if i == 0 else f"prediction-{i + 1}": replica.terminate()
                 for i, replica in enumerate(self.predictions)}
        return {**codes, "inference": self.inference.terminate()}

    def kill(self) -> None:
        for service in (*self.predictions, self.inference):
            service.kill()


def pair(workdir: Path, model_repository: Path, *, crm_url: str | None = None, ledger_url: str | None = None,
         prediction_env: dict | None = None, inference_env: dict | None = None, log_level: str = "WARNING",
         prediction_replicas: int = 1) -> Pair:
    """Builds (does not start) the two services under ``workdir``.

    Args:
        crm_url: SQLAlchemy async URL of the CRM; default a SQLite file in ``workdir``.
        ledger_url: SQLAlchemy async URL of the decision ledger; default the CRM's database when
            that is PostgreSQL (the ledger has a schema of its own there), else a SQLite file in ``workdir``.
        prediction_env, inference_env: extra ``PREDICTION_*`` / ``INFERENCE_*`` settings (one serving
            process each unless they set ``*_WORKERS``, so that PIDs, kills and timings mean one process).
        prediction_replicas: PredictionService processes, each with its own port and (when
            ``PREDICTION_METRICS_PORT`` is set) metrics port, sharing InferenceService, the ledger and the CRM.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    crm_url = crm_url or f"sqlite+aiosqlite:///{workdir / 'crm.sqlite'}"
    if ledger_url is None:
        ledger_url = crm_url if crm_url.startswith("postgresql") else f"sqlite+aiosqlite:///{workdir / 'ledger.sqlite'}"
    inference = Service("inference", {
        "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": "0", "INFERENCE_METRICS_PORT": "0",
        "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_MODELS": json.dumps([MODEL]),
        "INFERENCE_LOG_LEVEL": log_level, "INFERENCE_WORKERS": "1", **(inference_env or {})}, free_port(), workdir / "inference.log")
    inference.env["INFERENCE_PORT"] = str(inference.port)
    prediction = Service("prediction", {
        "PREDICTION_HOST": "127.0.0.1", "PREDICTION_METRICS_PORT": "0",
        "PREDICTION_INFERENCE_TARGET": inference.address, "PREDICTION_CRM_URL": crm_url,
        "PREDICTION_LEDGER_URL": ledger_url, "PREDICTION_MODEL_REPOSITORY": str(model_repository),
        "PREDICTION_CONFIG_DIR": str(CONFIG_DIR), "PREDICTION_MODEL_NAME": MODEL, "PREDICTION_LOG_LEVEL": log_level,
        "PREDICTION_WORKERS": "1", **(prediction_env or {})}, free_port(), workdir / "prediction.log")
    prediction.env["PREDICTION_PORT"] = str(prediction.port)
    more = []
    for n in range(2, prediction_replicas + 1):
        env = dict(prediction.env)
        if env.get("PREDICTION_METRICS_PORT", "0") != "0":
            env["PREDICTION_METRICS_PORT"] = str(free_port())
        replica = Service("prediction", env, free_port(), workdir / f"prediction-{n}.log")
        replica.env["PREDICTION_PORT"] = str(replica.port)
        more.append(replica)
    return Pair(inference, prediction, workdir, crm_url, ledger_url, more_predictions=more)


@contextlib.contextmanager
def running(p: Pair) -> Iterator[Pair]:
    """Starts both services and always ends them (SIGTERM, SIGKILL only if they do not exit)."""
    try:
        p.start()
        yield p
    finally:
        p.stop()


def trained_model(model_repository: Path):
    """The credit-risk model entry (trained now, or the latest reused when nothing changed)."""
    from mlpair.training.pipeline import train_family

    entry, _ = train_family(SCHEMA, model_repository, show_progress=False)
    return entry


def holdout(entry):
    """The real holdout applicants of ``entry``'s split (records never seen in training)."""
    from mlpair.contracts.schema import FeatureSchema
    from mlpair.training.data import load_dataset, stratified_split

    data = load_dataset(FeatureSchema.from_toml(SCHEMA))
    return data.subset(stratified_split(data.labels, int(entry.manifest.data_source["split"]["seed"]))["holdout"])


def credit_workload(entry, run_id: str) -> Iterator[tuple[str, str, dict]]:
    """Predict requests ``(request_id, entity_id, attributes)``, each a distinct feature row, without end.

    Holdout applicant ``i mod H`` with its loan amount moved by ``i // H`` currency units
    (within the schema's range, so no guard collapses two rows into one). Every row is assembled
    with the model's preprocessing and duplicates are skipped, so every request is a cache miss.
    """
    from mlpair.contracts.assembly import FeatureAssembler

    records = holdout(entry)
    assembler = FeatureAssembler(entry.preprocessing)
    seen: set[bytes] = set()
    i = made = 0
    size = len(records.records)
    while True:
        base = records.records[i % size]
        step = i // size
        amount = base.get(PERTURBED_ATTRIBUTE)
        i += 1
        if amount is None:
            continue
        value = float(amount) + step if float(amount) + step <= 20000 else float(amount) - step
        attrs = {**base, PERTURBED_ATTRIBUTE: value}
        key = assembler.assemble(attrs).vector.tobytes()
        if key in seen:
            continue
        seen.add(key)
        yield f"{run_id}-{made}", records.entity_ids[(i - 1) % size], attrs
        made += 1


def postgres_admin(statement: str) -> None:
    """Runs one statement on the local PostgreSQL as its administrator (databases, roles), from
    synchronous code (it runs its own short event loop)."""
    import asyncpg

    async def admin() -> None:
        conn = await asyncpg.connect(POSTGRES_ADMIN_URL)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(admin())


@contextlib.contextmanager
def scratch_postgres(prefix: str = "mlpair_bench") -> Iterator[str | None]:
    """A fresh PostgreSQL database on 127.0.0.1 named ``<prefix>_<pid>_<random>`` (its asyncpg
    SQLAlchemy URL), dropped afterwards; yields None when PostgreSQL is not reachable."""
    if not reachable("127.0.0.1", 5432):
        yield None
        return
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    postgres_admin(f'CREATE DATABASE "{name}"')
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        postgres_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``; :meth:`cut` drops every connection and refuses
    new ones until :meth:`restore`; :meth:`lose_reply_after` drops one connection right after
    the client sent a given message, so the server acts on it but the client never hears back;
    ``delay_s`` (settable at any time) holds every chunk that long in each direction, in order,
    without limiting throughput: injected latency on the hop. ``connections``, ``open`` and
    ``peak_open`` count the connections made through it."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._lose_after: bytes | None = None
        self.connections = 0  # accepted and connected upstream, since start
        self.open = 0  # of those, still open now
        self.peak_open = 0  # the most open at once
        self.replies_lost = 0
        self.delay_s = 0.0

    def lose_reply_after(self, marker: bytes) -> None:
        """The next time a client sends bytes containing ``marker`` (e.g. ``b"COMMIT"``), they
        reach the server, the client's side is reset at once and the server's side shortly after."""
        self._lose_after = marker

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def cut(self) -> None:
        """Stops listening and resets every open connection (both sides see it broken)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, from_client: bool) -> None:
            try:
                while data := await src.read(65536):
                    if self.delay_s > 0:  # equal delays fire in order: the stream stays intact
                        asyncio.get_running_loop().call_later(self.delay_s, _write_if_open, dst, data)
                        continue
                    dst.write(data)
                    await dst.drain()
                    if from_client and self._lose_after is not None and self._lose_after in data:
                        self._lose_after = None
                        self.replies_lost += 1
                        writer.transport.abort()  # the client never sees the reply...
                        await asyncio.sleep(0.2)  # ...while the server has time to act on the message
                        break
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
        finally:
            self.open -= 1
            self._writers -= {writer, up_writer}


def _write_if_open(writer: asyncio.StreamWriter, data: bytes) -> None:
    if not writer.is_closing():
        writer.write(data)


def machine() -> dict:
    """What the figures ran on: cores, load average at the time, Python."""
    import platform

    return {"cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(), "cpu_model": _cpu_model()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# The last release before the shared decision ledger (per-pod outboxes, CRM at crm_0002): the
# baseline of `make bench-predict`'s A/B, and the code tests/prediction/test_migrate.py runs against
# this release's schema. Update it to the previous release whenever a release changes a schema.
PREVIOUS_RELEASE = "1c204043f24fc9358b71bb9a0017bc12b0a2ff27"
# The release before the audit records and the event outbox (ledger_0005): ledger at ledger_0004, CRM at
# crm_0003, and the code tests/prediction/test_migrate.py runs against this release's schema. The release
# above migrates its CRM at start-up and cannot run against a CRM a later revision has migrated:
# expand/contract covers the one release before, as the migrations' docstring says.
PREVIOUS_SCHEMA_RELEASE = "7776b00f20da61aca1875a7b2cc772692a7efe33"


def previous_release(dest: Path, ref: str = PREVIOUS_RELEASE) -> Path | None:
    """Release ``ref``'s code from this repository's git history, laid out under ``dest`` as its
    installed ``mlpair`` package would be (``dest/package`` for ``PYTHONPATH``; its ``config/``
    under ``dest/source``). Returns ``dest``, or None when git or that commit is not available
    (a clone without history)."""
    import shutil

    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{ref}^{{commit}}"],
                                                     capture_output=True).returncode != 0:
        return None
    source, package = dest / "source", dest / "package"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "mlpair", "services", "config"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{ref}:training"], capture_output=True).returncode == 0:
        old = subprocess.run(["git", "-C", str(REPO), "archive", ref, "training"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=old, check=True)
    assemble_package(source, package)
    return dest


def assemble_package(source: Path, package: Path) -> None:
    """A checkout's ``mlpair`` package as one folder under ``package``, in either layout: the
    namespace package's portions (``mlpair/``, ``services/*/mlpair/``) merged, or, for a release
    before that layout, ``services/inference``, ``services/prediction`` and ``training`` copied to
    their import paths."""
    import shutil

    shutil.copytree(source / "mlpair", package / "mlpair")
    if (source / "services" / "prediction" / "mlpair").is_dir():
        for service in ("inference", "prediction"):
            shutil.copytree(source / "services" / service / "mlpair", package / "mlpair", dirs_exist_ok=True)
        return
    for folder, name in (("services/prediction", "prediction"), ("services/inference", "inference"),
                         ("training", "training")):
        shutil.copytree(source / folder, package / "mlpair" / name)


def asyncpg_dsn(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as the DSN asyncpg takes (no driver suffix)."""
    from sqlalchemy import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
