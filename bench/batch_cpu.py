"""PredictionService's CPU per BatchPredict row, measured in one process (no network, no client).

A benchmark, not a test: it reports numbers and asserts no speed.

The real :class:`~mlpair.prediction.intake.servicer.PredictionServicer` and
:class:`~mlpair.prediction.pipeline.Predictor` (as ``build_components`` wires them: cache,
coalescing, the shared decision ledger and its relay to a CRM database, both in a throw-away
PostgreSQL database when one is up, else SQLite files with ``synchronous=NORMAL``) with one thing
replaced: InferenceService is a fake client that answers with a fixed linear model of the
features, so the process's CPU time is PredictionService's own work. Requests are real holdout
applicants, each row distinct (every row a cache miss), serialised as BatchPredict requests and
parsed back as gRPC would. ``--concurrency`` calls are in flight at a time.

The figure is ``time.process_time()`` (every thread of the process: the event loop, the
ledger's and the relay's database drivers) from the first measured call until the relay has
delivered every decision to the CRM, divided by the rows decided: **CPU µs per row**, with the
garbage collector's share. Other processes on a shared machine move it much less than rows/s,
but still by about ±10%: compare interleaved runs. The collector is tuned as ``serve()`` tunes
it (``--no-gc-tuning`` to skip). ``--profile FILE`` writes a cProfile of the event loop thread
for one extra pass.

``--relay-process`` measures the other deployment: this process records with the relay off
(``relay_in_process=False``) and a ``mlpair relay`` subprocess delivers. Each pass then reports
this process's CPU per row (``cpu_us_per_row``: deciding, recording and polling the backlog until
it is empty) and, separately, the subprocess's (``relay_process_cpu_us_per_row``: its user +
system CPU time across the same pass, its idle polls of the ledger included; see
:class:`RelayProcess` for the clock). In
``--stages`` mode the relay subprocess is paused (SIGSTOP) while the pass decides, then resumed,
and the "relay" line is its CPU delivering that pass.

With a PostgreSQL ledger each pass also reports ``postgres_cpu_us_per_row``: the CPU of every
process of the local PostgreSQL server across the pass (:class:`PostgresCpu`; nothing else may
use that server meanwhile), per row decided: what a durable decision costs the database, the
ledger's commit, the relay's claim and the CRM's insert together. The ``--stages`` pass splits
it into the database's CPU while deciding (the ledger's commits) and while delivering.

``--event-loop`` picks the loop the service and the relay subprocess run on (PredictionService's
default, else ``asyncio``): interleave both to see what the loop itself costs.

    .venv/bin/python bench/batch_cpu.py --calls 40 --repeats 3
    .venv/bin/python bench/batch_cpu.py --calls 40 --repeats 3 --relay-process
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlpair.commands.serve import run_loop  # noqa: E402
from mlpair.prediction.settings import PredictionSettings  # noqa: E402
from tests.support import pair as harness  # noqa: E402


class FakeInference:
    """Stands in for :class:`~mlpair.prediction.scoring.client.InferenceClient`: logits
    ``[batch, 2] float32`` of a fixed random linear model; ``calls`` and ``rows`` count the work."""

    def __init__(self, n_features: int) -> None:
        import numpy as np

        rng = np.random.default_rng(7)
        self.weights = rng.normal(0.0, 0.6, size=(n_features, 2)).astype(np.float32)
        self.calls = self.rows = 0

    async def infer(self, target, features, *, timeout_s=None, callers=(), priority=0):
        self.calls += 1
        self.rows += len(features)
        return features @ self.weights, target.version

    async def ready(self, timeout_s: float) -> bool:
        return True

    async def close(self) -> None:
        return None


def with_fake_inference(server, settings, fake):
    """(the predictor, what holds its recorder and scorer) with ``fake`` under the scoring chain:
    through the composition root where the release has one, else planted where older releases
    (an A/B baseline) keep their client."""
    try:
        from mlpair.prediction.composition import build_components
    except ImportError:  # a release before the composition root
        predictor = server.build_predictor(settings)
        predictor.scorer.client = predictor.scorer.coalescer.client = predictor.inference = fake
        return predictor, predictor
    components = build_components(settings, inference=fake)
    return components.predictor, components


def request_reader():
    """The request's bytes → what the served BatchPredict handler gets: the items read from the
    bytes where the release registers a reader (``converters.read_batch_request``), else the
    strict parse the server makes (``mlpair.wire.parse_strictly``), so releases compare alike."""
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.prediction.intake import converters
    from mlpair.wire import parse_strictly

    strict = parse_strictly(pb.BatchPredictRequest.FromString)
    read = getattr(converters, "read_batch_request", None)
    if read is None:
        return strict
    return lambda data: read(data) or strict(data)


def wire_form(reply) -> bytes:
    """A servicer's reply as gRPC sends it: a ``Serialized`` response's bytes as they are, else
    the message serialised (the harness measures releases before the written responses too)."""
    data = getattr(reply, "data", None)
    return data if isinstance(data, bytes) else reply.SerializeToString()


class _GcTimer:
    """CPU seconds spent in the garbage collector (any thread) since :meth:`reset`, and (runs, CPU ms) per generation."""

    def __init__(self) -> None:
        import gc

        self.seconds, self.runs, self._started = 0.0, {}, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started
            runs, ms = self.runs.get(info["generation"], (0, 0.0))
            self.runs[info["generation"]] = (runs + 1, round(ms + 1000 * (time.thread_time() - self._started), 1))

    def reset(self) -> None:
        self.seconds, self.runs = 0.0, {}

    def close(self) -> None:
        import gc

        gc.callbacks.remove(self._callback)


class _StageTimer:
    """CPU seconds (``time.thread_time``) per named stage, each exclusive of the stages it calls.

    Wraps functions and methods in place (:meth:`wrap`); meant for one call in flight at a time,
    with the relay paused, so that the CPU between entering and leaving a stage is that stage's.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []  # [stage, thread_time when last resumed]
        self.enabled = False  # only the --stages pass: a clock read costs CPU of its own

    def _enter(self, stage: str) -> None:
        now = time.thread_time()
        if self._stack:
            parent = self._stack[-1]
            self.seconds[parent[0]] = self.seconds.get(parent[0], 0.0) + now - parent[1]
        self._stack.append([stage, now])

    def _leave(self) -> None:
        now = time.thread_time()
        stage, resumed = self._stack.pop()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - resumed
        if self._stack:
            self._stack[-1][1] = now

    def wrap(self, stage: str, owner, name: str) -> bool:
        """Times ``owner.name`` as ``stage`` (False when there is no such attribute)."""
        import functools
        import inspect

        original = getattr(owner, name, None)
        if original is None:
            return False
        if inspect.iscoroutinefunction(original):
            async def timed(*args, **kwargs):
                self._enter(stage)
                try:
                    return await original(*args, **kwargs)
                finally:
                    self._leave()
        else:
            def timed(*args, **kwargs):
                self._enter(stage)
                try:
                    return original(*args, **kwargs)
                finally:
                    self._leave()
        setattr(owner, name, functools.wraps(original)(timed))
        return True

    def timed(self, stage: str):
        import contextlib

        if not self.enabled:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def block():
            self._enter(stage)
            try:
                yield
            finally:
                self._leave()
        return block()


# (stage, module, attribute path): the functions each stage is made of, in this release or the
# previous one (absent ones are skipped), so one table compares both.
STAGES = (
    ("attribute conversion", "mlpair.prediction.intake.converters", "batch_inputs"),
    ("attribute conversion", "mlpair.prediction.intake.tables", "read_chunk"),
    ("assembly and guards", "mlpair.contracts.assembly", "FeatureAssembler.assemble"),
    ("assembly and guards", "mlpair.prediction.preparing.columns", "ColumnAssembler.assemble"),
    ("assembly and guards", "mlpair.prediction.preparing.columns", "ColumnAssembler.guards"),
    ("assembly and guards", "mlpair.contracts.columns", "ColumnAssembler.assemble"),
    ("assembly and guards", "mlpair.contracts.columns", "ColumnAssembler.guards"),
    ("ids and fingerprints", "mlpair.prediction.pipeline", "request_fingerprint"),
    ("ids and fingerprints", "mlpair.prediction.preparing.batch", "request_fingerprint"),
    ("ids and fingerprints", "mlpair.prediction.pipeline", "Predictor._prepare"),
    ("ids and fingerprints", "mlpair.prediction.pipeline", "admit"),
    ("ids and fingerprints", "mlpair.prediction.pipeline", "prepare"),
    ("ids and fingerprints", "mlpair.prediction.preparing.batch", "request_fingerprints"),
    ("scoring (cache, calibration)", "mlpair.prediction.pipeline", "Predictor._score"),
    ("scoring (cache, calibration)", "mlpair.prediction.pipeline", "score_groups"),
    ("decision and record", "mlpair.prediction.pipeline", "decide_columns"),
    ("decision and record", "mlpair.prediction.pipeline", "Predictor._record"),
    ("decision and record", "mlpair.prediction.pipeline", "decide"),
    ("decision and record", "mlpair.prediction.recording.audit", "AuditRecords.records"),
    ("drift and signals", "mlpair.prediction.monitoring.drift", "DriftMonitors.observe"),
    ("drift and signals", "mlpair.prediction.monitoring.drift", "DriftMonitors.observe_many"),
    ("ledger commit", "mlpair.prediction.recording.ledger", "DecisionLedger.record_many"),
    ("response", "mlpair.prediction.intake.converters", "batch_response"),
    ("response", "mlpair.prediction.intake.tables", "write_decisions"),
)


def wrap_stages(timer: _StageTimer) -> list[str]:
    import importlib

    wrapped = []
    for stage, module_name, path in STAGES:
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is not None and timer.wrap(stage, owner, name):
            wrapped.append(f"{module_name}.{path}")
    return wrapped


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the servicer reads."""

    def time_remaining(self):
        return 30.0

    def invocation_metadata(self):  # no caller identity, no priority: the defaults
        return ()

    def auth_context(self):
        return {}


class RelayProcess:
    """A ``mlpair relay`` subprocess over the bench's ledger and CRM, and its CPU time.

    The CPU time is the process's CPU-time clock (``clock_getcpuclockid``, nanoseconds, every
    thread) where the C library has one, else psutil's user + system times, counted in clock ticks
    of 10 ms: 2 µs per row on a pass of 5,000 rows, too coarse for the --stages line.
    """

    def __init__(self, process: subprocess.Popen) -> None:
        import ctypes
        import ctypes.util

        import psutil

        self.process = process
        self._ps = psutil.Process(process.pid)
        self._clock: int | None = None
        try:
            clock = ctypes.c_int()
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            if libc.clock_getcpuclockid(process.pid, ctypes.byref(clock)) == 0:
                self._clock = clock.value
        except (OSError, AttributeError):  # no such C function here: psutil's ticks
            pass

    def cpu_s(self) -> float:
        """User + system CPU seconds the subprocess has used so far (all its threads)."""
        if self._clock is not None:
            return time.clock_gettime(self._clock)
        times = self._ps.cpu_times()
        return times.user + times.system

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)


class PostgresCpu:
    """CPU seconds of the local PostgreSQL server's processes (every backend, the WAL writer, the
    checkpointer, …: psutil's user + system times, ticks of 10 ms each), to price what a row costs
    the database besides the service. Only meaningful with nothing else using that server; a
    process that exits between two readings takes its CPU with it (the ledger's and the relay's
    pooled connections stay open for the whole run)."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil

    def read(self) -> dict[int, float]:
        """User + system CPU seconds of each PostgreSQL process, by PID."""
        seconds = {}
        for process in self._psutil.process_iter(["name"]):
            if (process.info["name"] or "").startswith("postgres"):
                with contextlib.suppress(self._psutil.Error):
                    times = process.cpu_times()
                    seconds[process.pid] = times.user + times.system
        return seconds

    @staticmethod
    def between(before: dict[int, float], after: dict[int, float]) -> float:
        """CPU seconds used between two readings by the processes alive at the second."""
        return sum(s - before.get(pid, 0.0) for pid, s in after.items())


@contextlib.contextmanager
def relay_process(crm_url: str, ledger_url: str, event_loop: str) -> Iterator[RelayProcess]:
    """``mlpair relay`` on ``event_loop`` until ready (its health port SERVING), stopped by SIGTERM (by its PID) on the way out.

    Raises:
        RuntimeError: it exited or was not ready within 60 s.
    """
    from mlpair.client.health import wait_until_serving

    port = harness.free_port()
    env = {**os.environ, "PREDICTION_LEDGER_URL": ledger_url, "PREDICTION_CRM_URL": crm_url,
           "PREDICTION_LEDGER_SYNCHRONOUS": "NORMAL", "PREDICTION_HOST": "127.0.0.1",
           "PREDICTION_RELAY_PORT": str(port), "PREDICTION_RELAY_METRICS_PORT": "0", "PREDICTION_LOG_LEVEL": "WARNING",
           "PREDICTION_EVENT_LOOP": event_loop}
    process = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "relay"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        if not wait_until_serving(f"127.0.0.1:{port}", 60, lambda: process.poll() is None):
            raise RuntimeError(f"mlpair relay was not ready: {process.stderr.read().decode()[-2000:]}")
        yield RelayProcess(process)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)  # in case a --stages pass left it paused
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
        process.stderr.close()


async def measure(args, crm_url: str, ledger_url: str, workdir: Path, relay: RelayProcess | None = None,
                  gate: Callable[[dict | None], Awaitable[bool]] | None = None) -> dict:
    """Sets the service up, runs the passes and returns the figures. ``gate``, when given, decides
    when each pass runs instead of ``--repeats``: it is awaited with the last pass's figures (None
    before the first) and answers whether another pass runs (``bench/ab_lockstep.py``)."""
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.client import to_attributes
    from mlpair.collector import tune_collector
    from mlpair.prediction import server
    from mlpair.prediction.intake.servicer import PredictionServicer
    from mlpair.prediction.settings import PredictionSettings

    root = Path(args.model_repository).resolve()
    entry = harness.trained_model(root)
    settings = PredictionSettings(
        model_repository=root, config_dir=harness.CONFIG_DIR, model_name=harness.MODEL, crm_url=crm_url,
        ledger_url=ledger_url, ledger_synchronous="NORMAL", cache_backend=args.cache,
        relay_in_process=relay is None)
    fake = FakeInference(entry.preprocessing.n_features)
    predictor, parts = with_fake_inference(server, settings, fake)
    await parts.recorder.start()
    servicer = PredictionServicer(predictor)
    context = _Context()

    workload = harness.credit_workload(entry, f"cpu-{workdir.name}")
    total_calls = args.warmup_calls + args.calls * (args.repeats + bool(args.profile) + bool(args.stages))
    payloads = []
    for _ in range(total_calls):
        chunk = list(itertools.islice(workload, args.batch_items))
        items = [pb.PredictRequest(request_id=rid, entity_id=eid, model_name=harness.MODEL, attributes=to_attributes(a))
                 for rid, eid, a in chunk]
        if args.rpc == "columns":  # the same applicants as one PredictColumns chunk (Arrow columns)
            import pyarrow as pa

            from mlpair.client.tables import to_ipc

            table = pa.Table.from_pylist([{"request_id": rid, "entity_id": eid, **a} for rid, eid, a in chunk])
            payloads.append(pb.PredictColumnsRequest(model_name=harness.MODEL, arrow_ipc=to_ipc(table))
                            .SerializeToString())
            continue
        payloads.append(items[0].SerializeToString() if args.rpc == "predict"
                        else pb.BatchPredictRequest(requests=items).SerializeToString())
    queue = iter(payloads)

    stages = _StageTimer()
    read_request = request_reader()

    async def one(raw: bytes) -> int:
        if args.rpc == "columns":  # what the servicer does per chunk of the stream
            from mlpair.prediction.intake import tables

            chunk_reply = await tables.decide_chunk(
                predictor, pb.PredictColumnsRequest.FromString(raw), args.batch_items, None)
            replies.append(chunk_reply.SerializeToString())
            return args.batch_items
        if args.rpc == "predict":
            reply = await servicer.Predict(pb.PredictRequest.FromString(raw), context)
            return len(reply.SerializeToString()) and 1
        with stages.timed("parse request"):
            request = read_request(raw)
        with stages.timed("servicer and pipeline glue"):  # less the stages timed inside it
            reply = await servicer.BatchPredict(request, context)
            with stages.timed("response"):
                replies.append(wire_form(reply))  # what grpc sends; checked after the pass (check_replies)
        return len(request.items if hasattr(request, "items") else request.requests)

    replies: list[bytes] = []

    def check_replies(rows: int) -> None:
        """Every reply since the last check holds one decision per item, ``rows`` in all (parsed
        here, after the pass's CPU was read: checking is the harness's work, not the service's)."""
        results = 0
        for raw_reply in replies:
            if args.rpc == "columns":
                from mlpair.client.tables import chunk_result

                result = chunk_result(pb.PredictColumnsResponse.FromString(raw_reply))
                if result.error is not None or result.failed:
                    raise RuntimeError(f"a chunk failed: {result.error or result.failed}")
                results += result.decided
                continue
            reply = pb.BatchPredictResponse.FromString(raw_reply)
            errors = [r.error for r in reply.results if r.WhichOneof("outcome") != "prediction"]
            if errors:
                raise RuntimeError(f"{len(errors)} item errors in one call, the first: {errors[0].message}")
            results += len(reply.results)
        replies.clear()
        if args.rpc != "predict" and results != rows:
            raise RuntimeError(f"{results} results for {rows} items")

    async def drive(calls: int, deliver: bool = True) -> int:
        rows = 0
        remaining = iter(itertools.islice(queue, calls))
        while batch := list(itertools.islice(remaining, args.concurrency)):
            rows += sum(await asyncio.gather(*(one(raw) for raw in batch)))
        if deliver and not await parts.recorder.wait_delivered(60):
            raise RuntimeError("the relay did not deliver every decision within 60 s")
        return rows

    gc_time = _GcTimer()
    if not args.no_gc_tuning:
        tune_collector()  # as serve() does once the service is up (the payloads with it)
    check_replies(await drive(args.warmup_calls))
    relay_cpu_start = relay.cpu_s() if relay else 0.0
    postgres_cpu = PostgresCpu() if ledger_url.startswith("postgresql") else None
    passes: list[dict] = []
    while await gate(passes[-1] if passes else None) if gate else len(passes) < args.repeats:
        gc_time.reset()
        relay_cpu0 = relay.cpu_s() if relay else 0.0
        postgres0 = postgres_cpu.read() if postgres_cpu else {}
        cpu0, wall0 = time.process_time(), time.perf_counter()
        rows = await drive(args.calls)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        postgres_s = postgres_cpu.between(postgres0, postgres_cpu.read()) if postgres_cpu else None
        check_replies(rows)
        passes.append({"rows": rows, "cpu_us_per_row": round(1e6 * cpu / rows, 2), "wall_s": round(wall, 3),
                       "gc_us_per_row": round(1e6 * gc_time.seconds / rows, 2), "gc_runs": gc_time.runs})
        if postgres_s is not None:
            passes[-1]["postgres_cpu_us_per_row"] = round(1e6 * postgres_s / rows, 2)
        if relay:
            passes[-1]["relay_process_cpu_us_per_row"] = round(1e6 * (relay.cpu_s() - relay_cpu0) / rows, 2)
    gc_time.close()
    relay_cpu_all = relay.cpu_s() - relay_cpu_start if relay else 0.0
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        rows = await drive(args.calls)
        profiler.disable()
        check_replies(rows)
        profiler.dump_stats(args.profile)
    breakdown = await stage_breakdown(args, parts, stages, drive, relay, postgres_cpu) if args.stages else None
    if breakdown:
        check_replies(breakdown["rows"])
    await parts.recorder.close()
    await parts.scorer.close()
    figures = sorted(p["cpu_us_per_row"] for p in passes) or [None]
    relay_figures = sorted(p["relay_process_cpu_us_per_row"] for p in passes) if relay else []
    postgres_figures = sorted(p["postgres_cpu_us_per_row"] for p in passes if "postgres_cpu_us_per_row" in p)
    return {"bench": "batch_cpu", "rpc": args.rpc, "batch_items": args.batch_items, "concurrency": args.concurrency,
            "calls_per_pass": args.calls, "cache": args.cache, "crm": crm_url.split(":", 1)[0],
            "ledger": ledger_url.split(":", 1)[0], "relay": "process" if relay else "in process",
            "cpu_us_per_row_median": figures[len(figures) // 2], "cpu_us_per_row_min": figures[0],
            **({"relay_process_cpu_us_per_row_median": relay_figures[len(relay_figures) // 2],
                "relay_process_cpu_us_per_row_all_passes": round(1e6 * relay_cpu_all / sum(p["rows"] for p in passes), 2)}
               if relay and passes else {}),
            **({"postgres_cpu_us_per_row_median": postgres_figures[len(postgres_figures) // 2]} if postgres_figures else {}),
            "passes": passes, "infer_calls": fake.calls, **({"stages_us_per_row": breakdown} if breakdown else {})}


async def stage_breakdown(args, predictor, stages: _StageTimer, drive, relay_process: RelayProcess | None,
                          postgres_cpu: PostgresCpu | None) -> dict:
    """CPU µs per row of each stage over one more pass: one call in flight, the relay paused while
    deciding and then timed alone delivering the pass's decisions (with ``relay_process``, the
    subprocess is paused by SIGSTOP and its own CPU is the relay's line); "rest" is what no stage
    covers (the event loop, the servicer's glue, metrics)."""
    wrapped = wrap_stages(stages)
    stages.enabled = True
    relay = predictor.recorder.relay
    if relay_process:
        relay_process.pause()
    else:
        await relay.stop()
    concurrency, args.concurrency = args.concurrency, 1
    stages.seconds.clear()
    postgres0 = postgres_cpu.read() if postgres_cpu else {}
    cpu0 = time.process_time()
    rows = await drive(args.calls, deliver=False)
    decide_cpu = time.process_time() - cpu0
    postgres1 = postgres_cpu.read() if postgres_cpu else {}
    if relay_process:
        cpu0 = relay_process.cpu_s()
        relay_process.resume()
    else:
        cpu0 = time.process_time()
        relay.start()
    if not await predictor.recorder.wait_delivered(120):
        raise RuntimeError("the relay did not deliver every decision within 120 s")
    relay_cpu = (relay_process.cpu_s() if relay_process else time.process_time()) - cpu0
    postgres2 = postgres_cpu.read() if postgres_cpu else {}
    args.concurrency = concurrency
    table = {stage: round(1e6 * seconds / rows, 2) for stage, seconds in stages.seconds.items()}
    table["rest"] = round(1e6 * (decide_cpu - sum(stages.seconds.values())) / rows, 2)
    table["relay (ledger → CRM)" + (", relay process" if relay_process else "")] = round(1e6 * relay_cpu / rows, 2)
    table["total"] = round(1e6 * (decide_cpu + relay_cpu) / rows, 2)
    if postgres_cpu:  # the database's side of the same two steps
        table["PostgreSQL while deciding (ledger commits)"] = round(1e6 * postgres_cpu.between(postgres0, postgres1) / rows, 2)
        table["PostgreSQL while delivering (claims, CRM writes)"] = round(1e6 * postgres_cpu.between(postgres1, postgres2) / rows, 2)
    return {"rows": rows, "concurrency": 1, "wrapped": wrapped, "us_per_row": table}


def migrate(crm_url: str, ledger_url: str) -> None:
    """``mlpair migrate`` for both databases, as the pre-deploy job does."""
    import subprocess

    subprocess.run([sys.executable, "-m", "mlpair.cli", "migrate", "--ledger-url", ledger_url, "--crm-url", crm_url],
                   check=True, capture_output=True, timeout=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--batch-items", type=int, default=500, help="applicants per BatchPredict call")
    parser.add_argument("--concurrency", type=int, default=4, help="BatchPredict calls in flight")
    parser.add_argument("--rpc", choices=("batch", "predict", "columns"), default="batch",
                        help="the RPC measured: BatchPredict, Predict (one applicant per call; --batch-items 1), or "
                             "PredictColumns (one chunk of --batch-items rows per call)")
    parser.add_argument("--calls", type=int, default=40, help="measured calls per pass")
    parser.add_argument("--repeats", type=int, default=3, help="measured passes")
    parser.add_argument("--warmup-calls", type=int, default=8)
    parser.add_argument("--cache", default="memory", choices=["memory", "off"])
    parser.add_argument("--sqlite", action="store_true", help="SQLite ledger and CRM even when PostgreSQL is up")
    parser.add_argument("--no-gc-tuning", action="store_true", help="skip serve()'s tune_collector() after start-up")
    parser.add_argument("--profile", help="write a cProfile of one extra pass to this file")
    parser.add_argument("--stages", action="store_true",
                        help="one extra pass, one call at a time, timing each stage (CPU µs per row)")
    parser.add_argument("--relay-process", action="store_true",
                        help="the relay off in this process, a `mlpair relay` subprocess delivering: its CPU per row "
                             "reported separately")
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"),
                        default=PredictionSettings.model_fields["event_loop"].default,
                        help="the event loop the service runs on (default: PredictionService's)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rpc == "predict" and args.batch_items != 1:
        parser.error("--rpc predict sends one applicant per call: use --batch-items 1")
    return args


def run(args: argparse.Namespace, gate: Callable[[dict | None], Awaitable[bool]] | None = None) -> dict:
    """A throw-away ledger and CRM (PostgreSQL when up), the relay as asked, then :func:`measure`."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="batch-cpu-") as tmp, harness.scratch_postgres() as pg_url:
        postgres = pg_url is not None and not args.sqlite
        crm_url = pg_url if postgres else f"sqlite+aiosqlite:///{tmp}/crm.sqlite"
        ledger_url = pg_url if postgres else f"sqlite+aiosqlite:///{tmp}/ledger.sqlite"
        migrate(crm_url, ledger_url)
        with relay_process(crm_url, ledger_url, args.event_loop) if args.relay_process else contextlib.nullcontext() as relay:
            figures = run_loop(measure(args, crm_url, ledger_url, Path(tmp), relay, gate), args.event_loop)
    return {"event_loop": args.event_loop, **figures}


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
