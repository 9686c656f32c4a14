"""``make bench``: InferenceService side by side with real peers, one load generator, one run.

A benchmark, not a test: it reports numbers and asserts none. Steps:

1. the credit-risk model is trained into the repository (or the latest entry reused) and a
   compute-heavy variant (:mod:`heavy_model`) is written beside a copy of it under
   ``var/bench/models``; the real holdout applicants are the rows every server gets;
2. cold start of InferenceService to SERVING (process start → ``grpc.health.v1`` SERVING),
   measured ``--cold-starts`` times with nothing else running;
3. each peer gets its own virtualenv under ``var/bench/venvs/<peer>`` from the package
   registry, pinned by ``bench/peers/requirements-<peer>.txt`` (they need protobuf < 7, this
   project 7); a peer that cannot be installed or started is skipped with its reason;
4. every server is started (one after another, each timed to model-ready), serving the SAME
   two ONNX files with the same batching (max batch ``--max-batch-size`` rows, max queue
   delay ``--max-queue-delay-ms``, one model instance, ONNX Runtime on one thread); every
   server's logits for real rows are checked against in-process ONNX Runtime first;
5. measurement, interleaved: in each of ``--rounds`` rounds, for each concurrency, for each
   model, every server in turn gets one point from ``bench/oip_load.py`` (the same load
   generator, its own process); InferenceService and tritonserver also get the same
   single-row requests, at the same concurrency, over one ``ModelStreamInfer`` stream
   (``mlpair-stream``, ``triton-stream``: credit-risk only; ``--no-streaming`` skips them);
6. one JSON line per point, then per server and point the median over the rounds, the
   targets of the issue, streaming against unary, and a table with the ratios ours / peer.

Servers: ``mlpair`` (InferenceService, batching on, one process), ``mlpair-nobatch`` (batching off),
``mlpair-w1`` and ``mlpair-w2`` (batching on, ``--workers`` 1 and 2 under the supervisor, each point's
calls spread over ``--worker-channels`` connections, since the kernel spreads connections, not
calls, over the workers: the gain of a second worker, in the same run),
``null`` (``bench/null_server.py``: a do-nothing grpc.aio OIP server, the Python gRPC ceiling
here), ``pytriton`` (NVIDIA PyTriton 0.7.0), ``triton`` (the tritonserver 2.51 binary inside
the PyTriton wheel with a Python-backend model), ``mlserver`` (Seldon MLServer 1.7.1,
adaptive batching, inference in the server process), ``kserve`` (KServe 0.21 Python model
server; it has no server-side batcher).

Bounded: loopback only; every point is ``--warmup-s + --duration-s`` long; every server is
stopped by PID (its recorded process tree) at the end or on error. Client and servers share
this machine's cores: a figure is client + server CPU per request, and other work running
at the same time shows up as noise (the load average is printed before and after). CPU
microseconds per request (server process tree, client process) are reported beside req/s:
they move much less with other load than req/s does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PEERS = BENCH / "peers"
SCHEMA = REPO / "config" / "credit-risk" / "feature-schema.toml"
MODEL = "credit-risk"
HEAVY = "credit-risk-heavy"
PEER_NAMES = ("pytriton", "triton", "mlserver", "kserve")
STREAMING = ("mlpair", "triton")  # measured over ModelStreamInfer too, as <name>-stream
VENV_OF = {"pytriton": "pytriton", "triton": "pytriton", "mlserver": "mlserver", "kserve": "kserve"}
IMPORT_CHECK = {"pytriton": "import pytriton, onnxruntime", "mlserver": "import mlserver, onnxruntime",
                "kserve": "import kserve, onnxruntime"}


def emit(line: dict, out) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    out.write(text + "\n")
    out.flush()


def say(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- models and rows ------------------------------------------------------------------------------


def prepare_models(repository: Path, bench_models: Path):
    """Trains (or reuses) credit-risk, copies it and writes the heavy variant under ``bench_models``.

    Returns:
        The holdout rows ``[n, n_features] float32``, the feature version and the two
        entries' ``model.onnx`` paths by model name.
    """
    from heavy_model import write_heavy_entry

    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.contracts.manifest import load_entry
    from mlpair.contracts.schema import FeatureSchema
    from mlpair.training.data import load_dataset, stratified_split
    from mlpair.training.pipeline import train_family

    entry, _ = train_family(SCHEMA, repository, show_progress=False)
    target = bench_models / MODEL / entry.manifest.model_version
    if bench_models.exists():
        shutil.rmtree(bench_models)
    shutil.copytree(entry.path, target)
    real = load_entry(target)
    heavy = load_entry(write_heavy_entry(target, bench_models))
    data = load_dataset(FeatureSchema.from_toml(SCHEMA))
    split = stratified_split(data.labels, int(entry.manifest.data_source["split"]["seed"]))
    rows = FeatureAssembler(entry.preprocessing).assemble_many(data.subset(split["holdout"]).records)
    return rows, real.manifest.versions.feature_schema_version, {MODEL: real.model_path, HEAVY: heavy.model_path}


def reference_logits(model_path: Path, rows: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: rows})[0]


# -- peer virtualenvs -----------------------------------------------------------------------------


def ensure_venv(name: str, venvs: Path) -> tuple[Path | None, str]:
    """The peer's virtualenv, created from its pinned requirements if missing or stale.

    Returns:
        (venv path, "") when usable, else (None, the reason).
    """
    requirements = PEERS / f"requirements-{name}.txt"
    venv = venvs / name
    stamp = venv / ".requirements.sha256"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    python = venv / "bin" / "python"
    if not (stamp.is_file() and stamp.read_text() == digest and python.exists()):
        say(f"installing the {name} virtualenv from {requirements.relative_to(REPO)} (first run only; minutes)")
        log = venvs / f"{name}.log"
        venvs.mkdir(parents=True, exist_ok=True)
        base = getattr(sys, "_base_executable", sys.executable)
        with log.open("w") as f:
            steps = [[base, "-m", "venv", "--clear", str(venv)],
                     [str(python), "-m", "pip", "install", "--quiet", "-r", str(requirements)]]
            for step in steps:
                try:
                    done = subprocess.run(step, stdout=f, stderr=subprocess.STDOUT, timeout=900)
                except subprocess.TimeoutExpired:
                    return None, f"installing took over 15 minutes (log: {log})"
                if done.returncode != 0:
                    return None, f"`{' '.join(step[-3:])}` failed with exit {done.returncode} (log: {log})"
        stamp.write_text(digest)
    check = subprocess.run([str(python), "-c", IMPORT_CHECK[name]], capture_output=True, text=True, timeout=120)
    if check.returncode != 0:
        return None, f"its packages do not import: {check.stderr.strip().splitlines()[-1:]}"
    return venv, ""


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


# -- servers --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Server:
    """One OIP gRPC server under test: how to start it and what the load generator sends it."""

    name: str
    batching: str
    models: tuple[str, ...]
    command: list[str]
    env: dict[str, str]
    port: int
    load_args: list[str] = dataclasses.field(default_factory=list)
    channels: int = 1  # connections each point's calls are spread over
    process: subprocess.Popen | None = None
    tree: set[int] = dataclasses.field(default_factory=set)
    log: Path | None = None
    streams: int = 0  # 0: unary ModelInfer; K: the concurrency over K ModelStreamInfer streams

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"


def mlpair_server(name: str, models_root: Path, batching: bool, feature_version: str, args, workers: int = 1,
                  channels: int = 1) -> Server:
    port = free_port()
    env = {"INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
           "INFERENCE_WORKERS": str(workers),
           "INFERENCE_MODEL_REPOSITORY": str(models_root), "INFERENCE_MODELS": json.dumps([MODEL, HEAVY]),
           "INFERENCE_BATCHING": str(batching).lower(), "INFERENCE_MAX_BATCH_SIZE": str(args.max_batch_size),
           "INFERENCE_MAX_QUEUE_DELAY_MS": str(args.max_queue_delay_ms), "INFERENCE_LOG_LEVEL": "WARNING"}
    described = f"dynamic {args.max_batch_size} rows / {args.max_queue_delay_ms:g} ms" if batching else "off"
    if workers > 1 or channels > 1:
        described += f"; {workers} worker(s), {channels} connections"
    return Server(name, described, (MODEL, HEAVY), [sys.executable, "-m", "mlpair.cli", "serve", "inference"],
                  env, port, ["--parameter", f"x-feature-version={feature_version}"], channels=channels)


def null_server() -> Server:
    port = free_port()
    return Server("null", "none (no model: the Python gRPC ceiling)", (MODEL,),
                  [sys.executable, str(BENCH / "null_server.py"), "--port", str(port), "--model", MODEL], {}, port)


def pytriton_server(venv: Path, models: dict[str, Path], run: Path, args) -> Server:
    port = free_port()
    command = [str(venv / "bin" / "python"), str(PEERS / "pytriton_server.py"), "--grpc-port", str(port),
               "--http-port", str(free_port()), "--metrics-port", str(free_port()),
               "--max-batch", str(args.max_batch_size),
               "--max-queue-delay-us", str(int(args.max_queue_delay_ms * 1000)),
               "--workspace", str(run / "pytriton-workspace")]
    for name, path in models.items():
        command += ["--model", f"{name}={path}"]
    # The wheel's Python-backend stub links the system libpython; this interpreter's stdlib needs its own.
    env = {"LD_LIBRARY_PATH": sysconfig.get_config_var("LIBDIR") or ""}
    return Server("pytriton", f"Triton dynamic {args.max_batch_size} rows / {args.max_queue_delay_ms:g} ms",
                  tuple(models), command, env, port)


def triton_server(venv: Path, models: dict[str, Path], run: Path, args) -> Server:
    """tritonserver (from the PyTriton wheel) + a Python-backend model per ONNX file."""
    bundle = site_packages(venv) / "pytriton" / "tritonserver"
    root = run / "triton"
    if root.exists():
        shutil.rmtree(root)
    backend = root / "backends" / "python"
    backend.mkdir(parents=True)
    for item in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy(bundle / "backends" / "python" / item, backend / item)
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy(bundle / "python_backend_stubs" / minor / "triton_python_backend_stub", backend)
    for name, path in models.items():
        folder = root / "repo" / name
        (folder / "1").mkdir(parents=True)
        shutil.copy(PEERS / "triton_python_model.py", folder / "1" / "model.py")
        n_features = int(np.load(run / "rows.npy", mmap_mode="r").shape[1])
        (folder / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: {args.max_batch_size}\n'
            f'input [ {{ name: "features" data_type: TYPE_FP32 dims: [ {n_features} ] }} ]\n'
            'output [ { name: "logits" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
            f'dynamic_batching {{ max_queue_delay_microseconds: {int(args.max_queue_delay_ms * 1000)} }}\n'
            'instance_group [ { count: 1 kind: KIND_CPU } ]\n'
            f'parameters {{ key: "model_path" value: {{ string_value: "{path}" }} }}\n')
    port = free_port()
    command = [str(bundle / "bin" / "tritonserver"), f"--model-repository={root / 'repo'}",
               f"--backend-directory={root / 'backends'}", "--grpc-address=127.0.0.1", f"--grpc-port={port}",
               "--http-address=127.0.0.1", f"--http-port={free_port()}", "--allow-metrics=false",
               "--allow-gpu-metrics=false", "--log-verbose=0", "--strict-readiness=true"]
    # The stub finds its Python through the first `python` on PATH (the peer venv: its numpy and
    # onnxruntime); the copied stub lost its rpath to the wheel's bundled libraries.
    env = {"PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
           "LD_LIBRARY_PATH": f"{sysconfig.get_config_var('LIBDIR')}:{site_packages(venv) / 'nvidia_pytriton.libs'}"}
    return Server("triton", f"Triton dynamic {args.max_batch_size} rows / {args.max_queue_delay_ms:g} ms",
                  tuple(models), command, env, port)


def mlserver_server(venv: Path, models: dict[str, Path], run: Path, args) -> Server:
    root = run / "mlserver"
    if root.exists():
        shutil.rmtree(root)
    port = free_port()
    for name, path in models.items():
        (root / name).mkdir(parents=True)
        (root / name / "model-settings.json").write_text(json.dumps({
            "name": name, "implementation": "mlserver_runtime.OnnxModel", "parameters": {"uri": str(path)},
            "max_batch_size": args.max_batch_size, "max_batch_time": args.max_queue_delay_ms / 1000}))
    # parallel_workers 0: inference inside the server process, MLServer's fastest setting measured here.
    (root / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": free_port(), "grpc_port": port, "metrics_port": free_port(),
        "parallel_workers": 0, "debug": False, "load_models_at_startup": True,
        "model_repository_root": str(root)}))
    return Server("mlserver", f"adaptive {args.max_batch_size} rows / {args.max_queue_delay_ms:g} ms",
                  tuple(models), [str(venv / "bin" / "mlserver"), "start", str(root)],
                  {"PYTHONPATH": str(PEERS)}, port)


def kserve_server(venv: Path, models: dict[str, Path], args) -> Server:
    port = free_port()
    command = [str(venv / "bin" / "python"), str(PEERS / "kserve_server.py"), "--http_port", str(free_port()),
               "--grpc_port", str(port), "--enable_latency_logging", "False"]
    for name, path in models.items():
        command += ["--onnx_model", f"{name}={path}"]
    return Server("kserve", "none (the Python model server has no batcher)", tuple(models), command, {}, port)


# -- process control ------------------------------------------------------------------------------


def start(server: Server, logs: Path) -> None:
    server.log = logs / f"{server.name}.log"
    with server.log.open("w") as log:
        server.process = subprocess.Popen(server.command, env={**os.environ, **server.env}, cwd=REPO,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def record_tree(server: Server) -> None:
    """Remembers the server's descendants (PyTriton and Triton start helpers) to stop them by PID."""
    import psutil

    if server.process is None:
        return
    try:
        root = psutil.Process(server.process.pid)
        server.tree |= {root.pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        pass


def stop(server: Server) -> None:
    """SIGTERM to the server, then to any recorded descendant still alive; SIGKILL after a grace."""
    import psutil

    if server.process is None:
        return
    record_tree(server)
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(20)
    alive = []
    for pid in server.tree - {server.process.pid}:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            p.terminate()
            alive.append(p)
    _, alive = psutil.wait_procs(alive, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(5)


def wait_ready(server: Server, timeout_s: float) -> float:
    """Seconds from process start until every model is ready (OIP ModelReady).

    Raises:
        RuntimeError: the process exited or the models were not ready in time.
    """
    import grpc

    from mlpair.api.oip import grpc_predict_v2_pb2 as oip
    from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    started = time.monotonic()
    with grpc.insecure_channel(server.url) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        pending = list(server.models)
        while pending:
            if server.process.poll() is not None:
                raise RuntimeError(f"exited with code {server.process.returncode} (log: {server.log})")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{pending} not ready after {timeout_s:.0f} s (log: {server.log})")
            with contextlib.suppress(grpc.RpcError):
                if stub.ModelReady(oip.ModelReadyRequest(name=pending[0]), timeout=1).ready:
                    pending.pop(0)
                    continue
            time.sleep(0.05)
    return time.monotonic() - started


def check_answers(server: Server, rows: np.ndarray, expected: dict[str, np.ndarray], n: int = 16) -> float:
    """Largest |logit − in-process ONNX Runtime logit| over ``n`` real rows sent one per call."""
    import grpc
    from oip_load import output_array

    from mlpair.api.oip import grpc_predict_v2_pb2 as oip
    from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    params = {}
    if server.load_args:
        key, _, value = server.load_args[1].partition("=")
        params[key] = oip.InferParameter(string_param=value)
    worst = 0.0
    with grpc.insecure_channel(server.url) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        for model in server.models:
            for i in range(n):
                row = np.ascontiguousarray(rows[i:i + 1], "<f4")
                tensor = oip.ModelInferRequest.InferInputTensor(name="features", datatype="FP32",
                                                                shape=[1, rows.shape[1]])
                reply = stub.ModelInfer(oip.ModelInferRequest(model_name=model, inputs=[tensor], parameters=params,
                                                              raw_input_contents=[row.tobytes()]), timeout=10)
                got = output_array(reply)
                worst = max(worst, float(np.abs(got - expected[model][i:i + 1]).max()))
    return worst


# -- cold start -----------------------------------------------------------------------------------


def cold_start(models_root: Path, runs: int) -> list[float]:
    """Seconds from ``mlpair serve inference`` process start to grpc.health.v1 SERVING, per run."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    seconds = []
    for _ in range(runs):
        port = free_port()
        env = {**os.environ, "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_WORKERS": "1",
               "INFERENCE_METRICS_PORT": "0", "INFERENCE_MODEL_REPOSITORY": str(models_root),
               "INFERENCE_MODELS": json.dumps([MODEL]), "INFERENCE_LOG_LEVEL": "WARNING"}
        started = time.monotonic()
        process = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "inference"], env=env, cwd=REPO,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    if process.poll() is not None or time.monotonic() - started > 60:
                        raise RuntimeError("InferenceService did not reach SERVING")
                    with contextlib.suppress(grpc.RpcError):
                        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    time.sleep(0.005)
            seconds.append(time.monotonic() - started)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
    return seconds


# -- measuring ------------------------------------------------------------------------------------


def measure(server: Server, model: str, concurrency: int, rows_file: Path, args) -> dict:
    record_tree(server)
    cmd = [sys.executable, str(BENCH / "oip_load.py"), "--url", server.url, "--model", model,
           "--rows-file", str(rows_file), "--concurrency", str(concurrency), "--duration-s", str(args.duration_s),
           "--warmup-s", str(args.warmup_s), "--ready-timeout-s", "10", "--label", server.name, *server.load_args,
           "--streams", str(server.streams), "--channels", str(server.channels)]
    if server.process is not None:
        cmd += ["--server-pid", str(server.process.pid)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.warmup_s + args.duration_s + 90)
    if done.returncode != 0 or not done.stdout.strip():
        return {"label": server.name, "model": model, "concurrency": concurrency,
                "failed": (done.stderr.strip() or f"exit {done.returncode}")[-400:]}
    line = json.loads(done.stdout.strip().splitlines()[-1])
    return {"label": server.name, "batching": server.batching, **{k: v for k, v in line.items() if k != "label"}}


def merge_rounds(lines: list[dict]) -> dict:
    """One point from its rounds: medians of req/s, latencies and CPU per request; every round kept."""
    ok = [line for line in lines if "failed" not in line]
    if not ok:
        return lines[-1]
    out = {k: v for k, v in ok[0].items() if k in ("label", "batching", "model", "concurrency", "rows_per_request")}
    for key in ("requests_per_s", "p50_ms", "p99_ms", "server_cpu_pct", "client_cpu_pct"):
        values = [line[key] for line in ok if line.get(key) is not None]
        if values:
            out[key] = round(statistics.median(values), 3)
    for side in ("server", "client"):
        per_request = [line[f"{side}_cpu_pct"] * 1e4 / line["requests_per_s"] for line in ok
                       if line.get(f"{side}_cpu_pct") and line.get("requests_per_s")]
        if per_request:
            out[f"{side}_cpu_us_per_request"] = round(statistics.median(per_request), 1)
    out["rounds_requests_per_s"] = [line["requests_per_s"] for line in ok]
    out["errors"] = sum(line.get("errors", 0) for line in ok)
    out["failed_rounds"] = len(lines) - len(ok)
    return out


def table(results: dict, servers: list[Server], concurrencies: list[int], models: list[str]) -> str:
    """Markdown table: req/s, p50, p99 per server and point, and ours / peer ratios."""
    lines = ["| model | conc | server | batching | req/s | p50 ms | p99 ms | server µs CPU/req | client µs CPU/req "
             "| mlpair ÷ server (req/s) | mlpair p99 ÷ server p99 |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model in models:
        for c in concurrencies:
            ours = results.get(("mlpair", model, c), {})
            for server in servers:
                r = results.get((server.name, model, c))
                if r is None:
                    continue
                if "failed" in r:
                    lines.append(f"| {model} | {c} | {server.name} | {server.batching} | failed | | | | | | |")
                    continue
                ratio = p99_ratio = ""
                if server.name != "mlpair" and ours.get("requests_per_s") and r.get("requests_per_s"):
                    ratio = f"{ours['requests_per_s'] / r['requests_per_s']:.2f}"
                    if ours.get("p99_ms") and r.get("p99_ms"):
                        p99_ratio = f"{ours['p99_ms'] / r['p99_ms']:.2f}"
                lines.append(f"| {model} | {c} | {server.name} | {server.batching} | {r['requests_per_s']:,.0f} "
                             f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r.get('server_cpu_us_per_request', '')} "
                             f"| {r.get('client_cpu_us_per_request', '')} | {ratio} | {p99_ratio} |")
    return "\n".join(lines)


def cpu_ratio(other: dict, ours: dict) -> float | None:
    """(client + server CPU µs per request of ``other``) ÷ (the same of ``ours``)."""
    keys = ("server_cpu_us_per_request", "client_cpu_us_per_request")
    if not all(other.get(k) and ours.get(k) for k in keys):
        return None
    return round(sum(other[k] for k in keys) / sum(ours[k] for k in keys), 3)


def stream_view(server: Server) -> Server:
    """The same running server, measured over one ModelStreamInfer stream (credit-risk only)."""
    return dataclasses.replace(server, name=f"{server.name}-stream", batching=f"{server.batching}; 1 stream",
                               models=(MODEL,), streams=1)


def streaming_summary(results: dict, concurrencies: list[int]) -> dict:
    """Per server and concurrency: stream ÷ unary req/s, and server + client µs CPU per request of each."""
    out: dict = {"label": "streaming vs unary", "model": MODEL, "rows_per_request": 1}
    for name in STREAMING:
        for c in concurrencies:
            unary, stream = results.get((name, MODEL, c), {}), results.get((f"{name}-stream", MODEL, c), {})
            if not unary.get("requests_per_s") or not stream.get("requests_per_s"):
                continue
            out[f"{name} c{c}"] = {
                "unary_req_s": unary["requests_per_s"], "stream_req_s": stream["requests_per_s"],
                "stream_vs_unary_req_s": round(stream["requests_per_s"] / unary["requests_per_s"], 2),
                "unary_p99_ms": unary.get("p99_ms"), "stream_p99_ms": stream.get("p99_ms"),
                "server_us_per_request": [unary.get("server_cpu_us_per_request"),
                                          stream.get("server_cpu_us_per_request")],
                "client_us_per_request": [unary.get("client_cpu_us_per_request"),
                                          stream.get("client_cpu_us_per_request")]}
    return out


def workers_summary(results: dict, workers: list[int], concurrencies: list[int]) -> dict:
    """Per model and concurrency: req/s, p99 and server CPU per request of mlpair-w<N>, by N."""
    out: dict = {"label": "InferenceService by workers"}
    for model in (MODEL, HEAVY):
        for c in concurrencies:
            points = {n: results.get((f"mlpair-w{n}", model, c), {}) for n in workers}
            if not all(p.get("requests_per_s") for p in points.values()):
                continue
            out[f"{model} c{c}"] = {key: {n: p.get(key) for n, p in points.items()}
                                    for key in ("requests_per_s", "p99_ms", "server_cpu_us_per_request")}
    return out


def targets(results: dict, cold: list[float], top: int) -> dict:
    """The issue's targets, each with the measured figure and whether it was met (None: not measured)."""
    ours = results.get(("mlpair", MODEL, top), {})
    pytriton = results.get(("pytriton", MODEL, top), {})
    null = results.get(("null", MODEL, top), {})

    def ratio(a: dict, b: dict, key: str) -> float | None:
        return round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None

    vs_pytriton, vs_null, p99 = ratio(ours, pytriton, "requests_per_s"), ratio(ours, null, "requests_per_s"), \
        ratio(ours, pytriton, "p99_ms")
    median_cold = round(statistics.median(cold), 3) if cold else None
    return {
        "label": "targets", "concurrency": top, "model": MODEL,
        f"c{top}_vs_pytriton": {"value": vs_pytriton, "target": ">= 1.5",
                                "met": None if vs_pytriton is None else vs_pytriton >= 1.5},
        f"c{top}_vs_null_server": {"value": vs_null, "target": ">= 0.9",
                                   "met": None if vs_null is None else vs_null >= 0.9},
        f"c{top}_p99_vs_pytriton": {"value": p99, "target": "<= 1.0", "met": None if p99 is None else p99 <= 1.0},
        "cold_start_s": {"value": median_cold, "target": "< 2",
                         "met": None if median_cold is None else median_cold < 2},
        # Context, not a target: what the do-nothing Python server itself reaches against PyTriton
        # here bounds what any grpc.aio server (ours included) can reach.
        f"c{top}_null_server_vs_pytriton": ratio(null, pytriton, "requests_per_s"),
        f"c{top}_server_cpu_us_per_request": {name: results.get((name, MODEL, top), {}).get("server_cpu_us_per_request")
                                               for name in ("mlpair", "null", "pytriton")},
        # Client + server CPU per request of the other server ÷ ours: the req/s ratio a machine
        # with nothing else running would show if both were CPU-bound (other work distorts req/s).
        f"c{top}_cpu_efficiency_vs_null_server": cpu_ratio(null, ours),
        f"c{top}_cpu_efficiency_vs_pytriton": cpu_ratio(pytriton, ours),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--workdir", default="var/bench", help="venvs, run files, logs and results")
    parser.add_argument("--peers", nargs="*", default=list(PEER_NAMES), choices=PEER_NAMES)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--duration-s", type=float, default=4.0, help="measured seconds per point")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured seconds before each point")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved sweeps; each point reports their median")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--max-queue-delay-ms", type=float, default=1.0)
    parser.add_argument("--cold-starts", type=int, default=3, help="0 skips the cold-start measurement")
    parser.add_argument("--models", nargs="+", default=[MODEL, HEAVY], choices=[MODEL, HEAVY],
                        help="models measured (a bounded run: --models credit-risk)")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2],
                        help="InferenceService worker counts measured as mlpair-w<N> (none: skip)")
    parser.add_argument("--worker-channels", type=int, default=4,
                        help="connections each mlpair-w<N> point spreads its calls over")
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--no-streaming", dest="streaming", action="store_false",
                        help="skip the ModelStreamInfer points of mlpair and triton")
    args = parser.parse_args(argv)
    if args.warmup_s + args.duration_s > 60:
        parser.error("keep warmup-s + duration-s <= 60: every point runs once per server")

    import logging

    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(BENCH))
    began = time.monotonic()
    work = Path(args.workdir).resolve()
    run, logs = work / "run", work / "logs"
    for folder in (run, logs):
        folder.mkdir(parents=True, exist_ok=True)
    out = (work / "results.jsonl").open("w")
    models_root = work / "models"
    rows, feature_version, model_files = prepare_models(Path(args.model_repository).resolve(), models_root)
    rows_file = run / "rows.npy"
    np.save(rows_file, rows)
    expected = {name: reference_logits(path, rows[:16]) for name, path in model_files.items()}
    emit({"label": "setup", "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
          "python": sys.version.split()[0], "rows": int(rows.shape[0]), "n_features": int(rows.shape[1]),
          "models": {n: str(p.relative_to(work)) for n, p in model_files.items()},
          "max_batch_size": args.max_batch_size, "max_queue_delay_ms": args.max_queue_delay_ms,
          "duration_s": args.duration_s, "warmup_s": args.warmup_s}, out)

    cold = cold_start(models_root, args.cold_starts)
    emit({"label": "cold start to SERVING", "model": MODEL, "runs_s": [round(s, 3) for s in cold],
          "median_s": round(statistics.median(cold), 3) if cold else None}, out)

    servers: list[Server] = [mlpair_server("mlpair", models_root, True, feature_version, args),
                             mlpair_server("mlpair-nobatch", models_root, False, feature_version, args), null_server(),
                             *(mlpair_server(f"mlpair-w{n}", models_root, True, feature_version, args, workers=n,
                                             channels=args.worker_channels) for n in args.workers)]
    builders: dict[str, Callable[[Path], Server]] = {
        "pytriton": lambda v: pytriton_server(v, model_files, run, args),
        "triton": lambda v: triton_server(v, model_files, run, args),
        "mlserver": lambda v: mlserver_server(v, model_files, run, args),
        "kserve": lambda v: kserve_server(v, model_files, args)}
    for peer in args.peers:
        venv, why = ensure_venv(VENV_OF[peer], work / "venvs")
        if venv is None:
            say(f"skipping {peer}: {why}")
            emit({"label": "skipped", "server": peer, "reason": why}, out)
            continue
        servers.append(builders[peer](venv))

    live: list[Server] = []
    rounds: dict[tuple[str, str, int], list[dict]] = {}
    try:
        for server in servers:
            start(server, logs)
            try:
                ready_s = wait_ready(server, args.ready_timeout_s)
                worst = check_answers(server, rows, expected) if server.name != "null" else None
            except Exception as exc:  # noqa: BLE001  (a peer that will not start is skipped, not fatal)
                say(f"skipping {server.name}: {exc}")
                emit({"label": "skipped", "server": server.name, "reason": str(exc)[-400:]}, out)
                stop(server)
                continue
            if worst is not None and worst > 1e-4:
                say(f"skipping {server.name}: its logits differ from ONNX Runtime's by {worst}")
                emit({"label": "skipped", "server": server.name, "reason": f"max |logit error| {worst}"}, out)
                stop(server)
                continue
            record_tree(server)
            live.append(server)
            if args.streaming and server.name in STREAMING:
                live.append(stream_view(server))
            emit({"label": "started", "server": server.name, "batching": server.batching,
                  "start_to_ready_s": round(ready_s, 2), "max_abs_logit_error": worst}, out)
        for number in range(1, args.rounds + 1):
            for c in args.concurrency:  # interleaved: every server gets its point before the next level
                for model in args.models:
                    for server in live:
                        if model in server.models:
                            line = {"round": number, **measure(server, model, c, rows_file, args)}
                            rounds.setdefault((server.name, model, c), []).append(line)
                            emit(line, out)
    finally:
        for server in servers:
            stop(server)

    results = {key: merge_rounds(lines) for key, lines in rounds.items()}
    for line in results.values():
        emit({**line, "label": f"{line['label']} (median of {args.rounds} rounds)"}, out)
    streaming = streaming_summary(results, args.concurrency)
    emit(streaming, out)
    by_workers = workers_summary(results, args.workers, args.concurrency)
    emit(by_workers, out)
    summary = targets(results, cold, max(args.concurrency))
    summary["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    summary["elapsed_s"] = round(time.monotonic() - began, 1)
    emit(summary, out)
    text = table(results, live, args.concurrency, args.models)
    (work / "table.md").write_text(text + "\n")
    print("\n" + text + "\n")
    for key, value in summary.items():
        if isinstance(value, dict) and "met" in value:
            state = {True: "met", False: "NOT met", None: "not measured"}[value["met"]]
            print(f"{key}: {value['value']} (target {value['target']}): {state}")
    top = max(args.concurrency)
    print(f"context at c={top}: the do-nothing Python gRPC server ÷ PyTriton = {summary[f'c{top}_null_server_vs_pytriton']}; "
          f"server CPU µs per request: {summary[f'c{top}_server_cpu_us_per_request']}; CPU efficiency of mlpair "
          f"vs the null server {summary[f'c{top}_cpu_efficiency_vs_null_server']}, "
          f"vs PyTriton {summary[f'c{top}_cpu_efficiency_vs_pytriton']}")
    for key, value in streaming.items():
        if isinstance(value, dict):
            print(f"{key}: stream {value['stream_req_s']:,.0f} vs unary {value['unary_req_s']:,.0f} req/s "
                  f"({value['stream_vs_unary_req_s']} x), p99 {value['stream_p99_ms']} vs {value['unary_p99_ms']} ms, "
                  f"server µs CPU/req {value['server_us_per_request'][1]} vs {value['server_us_per_request'][0]}")
    for key, value in by_workers.items():
        if isinstance(value, dict):
            print(f"workers {key}: req/s {value['requests_per_s']}, p99 ms {value['p99_ms']}, "
                  f"server µs CPU/req {value['server_cpu_us_per_request']}")
    print(f"cold start to SERVING: {[round(s, 2) for s in cold]} s; results in {work / 'results.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
