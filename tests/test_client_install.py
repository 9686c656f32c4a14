"""C66: the client installs alone. ``clients/python`` (the ``mlpair-client`` distribution) goes into a
fresh virtual environment from the checkout, with nothing of the servers, and calls a real
PredictionService at both ends of the protobuf range it declares.

The install needs PyPI (or pip's cache): without it the tests skip, except under CI (CI=true).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import prediction_server

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "clients" / "python"
# What the client may bring, beside the venv's own pip and setuptools: typing-extensions is grpcio's.
ALLOWED = {"mlpair-client", "grpcio", "protobuf", "googleapis-common-protos", "numpy", "typing-extensions"}
SEEDS = {"pip", "setuptools"}
SERVER_SIDE = {
    "mlpair", "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "pydantic", "pydantic-settings",
    "prometheus-client", "rich", "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc",
    "onnxruntime", "torch", "sqlalchemy", "scipy", "alembic", "asyncpg", "redis", "uvloop",
}
# Run inside the fresh venv: import the client, check health, make a Predict, report what it saw.
CALL = r"""
import importlib.util, json, sys
import google.protobuf
from mlpair.client import PredictionClient, check_health
target, request_id = sys.argv[1:3]
applicant = {"Seniority": 9, "Home": "rent", "Time": 60, "Age": 30, "Marital": "married", "Records": "no",
             "Job": "freelance", "Expenses": 73, "Income": 129, "Assets": 0, "Debt": 0, "Amount": 800, "Price": 846}
with PredictionClient(target) as client:
    reply = client.predict("credit-risk", entity_id="c66", attributes=applicant, request_id=request_id)
server_modules = ["mlpair.contracts", "mlpair.rpc", "mlpair.prediction", "pydantic", "opentelemetry", "grpc_health"]
print(json.dumps({
    "protobuf": google.protobuf.__version__,
    "health": check_health(target),
    "decision": reply.decision_label,
    "probability": reply.probability,
    "model_version": reply.model_version,
    "bytes": len(reply.SerializeToString()),
    "importable": [m for m in server_modules if importlib.util.find_spec(m) is not None],
}))
"""


def _protobuf_range() -> tuple[str, str]:
    """The lowest allowed protobuf and the exclusive upper bound, from clients/python/pyproject.toml."""
    ((low, high),) = re.findall(r'"protobuf>=([\d.]+),<([\d.]+)"', (CLIENT / "pyproject.toml").read_text())
    return low, high


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


class Venv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = str(root / "bin" / "python")

    def pip(self, *args: str) -> None:
        done = _run(self.python, "-m", "pip", "install", "--quiet", *args, cwd=self.root)
        if done.returncode != 0:
            message = f"pip install {' '.join(args)} failed (PyPI unreachable?): {done.stderr[-1500:]}"
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(message)
            pytest.skip(message)

    def distributions(self) -> set[str]:
        listed = _run(self.python, "-m", "pip", "list", "--format", "json", cwd=self.root)
        return {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}

    async def call(self, target: str) -> dict:
        """CALL in the venv (isolated mode: the checkout's mlpair/ is not on its path), in a thread so
        the servers on this event loop keep answering."""
        done = await asyncio.to_thread(_run, self.python, "-I", "-c", CALL, target, f"c66-{uuid.uuid4()}",
                                       cwd=self.root)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Venv:
    root = tmp_path_factory.mktemp("client-venv")
    done = _run(sys.executable, "-m", "venv", str(root), cwd=root)
    assert done.returncode == 0, done.stderr
    venv = Venv(root)
    venv.pip(str(CLIENT))
    return venv


@pytest.fixture(scope="module")
async def prediction_target(inference_server, model_repository, tmp_path_factory):
    async with prediction_server(inference_server, model_repository, tmp_path_factory.mktemp("crm")) as (target, _):
        yield target


def test_c66_client_stubs_are_the_contract_the_servers_serve():
    """The client's own generated modules (older gencode, clients/python/generate.sh) describe exactly
    the messages and services of the servers' mlpair/api, and their gencode version is the lowest
    protobuf the distribution declares."""
    from mlpair.api.inference.v1 import inference_service_pb2
    from mlpair.api.prediction.v1 import prediction_service_pb2
    from mlpair.client.inference import FEATURE_VERSION_KEY
    from mlpair.contracts import FEATURE_VERSION_KEY as CONTRACT_KEY

    low, _ = _protobuf_range()
    for module in (inference_service_pb2, prediction_service_pb2):
        relative = Path(module.__file__).relative_to(REPO)
        text = (CLIENT / relative).read_text()
        (literal,) = re.findall(r"AddSerializedFile\((b'.*?')\)\n", text)
        assert ast.literal_eval(literal) == module.DESCRIPTOR.serialized_pb, f"{relative}: run clients/python/generate.sh"
        assert f"# Protobuf Python Version: {low}\n" in text
    assert FEATURE_VERSION_KEY == CONTRACT_KEY


async def test_c66_client_installs_alone_and_calls_a_running_pair(client_venv, prediction_target, credit_entry):
    installed = client_venv.distributions() - SEEDS
    assert installed & SERVER_SIDE == set()
    assert installed <= ALLOWED, sorted(installed - ALLOWED)
    assert {"mlpair-client", "grpcio", "protobuf", "googleapis-common-protos", "numpy"} <= installed
    seen = await client_venv.call(prediction_target)
    assert seen["importable"] == []
    assert seen["health"] == "SERVING"
    assert seen["decision"] in ("APPROVE", "REVIEW", "DECLINE") and 0.0 < seen["probability"] < 1.0
    assert seen["model_version"] == credit_entry.manifest.model_version and seen["bytes"] > 0


async def test_c66_client_works_at_both_ends_of_its_protobuf_range(client_venv, prediction_target):
    low, high = _protobuf_range()
    client_venv.pip(str(CLIENT), f"protobuf=={low}")  # pip picks googleapis-common-protos to match
    at_low = await client_venv.call(prediction_target)
    assert at_low["protobuf"] == low and at_low["health"] == "SERVING" and at_low["bytes"] > 0
    client_venv.pip("--upgrade", str(CLIENT), f"protobuf>={low},<{high}")
    at_high = await client_venv.call(prediction_target)
    newest_major = int(high.split(".")[0]) - 1
    assert int(at_high["protobuf"].split(".")[0]) == newest_major, at_high["protobuf"]
    assert at_high["decision"] == at_low["decision"] and at_high["probability"] == at_low["probability"]
