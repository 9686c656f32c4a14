"""The closest peer design to PredictionService: a KServe transformer → predictor chain doing the same business work.

Two KServe 0.21 Python model servers (``var/bench/venvs/kserve``, pinned by
``bench/peers/requirements-kserve.txt``, the venv ``make bench`` uses for its KServe peer):

* **predictor** — ``bench/peers/kserve_server.py``: a ``kserve.Model`` running the credit-risk
  ONNX file of the model repository with ONNX Runtime (one thread), OIP v2 gRPC;
* **transformer** — this file run as a script in that venv: a ``kserve.Model`` that overrides
  only ``preprocess`` and ``postprocess``; KServe's own ``predict()`` forwards the preprocessed
  request to the predictor over OIP v2 gRPC (``--predictor_protocol grpc-v2``, its
  ``InferenceGRPCClient``), as KServe's transformer pattern does.

The transformer does PredictionService's business work with PredictionService's own code, on
the same model version: the raw applicant attributes (one JSON object, input ``applicant``
BYTES [1]) are assembled into the feature row by the model's fitted preprocessing, guards
included (:class:`mlpair.contracts.assembly.FeatureAssembler`); the predictor's logits are
calibrated by the manifest's calibration (:class:`mlpair.prediction.scoring.calibration.Calibrator`);
the policy file's bands, thresholds and reason codes decide
(:class:`mlpair.prediction.deciding.policy.DecisionPolicy`, with the defaulted-feature fraction of the
guards). Outputs: ``probability`` FP32 [1], ``decision`` BYTES [1], ``reason_codes`` BYTES [1]
(comma-separated). What PredictionService does beyond that and the chain does not: the durable
decision record (ledger and CRM), the cache, the circuit breaker, coalescing of concurrent rows,
drift, metrics and traces of its own.

Both servers log at WARNING (KServe's INFO writes one line per call) with latency logging off,
one worker each. Started by :class:`Chain` from the main venv (``bench/predict_load.py``), every
process stopped by PID; both bind loopback ports chosen free (KServe binds every interface; the
load only goes to 127.0.0.1).

    var/bench/venvs/kserve/bin/python bench/kserve_chain.py --model_name credit-risk \\
        --model_dir var/models/credit-risk/3 --policy config/credit-risk/policy.toml \\
        --http_port 8520 --grpc_port 8521 --predictor_host 127.0.0.1:8511 --predictor_protocol grpc-v2
"""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INPUT = "applicant"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
DEFAULTED_KEY, GUARDS_KEY = "x-chain-defaulted-fraction", "x-chain-guard-codes"


# -- the transformer (runs inside the KServe venv) --------------------------------------------------


def _import_project() -> None:
    """Makes ``mlpair.contracts`` and ``mlpair.prediction`` importable from the source tree in the
    KServe venv (they need numpy and pydantic, which it has; nothing of the project's protobuf)."""
    for portion in (REPO, REPO / "services" / "prediction"):  # mlpair, a namespace package in portions
        sys.path.insert(0, str(portion))


def _decider(model_dir: Path, policy_path: Path):
    """The model entry, ``assemble(attributes)`` and ``decide(logits, defaulted_fraction, guard_codes)``,
    built from PredictionService's own pieces for the model version in ``model_dir``."""
    import numpy as np

    from mlpair.contracts.assembly import MISSING_DEFAULTED, SENTINEL_DEFAULTED, FeatureAssembler
    from mlpair.contracts.manifest import load_entry
    from mlpair.prediction.deciding.policy import DecisionPolicy
    from mlpair.prediction.scoring.calibration import Calibrator

    entry = load_entry(model_dir)
    assembler = FeatureAssembler(entry.preprocessing)
    calibrator = Calibrator(entry.manifest)
    policy = DecisionPolicy.from_toml(policy_path)
    defaulted_actions = frozenset({MISSING_DEFAULTED, SENTINEL_DEFAULTED})  # as pipeline.DEFAULTED_ACTIONS
    n_schema_features = len(entry.preprocessing.feature_schema.features)

    def assemble(attributes: dict) -> tuple[np.ndarray, float, tuple[str, ...]]:
        """The ``[n_features] float32`` row, the fraction of schema features defaulted, the guards' codes."""
        row = assembler.assemble(attributes)
        defaulted = {g.feature for g in row.guards if g.action in defaulted_actions}
        return row.vector, len(defaulted) / n_schema_features, tuple(dict.fromkeys(g.reason_code for g in row.guards))

    def decide(logits: np.ndarray, defaulted_fraction: float, guard_codes: tuple[str, ...]):
        """``[1, n_classes]`` logits → (calibrated probability, decision, reason codes) as Predict's record has them."""
        probability = float(calibrator.probabilities(logits)[0])
        verdict = policy.decide(probability, 0.0, defaulted_fraction)
        return probability, verdict.decision, (*verdict.reason_codes, *guard_codes)

    return entry, assemble, decide


def serve_transformer() -> None:
    import argparse
    import logging

    import kserve
    import numpy as np
    from kserve.protocol.infer_type import InferInput, InferOutput, InferRequest, InferResponse

    _import_project()
    parser = argparse.ArgumentParser(parents=[kserve.model_server.parser])
    parser.add_argument("--model_dir", required=True, help="the model version's folder in the repository")
    parser.add_argument("--policy", required=True, help="the family's policy.toml")
    args, _ = parser.parse_known_args()
    entry, assemble, decide = _decider(Path(args.model_dir), Path(args.policy))
    input_name = entry.manifest.inputs[0].name

    class CreditTransformer(kserve.Model):
        """preprocess: applicant JSON → feature row; postprocess: logits → calibrated decision."""

        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.ready = True

        def preprocess(self, payload: InferRequest, headers=None) -> InferRequest:
            raw = payload.inputs[0].as_numpy().reshape(-1)
            if len(raw) != 1:
                raise ValueError("one applicant per request")
            vector, defaulted, guard_codes = assemble(json.loads(raw[0]))
            # what the guards did travels to postprocess in the call's own headers dict (KServe
            # passes it to both; the model keeps no per-request state: many calls share the loop)
            headers[DEFAULTED_KEY] = repr(defaulted)
            headers[GUARDS_KEY] = ",".join(guard_codes)
            request = InferRequest(model_name=self.name, request_id=payload.id,
                                   infer_inputs=[InferInput(input_name, [1, len(vector)], "FP32")])
            request.inputs[0].set_data_from_numpy(vector.reshape(1, -1), binary_data=True)
            return request

        def postprocess(self, result: InferResponse, headers=None, response_headers=None) -> InferResponse:
            logits = result.outputs[0].as_numpy().reshape(1, -1)
            guards = headers[GUARDS_KEY]
            probability, decision, reasons = decide(logits, float(headers[DEFAULTED_KEY]),
                                                    tuple(guards.split(",")) if guards else ())
            outputs = [InferOutput("probability", [1], "FP32"), InferOutput("decision", [1], "BYTES"),
                       InferOutput("reason_codes", [1], "BYTES")]
            outputs[0].set_data_from_numpy(np.array([probability], dtype=np.float32), binary_data=True)
            outputs[1].set_data_from_numpy(np.array([decision.encode()], dtype=np.object_), binary_data=True)
            outputs[2].set_data_from_numpy(np.array([",".join(reasons).encode()], dtype=np.object_),
                                           binary_data=True)
            return InferResponse(response_id=result.id, model_name=self.name, infer_outputs=outputs,
                                 from_grpc=True, use_binary_outputs=True)

    server = kserve.ModelServer()
    for name in ("kserve", "kserve.trace", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    server.start([CreditTransformer(args.model_name)])


# -- the harness (runs in the project's venv) -----------------------------------------------------------


def applicant_json(attributes: dict) -> bytes:
    """One applicant's raw attributes as the transformer reads them (NaN → null)."""
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in attributes.items()}
    return json.dumps(clean, separators=(",", ":"), default=float).encode()


def chain_payloads(requests, model: str) -> list[tuple[str, bytes]]:
    """OIP ``ModelInfer`` requests, one applicant each (input ``applicant`` BYTES [1] as raw
    contents: a 4-byte little-endian length, then the JSON), serialised once."""
    from mlpair.api.oip import grpc_predict_v2_pb2 as oip

    out = []
    for rid, _entity, attrs in requests:
        body = applicant_json(attrs)
        request = oip.ModelInferRequest(model_name=model, id=rid, inputs=[
            oip.ModelInferRequest.InferInputTensor(name=INPUT, datatype="BYTES", shape=[1])],
            raw_input_contents=[struct.pack("<I", len(body)) + body])
        out.append((rid, request.SerializeToString()))
    return out


def chain_reply(raw: bytes) -> tuple[float, str, tuple[str, ...]]:
    """``(probability, decision, reason codes)`` of one transformer reply.

    Raises:
        ValueError: the reply lacks an output or holds more than one applicant's.
    """
    from mlpair.api.oip import grpc_predict_v2_pb2 as oip

    reply = oip.ModelInferResponse.FromString(raw)
    named = {o.name: i for i, o in enumerate(reply.outputs)}
    if set(named) != {"probability", "decision", "reason_codes"} or len(reply.raw_output_contents) != 3:
        raise ValueError(f"unexpected outputs {sorted(named)}")

    def text(i: int) -> str:
        blob = reply.raw_output_contents[i]
        (size,) = struct.unpack_from("<I", blob)
        if size + 4 != len(blob):
            raise ValueError("not one BYTES element")
        return blob[4:].decode()

    (probability,) = struct.unpack("<f", reply.raw_output_contents[named["probability"]])
    reasons = text(named["reason_codes"])
    return probability, text(named["decision"]), tuple(reasons.split(",")) if reasons else ()


class Chain:
    """The two KServe servers as processes (context manager), SERVING the credit-risk model.

    Args:
        model: the model's name (both servers serve it under it).
        model_dir: the model version's folder (the one InferenceService serves).
        model_file: its ONNX file (the predictor runs it).
        policy: the family's ``policy.toml`` (the one PredictionService decides with).
        workdir: logs (``kserve-predictor.log``, ``kserve-transformer.log``) go here.
        venvs: where the KServe virtualenv is (installed on first use, minutes).

    Raises:
        RuntimeError: the venv cannot be installed, or a server does not answer within 120 s.
    """

    def __init__(self, model: str, model_dir: Path, model_file: Path, policy: Path, workdir: Path,
                 venvs: Path) -> None:
        self.model, self.model_dir, self.model_file = model, model_dir, model_file
        self.policy, self.workdir, self.venvs = policy, workdir, venvs
        self.processes: dict[str, subprocess.Popen] = {}
        self.address = ""

    def __enter__(self) -> Chain:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Chain:
        """Installs the venv if needed, starts the predictor then the transformer, each until ready."""
        sys.path.insert(0, str(REPO / "bench"))
        from side_by_side import ensure_venv, free_port

        venv, why = ensure_venv("kserve", self.venvs)
        if venv is None:
            raise RuntimeError(f"no KServe virtualenv: {why}")
        python = str(venv / "bin" / "python")
        predictor_port, transformer_port = free_port(), free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        common = ["--enable_latency_logging", "False", "--workers", "1"]
        commands = {
            "predictor": [python, str(REPO / "bench" / "peers" / "kserve_server.py"), "--http_port", str(free_port()),
                          "--grpc_port", str(predictor_port), *common,
                          "--onnx_model", f"{self.model}={self.model_file}"],
            "transformer": [python, str(Path(__file__).resolve()), "--model_name", self.model,
                            "--model_dir", str(self.model_dir), "--policy", str(self.policy),
                            "--http_port", str(free_port()), "--grpc_port", str(transformer_port), *common,
                            "--predictor_host", f"127.0.0.1:{predictor_port}", "--predictor_protocol", "grpc-v2"]}
        try:
            for name, command in commands.items():
                with (self.workdir / f"kserve-{name}.log").open("w") as log:
                    self.processes[name] = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                            start_new_session=True)
                self._wait_ready(f"127.0.0.1:{predictor_port if name == 'predictor' else transformer_port}", name)
        except BaseException:
            self.stop()
            raise
        self.address = f"127.0.0.1:{transformer_port}"
        return self

    def _wait_ready(self, address: str, name: str, timeout_s: float = 120.0) -> None:
        import grpc

        from mlpair.api.oip import grpc_predict_v2_pb2 as oip
        from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(address) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            while time.monotonic() < deadline:
                if self.processes[name].poll() is not None:
                    break
                try:
                    if stub.ModelReady(oip.ModelReadyRequest(name=self.model), timeout=2).ready:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        tail = (self.workdir / f"kserve-{name}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"KServe {name} at {address} not ready; log tail:\n{tail}")

    def cpu_seconds(self, name: str) -> float:
        """User + system CPU seconds of one server's process tree (0 when it is not running)."""
        import psutil

        try:
            root = psutil.Process(self.processes[name].pid)
            return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
        except (psutil.Error, KeyError):
            return 0.0

    def stop(self) -> None:
        """SIGTERM to both servers' process groups (our own children, by PID), SIGKILL after 15 s."""
        for process in self.processes.values():  # our own children, by PID, with their sessions
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


if __name__ == "__main__":
    serve_transformer()
