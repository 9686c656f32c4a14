"""Caller identity (intake/callers.py): read from the one source the operator trusts, never from a
header nothing trusted set; recorded in the ledger and the CRM with each decision."""

from __future__ import annotations

import logging

import grpc
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.prediction.errors import InvalidCaller
from mlpair.prediction.intake.callers import ANONYMOUS, identify, metric_label, spiffe_id
from mlpair.rpc.status import error_info
from tests.fault_support import eventually, prediction_service, prediction_settings

pytestmark = pytest.mark.timeout(120)

SIDECAR = 'By=spiffe://cluster.local/ns/lending/sa/prediction;Hash=ab12;Subject="";URI=spiffe://cluster.local/ns/lending/sa/web'
FORGED = "URI=spiffe://cluster.local/ns/lending/sa/admin"


class Context:
    """What identify() reads of a grpc.aio.ServicerContext: metadata and the TLS auth context."""

    def __init__(self, metadata=(), auth=None) -> None:
        self.metadata, self.auth = tuple(metadata), auth or {}

    def invocation_metadata(self):
        return self.metadata

    def auth_context(self):
        return self.auth


SPOOFED = (("x-caller-id", "someone-else"), ("x-forwarded-client-cert", FORGED))


@pytest.mark.parametrize("source", ["none", "tls"])
def test_without_a_header_source_spoofed_headers_are_ignored(source):
    assert identify(Context(SPOOFED), source) == ANONYMOUS


def test_tls_takes_the_verified_subject_not_a_header():
    auth = {"x509_subject": [b"CN=batch-scoring,O=lending"], "x509_common_name": [b"batch-scoring"]}
    assert identify(Context(SPOOFED, auth), "tls") == "CN=batch-scoring,O=lending"
    assert identify(Context(SPOOFED, {"x509_common_name": [b"batch-scoring"]}), "tls") == "batch-scoring"


def test_mesh_takes_only_the_sidecar_s_xfcc_element():
    # APPEND_FORWARD: the client's forged element first, the sidecar's last; x-caller-id is never read
    both = f"{FORGED},{SIDECAR}"
    assert identify(Context([("x-caller-id", "someone-else"), ("x-forwarded-client-cert", both)]), "mesh") == \
        "spiffe://cluster.local/ns/lending/sa/web"
    # SANITIZE_SET: only the sidecar's element
    assert identify(Context([("x-forwarded-client-cert", SIDECAR)]), "mesh") == "spiffe://cluster.local/ns/lending/sa/web"
    assert identify(Context([("x-caller-id", "someone-else")]), "mesh") == ANONYMOUS


def test_header_source_reads_the_configured_header_only():
    assert identify(Context(SPOOFED), "header") == "someone-else"
    assert identify(Context(SPOOFED), "header", header="x-authenticated-caller") == ANONYMOUS


def test_xfcc_values_may_be_quoted_and_hold_separators():
    assert spiffe_id('Subject="CN=a,O=b;c";URI="spiffe://td/ns/x/sa/y"') == "spiffe://td/ns/x/sa/y"
    assert spiffe_id("Hash=ab;URI=https://not-spiffe") is None
    with pytest.raises(InvalidCaller):
        spiffe_id('Subject="unterminated;URI=spiffe://td/x')


def test_an_unusable_identity_is_refused_not_recorded_as_someone():
    with pytest.raises(InvalidCaller):
        identify(Context([("x-caller-id", "a\tb")]), "header")
    with pytest.raises(InvalidCaller):
        identify(Context([("x-caller-id", "x" * 129)]), "header")


def test_metric_labels_are_bounded_to_named_callers():
    named = frozenset({"spiffe://td/ns/x/sa/web"})
    assert [metric_label(c, named) for c in ("spiffe://td/ns/x/sa/web", "anonymous", "minted-1", "minted-2")] == \
        ["spiffe://td/ns/x/sa/web", "anonymous", "other", "other"]


def predict(request_id: str, record) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=f"e-{request_id}", attributes=to_attributes(record))


@pytest.mark.parametrize("source, expected", [
    ("mesh", "spiffe://cluster.local/ns/lending/sa/web"),
    ("none", ANONYMOUS),
    ("header", "someone-else"),
])
async def test_the_caller_is_recorded_in_the_ledger_and_the_crm(
        source, expected, tmp_path, model_repository, inference_server, credit_holdout):
    settings = prediction_settings(tmp_path, model_repository, inference_server, caller_source=source)
    metadata = (("x-caller-id", "someone-else"), ("x-forwarded-client-cert", f"{FORGED},{SIDECAR}"))
    async with prediction_service(settings) as (stub, predictor, _, _):
        reply = await stub.Predict(predict("c-1", credit_holdout.records[0]), timeout=20, metadata=metadata)
        batch = await stub.BatchPredict(pb.BatchPredictRequest(
            requests=[predict(f"c-b{i}", r) for i, r in enumerate(credit_holdout.records[1:4])]),
            timeout=20, metadata=metadata)
        assert reply.decision_label and [r.WhichOneof("outcome") for r in batch.results] == ["prediction"] * 3
        ids = ["c-1", "c-b0", "c-b1", "c-b2"]
        assert [(await predictor.recorder.ledger.find(i)).decision.caller for i in ids] == [expected] * 4
        await eventually(lambda: predictor.recorder.wait_delivered(0.5))
        assert [(await predictor.crm.find(i)).caller for i in ids] == [expected] * 4


async def test_an_unusable_caller_header_is_invalid_argument_and_nothing_is_recorded(
        tmp_path, model_repository, inference_server, credit_holdout):
    settings = prediction_settings(tmp_path, model_repository, inference_server, caller_source="header")
    async with prediction_service(settings) as (stub, predictor, _, _):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Predict(predict("bad-caller", credit_holdout.records[0]), timeout=20,
                               metadata=(("x-caller-id", "x" * 200),))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(refused.value).reason == "CALLER_INVALID"
        assert await predictor.recorder.ledger.find("bad-caller") is None


async def test_the_decision_log_line_names_the_caller(tmp_path, model_repository, inference_server, credit_holdout,
                                                     caplog):
    settings = prediction_settings(tmp_path, model_repository, inference_server, caller_source="mesh")
    async with prediction_service(settings) as (stub, _, _, _):
        with caplog.at_level(logging.DEBUG, logger="mlpair.prediction.pipeline"):
            reply = await stub.Predict(predict("logged-1", credit_holdout.records[0]), timeout=20,
                                       metadata=(("x-forwarded-client-cert", SIDECAR),))
    [line] = [r for r in caplog.records if r.name == "mlpair.prediction.pipeline" and r.msg == "decision %s"]
    assert (line.decision_id, line.caller) == (reply.decision_id, "spiffe://cluster.local/ns/lending/sa/web")
