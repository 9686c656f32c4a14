"""TLS and mutual TLS on both services' gRPC ports, end to end on 127.0.0.1.

Throw-away certificates are made per test module with ``cryptography``: a CA, a server
certificate for ``localhost`` / ``127.0.0.1`` and a client certificate, both signed by it, and a
second CA that signed nothing the servers trust.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2 as ipb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client import PredictionClient, check_health, infer_logits, to_attributes
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.inference.settings import InferenceSettings
from mlpair.prediction.settings import PredictionSettings
from mlpair.rpc import channel_credentials, open_channel
from tests.e2e.conftest import inference_service
from tests.support import CONFIG_DIR

FEATURE_VERSION_KEY = "x-feature-version"


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool, sans=()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """PEM files: ca, server cert/key (localhost, 127.0.0.1), client cert/key, and other_ca."""
    from cryptography import x509

    folder = tmp_path_factory.mktemp("tls")
    files: dict[str, Path] = {}

    def write(name: str, data: bytes) -> None:
        files[name] = folder / f"{name}.pem"
        files[name].write_bytes(data)

    ca_key = _key()
    ca = _certificate("mlpair test CA", ca_key, None, None, ca=True)
    server_key, client_key, other_key = _key(), _key(), _key()
    server = _certificate("localhost", server_key, ca.subject, ca_key, ca=False,
                          sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _certificate("prediction-service", client_key, ca.subject, ca_key, ca=False)
    write("ca", _pem_cert(ca))
    write("server_cert", _pem_cert(server))
    write("server_key", _pem_key(server_key))
    write("client_cert", _pem_cert(client))
    write("client_key", _pem_key(client_key))
    write("other_ca", _pem_cert(_certificate("someone else's CA", other_key, None, None, ca=True)))
    return files


@pytest.fixture(scope="module")
def holdout_x(credit_entry, credit_holdout) -> np.ndarray:
    return FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records[:8])


@pytest.fixture(scope="module")
def feature_version(credit_entry) -> str:
    return credit_entry.manifest.versions.feature_schema_version


async def _infer(channel: grpc.aio.Channel, x: np.ndarray, feature_version: str) -> ipb.InferResponse:
    stub = ipb_grpc.InferenceServiceStub(channel)
    request = ipb.InferRequest(model_name="credit-risk",
                               inputs=ipb.Tensor(data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()))
    return await stub.Infer(request, timeout=5, metadata=((FEATURE_VERSION_KEY, feature_version),))


async def test_inference_service_speaks_tls_and_refuses_plaintext(model_repository, holdout_x, feature_version, certs):
    async with inference_service(model_repository, tls_cert_file=certs["server_cert"],
                                 tls_key_file=certs["server_key"]) as target:
        async with open_channel(target, [], channel_credentials(certs["ca"])) as channel:
            reply = await _infer(channel, holdout_x[:3], feature_version)
        assert reply.logits.shape == [3, 2]
        async with grpc.aio.insecure_channel(target) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await _infer(plaintext, holdout_x[:1], feature_version)
        assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
        async with open_channel(target, [], channel_credentials(certs["other_ca"])) as untrusted:
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await _infer(untrusted, holdout_x[:1], feature_version)
        assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE  # the client does not trust that server


async def test_inference_service_mutual_tls_requires_a_client_certificate(model_repository, holdout_x,
                                                                          feature_version, certs):
    async with inference_service(model_repository, tls_cert_file=certs["server_cert"], tls_key_file=certs["server_key"],
                                 tls_client_ca_file=certs["ca"]) as target:
        async with open_channel(target, [], channel_credentials(certs["ca"])) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await _infer(anonymous, holdout_x[:1], feature_version)
        assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = channel_credentials(certs["ca"], certs["client_cert"], certs["client_key"])
        async with open_channel(target, [], with_cert) as channel:
            reply = await _infer(channel, holdout_x[:2], feature_version)
        assert reply.logits.shape == [2, 2]


async def test_prediction_over_tls_to_inference_over_mutual_tls(model_repository, credit_holdout, certs, tmp_path,
                                                                holdout_x, feature_version):
    """Business caller --TLS--> PredictionService --mTLS--> InferenceService, on 127.0.0.1."""
    from mlpair.prediction.server import stop
    from tests.support import start_prediction

    async with inference_service(model_repository, tls_cert_file=certs["server_cert"], tls_key_file=certs["server_key"],
                                 tls_client_ca_file=certs["ca"]) as inference_target:
        settings = PredictionSettings(
            host="127.0.0.1", port=0, metrics_port=0, inference_target=inference_target,
            crm_url=f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}",
            ledger_url=f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}", model_repository=model_repository,
            config_dir=CONFIG_DIR, tls_cert_file=certs["server_cert"], tls_key_file=certs["server_key"],
            inference_tls_ca_file=certs["ca"], inference_tls_cert_file=certs["client_cert"],
            inference_tls_key_file=certs["client_key"])
        server, port, health, predictor = await start_prediction(settings)
        try:
            target = f"127.0.0.1:{port}"
            async with open_channel(target, [], channel_credentials(certs["ca"])) as channel:
                health_stub = health_pb2_grpc.HealthStub(channel)
                health_reply = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                record = credit_holdout.records[0]
                reply = await pb_grpc.PredictionServiceStub(channel).Predict(pb.PredictRequest(
                    request_id="tls-1", entity_id="applicant-tls-1", model_name="credit-risk",
                    attributes=to_attributes(record)), timeout=10)
            assert health_reply.status == health_pb2.HealthCheckResponse.SERVING
            assert 0.0 <= reply.probability <= 1.0 and reply.decision_label
            async with grpc.aio.insecure_channel(target) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE

            def public_clients():  # mlpair.client with the same credentials: TLS, and mTLS to InferenceService
                tls = channel_credentials(certs["ca"])
                with PredictionClient(target, credentials=tls) as client:
                    again = client.predict("credit-risk", "applicant-tls-1", record, request_id="tls-1")
                mtls = channel_credentials(certs["ca"], certs["client_cert"], certs["client_key"])
                logits, _ = infer_logits(inference_target, "credit-risk", "", feature_version, holdout_x[:3],
                                         credentials=mtls)
                return again, check_health(target, credentials=tls), logits

            again, status, logits = await asyncio.to_thread(public_clients)
            assert again.replayed and again.decision_id == reply.decision_id and status == "SERVING"
            assert logits.shape == (3, 2)
        finally:
            await stop(server, health, predictor, 0)


@pytest.mark.parametrize("settings_cls, fields", [
    (InferenceSettings, {"tls_cert_file": "cert.pem"}),
    (InferenceSettings, {"tls_client_ca_file": "ca.pem"}),
    (PredictionSettings, {"tls_key_file": "key.pem"}),
    (PredictionSettings, {"inference_tls_cert_file": "c.pem", "inference_tls_key_file": "k.pem"}),
])
def test_incomplete_tls_settings_are_refused(settings_cls, fields):
    with pytest.raises(ValueError, match="tls"):
        settings_cls(**fields)


async def test_with_caller_source_tls_the_caller_is_the_client_certificate_and_headers_claim_nothing(
        model_repository, credit_holdout, certs, tmp_path, inference_server):
    """Mutual TLS on PredictionService's port with PREDICTION_CALLER_SOURCE=tls: the decision records
    the verified client certificate's subject, whatever x-caller-id or x-forwarded-client-cert the
    client sends."""
    from mlpair.prediction.server import stop
    from tests.support import start_prediction

    settings = PredictionSettings(
        host="127.0.0.1", port=0, metrics_port=0, inference_target=inference_server,
        crm_url=f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}",
        ledger_url=f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}", model_repository=model_repository,
        config_dir=CONFIG_DIR, tls_cert_file=certs["server_cert"], tls_key_file=certs["server_key"],
        tls_client_ca_file=certs["ca"], caller_source="tls")
    server, port, health, predictor = await start_prediction(settings)
    try:
        with_cert = channel_credentials(certs["ca"], certs["client_cert"], certs["client_key"])
        async with open_channel(f"127.0.0.1:{port}", [], with_cert) as channel:
            spoofed = (("x-caller-id", "someone-else"),
                       ("x-forwarded-client-cert", "URI=spiffe://cluster.local/ns/bank/sa/admin"))
            reply = await pb_grpc.PredictionServiceStub(channel).Predict(pb.PredictRequest(
                request_id="tls-caller-1", entity_id="e-1", attributes=to_attributes(credit_holdout.records[0])),
                timeout=10, metadata=spoofed)
        recorded = await predictor.recorder.ledger.find("tls-caller-1")
        assert reply.decision_label and recorded.decision.caller == "CN=prediction-service"
    finally:
        await stop(server, health, predictor, 0)
