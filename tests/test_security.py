"""Security in depth: no unsafe deserialisation in the serving code, no internal detail in
errors, explicit message size limits on both services."""

from __future__ import annotations

import logging
import re

import grpc
import numpy as np
import pytest

from mlpair.api.inference.v1 import inference_service_pb2 as ipb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.rpc import error_info
from tests.support import REPO_ROOT

SERVING_CODE = [REPO_ROOT / "services", REPO_ROOT / "mlpair"]
GENERATED = REPO_ROOT / "mlpair" / "api"
SECRET = "db password hunter2 at /srv/secret/config.py line 42"

# Each pattern is a way to run code from data: pickle and its relatives, torch.load without
# weights_only=True, numpy/yaml loads that allow objects, and eval/exec of strings.
UNSAFE = {
    "pickle": re.compile(r"\b(c?pickle|_pickle|cloudpickle|dill|joblib|shelve|marshal)\b"),
    "torch.load without weights_only=True": re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)[^)]*\)"),
    "numpy allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
    "yaml.load (not safe_load)": re.compile(r"\byaml\.(load|unsafe_load|full_load)\("),
    "eval/exec of a string": re.compile(r"(?<![\w.])(eval|exec)\("),
}


def unsafe_uses(text: str) -> list[str]:
    """Names of the unsafe patterns found in source ``text`` (comments and docstrings included:
    a mention of pickle in serving code deserves a look)."""
    return [name for name, pattern in UNSAFE.items() if pattern.search(text)]


@pytest.mark.parametrize("snippet", [
    "import pickle", "from joblib import load", "obj = dill.loads(b)", "torch.load(path)",
    "torch.load(path, weights_only=False)", "np.load(f, allow_pickle=True)", "yaml.load(text)",
    "x = eval(text)", "exec(code)", "import cloudpickle",
])
def test_the_scan_finds_unsafe_deserialisation(snippet):
    assert unsafe_uses(snippet)


@pytest.mark.parametrize("snippet", [
    "torch.load(path, weights_only=True)", "model.eval()", "np.load(f)", "yaml.safe_load(text)",
    "torch.export.export(model.eval(), args)",
])
def test_the_scan_lets_safe_code_through(snippet):
    assert unsafe_uses(snippet) == []


def test_no_pickle_anywhere_in_the_serving_path():
    """services/ and mlpair/ (not the generated protobuf code): no pickle, joblib, dill, unsafe
    torch.load, eval or exec. Models travel as ONNX (protobuf) or torch.export programs whose
    SHA-256 is checked against the manifest before loading."""
    found = {}
    for root in SERVING_CODE:
        for path in sorted(root.rglob("*.py")):
            if GENERATED in path.parents:
                continue
            uses = unsafe_uses(path.read_text())
            if uses:
                found[str(path.relative_to(REPO_ROOT))] = uses
    assert found == {}


# -- no internal detail in errors -----------------------------------------------------------------


async def test_unexpected_inference_error_is_a_generic_internal(model_repository, credit_entry, caplog):
    """An unexpected exception inside InferenceService reaches the client as INTERNAL "internal
    error" (reason INTERNAL), never its text; the traceback goes to the server log."""
    from tests.inference.helpers import make_settings, running

    async with running(make_settings(model_repository)) as server:
        async def boom(*args, **kwargs):
            raise RuntimeError(SECRET)

        server.engine.infer = boom
        x = np.zeros((1, credit_entry.manifest.n_features), np.float32)
        request = ipb.InferRequest(model_name="credit-risk",
                                   inputs=ipb.Tensor(data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()))
        caplog.set_level(logging.ERROR, logger="mlpair.rpc")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await ipb_grpc.InferenceServiceStub(channel).Infer(request, timeout=5)
            from mlpair.api.oip import grpc_predict_v2_pb2 as oip
            from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc

            tensor = oip.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
            with pytest.raises(grpc.aio.AioRpcError) as oip_excinfo:
                await oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    oip.ModelInferRequest(model_name="credit-risk", inputs=[tensor], raw_input_contents=[x.tobytes()]),
                    timeout=5)
    for err in (excinfo.value, oip_excinfo.value):
        assert err.code() == grpc.StatusCode.INTERNAL
        assert err.details() == "internal error"
        assert error_info(err).reason == "INTERNAL"
        assert "hunter2" not in str(err.trailing_metadata()) and "RuntimeError" not in err.details()
    assert SECRET in caplog.text  # the operator sees it, the client does not


async def test_unexpected_prediction_error_is_a_generic_internal(inference_server, model_repository, credit_holdout,
                                                                  tmp_path, caplog):
    from tests.e2e.conftest import prediction_service

    async with prediction_service(inference_server, model_repository, tmp_path) as (stub, predictor):
        async def boom(*args, **kwargs):
            raise KeyError(SECRET)

        predictor.predictor.predict = boom  # the pipeline the servicer calls
        caplog.set_level(logging.ERROR, logger="mlpair.rpc")
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await stub.Predict(pb.PredictRequest(request_id="r-internal", entity_id="e-internal",
                                                 attributes=to_attributes(credit_holdout.records[0])), timeout=10)
    err = excinfo.value
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "internal error"
    assert error_info(err).reason == "INTERNAL"
    assert "hunter2" not in str(err.trailing_metadata())
    assert SECRET in caplog.text


# -- message size limits --------------------------------------------------------------------------


async def test_prediction_messages_above_the_size_limit_get_a_clear_error(inference_server, model_repository,
                                                                          credit_holdout, tmp_path):
    """PredictionService's explicit limit: a larger BatchPredict is RESOURCE_EXHAUSTED naming the
    limit, and the next normal call is served."""
    from tests.e2e.conftest import prediction_service

    limit = 16 * 1024
    async with prediction_service(inference_server, model_repository, tmp_path, max_message_bytes=limit) as (stub, _):
        records = credit_holdout.records
        items = [pb.PredictRequest(request_id=f"big-{i}", entity_id=f"e-{i}", attributes=to_attributes(records[i]))
                 for i in range(200)]
        big = pb.BatchPredictRequest(requests=items)
        assert big.ByteSize() > limit
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await stub.BatchPredict(big, timeout=10)
        assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in excinfo.value.details() and str(limit) in excinfo.value.details()
        reply = await stub.Predict(pb.PredictRequest(request_id="small-1", entity_id="e-small",
                                                     attributes=to_attributes(records[0])), timeout=10)
        assert reply.decision_label
