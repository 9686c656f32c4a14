"""The README's "Call it" section as a newcomer uses it: the Python client copied verbatim, the
grpcurl payload, ``mlpair predict``, and the attribute table generated from the trained models."""

from __future__ import annotations

import asyncio
import re
import shlex

import grpc
import pytest
from google.protobuf import json_format

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.attributes import attribute_rows, markdown, readme_section
from mlpair.cli import main as cli_main
from mlpair.client import AsyncPredictionClient
from tests.e2e.conftest import prediction_server
from tests.support import CONFIG_DIR, REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
DEFAULT_TARGET = "127.0.0.1:9001"  # PredictionSettings.port, the README's address


def code_block(language: str, containing: str) -> str:
    """The one fenced ``language`` block of the README that contains ``containing``."""
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", README, re.S) if containing in b]
    assert len(blocks) == 1, f"expected one {language} block with {containing!r}, found {len(blocks)}"
    return blocks[0]


@pytest.fixture
async def prediction_target(inference_server, model_repository, tmp_path):
    """A PredictionService of both families in front of the session's InferenceService (freshly trained models)."""
    async with prediction_server(inference_server, model_repository, tmp_path) as (target, _):
        yield target


async def test_the_readme_python_client_runs_verbatim_and_gets_a_decision(prediction_target, monkeypatch, capsys):
    snippet = code_block("python", "PredictionClient")
    real = grpc.insecure_channel
    asked = []

    def to_the_test_service(target, *args, **kwargs):  # the README's address is the default port
        asked.append(target)
        return real(prediction_target, *args, **kwargs)

    monkeypatch.setattr(grpc, "insecure_channel", to_the_test_service)
    await asyncio.to_thread(exec, compile(snippet, "README.md", "exec"), {})
    assert asked == [DEFAULT_TARGET]
    label, reasons, probability = re.fullmatch(r"(\w+) (\[.*\]) P\(bad\) = (\d\.\d{3})\n", capsys.readouterr().out).groups()
    assert label in {"APPROVE", "REVIEW", "DECLINE"}
    # The snippet's request id again: the service returns the decision it recorded, as printed.
    request_id, entity_id = (re.search(rf'{key}="([^"]+)"', snippet).group(1) for key in ("request_id", "entity_id"))
    attributes = eval(re.search(r"applicant = (\{.*?\})\n", snippet, re.S).group(1))
    async with AsyncPredictionClient(prediction_target) as client:
        again = await client.predict("credit-risk", entity_id, attributes, request_id)
    assert again.replayed and (again.decision_label, list(again.reason_codes)) == (label, eval(reasons))
    assert f"{again.probability:.3f}" == probability


def test_the_readme_grpcurl_payload_is_a_predict_request():
    line = code_block("bash", "grpcurl")
    payload = shlex.split(line.replace("\\\n", " "))
    request = json_format.Parse(payload[payload.index("-d") + 1], pb.PredictRequest())
    assert request.model_name == "credit-risk" and request.request_id and request.attributes["Income"].number_value > 0
    assert payload[-1] == "mlpair.prediction.v1.PredictionService/Predict" and payload[-2] == DEFAULT_TARGET
    proto = payload[payload.index("-proto") + 1]
    assert (REPO_ROOT / "protos" / proto).is_file()


async def test_mlpair_predict_prints_decision_reasons_and_probability(prediction_target, capsys):
    lines = code_block("bash", "mlpair predict --family").replace("\\\n", " ").splitlines()
    command = shlex.split(next(line for line in lines if "mlpair predict" in line))
    args = command[command.index("predict"):] + ["--target", prediction_target]
    assert await asyncio.to_thread(cli_main, args) == 0
    out = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines() if " " in line)
    assert out["decision"] in {"APPROVE", "REVIEW", "DECLINE"}
    assert 0.0 <= float(out["probability"]) <= 1.0
    assert out["reasons"].split(", ")[0] in {"LOW_DEFAULT_RISK", "ELEVATED_DEFAULT_RISK", "HIGH_DEFAULT_RISK"}
    assert "MISSING" not in out["reasons"], "the example sends a complete applicant: nothing defaulted"
    assert out["explanation"], "--explain prints the top reasons in business language"


async def test_mlpair_predict_refusals_are_one_line(prediction_target, capsys):
    refused = ["predict", "--target", prediction_target, "--family", "credit-risk", "--entity-id", "a-1",
               "--attr", "Income=lots"]
    assert await asyncio.to_thread(cli_main, refused) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlpair predict: {prediction_target}: INVALID_ARGUMENT: ") and "Income" in err
    assert "\n" not in err
    assert cli_main(["predict", "--family", "credit-risk", "--entity-id", "a-1", "--attr", "Income"]) == 2
    assert capsys.readouterr().err.strip() == "mlpair: predict: --attr 'Income': expected NAME=VALUE (e.g. Income=1290)"
    # an attribute given twice is refused, not silently the last one
    assert cli_main(["predict", "--family", "credit-risk", "--entity-id", "a-1", "--attr", "Income=abc",
                     "--attr", "Income=12"]) == 2
    assert capsys.readouterr().err.strip() == "mlpair: predict: --attr Income is given twice: give each attribute once"


def test_mlpair_predict_with_no_service_there_says_how_to_check(capsys):
    from bench.pair import free_port

    target = f"127.0.0.1:{free_port()}"
    args = ["predict", "--target", target, "--family", "credit-risk", "--entity-id", "a-1", "--attr", "Income=1"]
    assert cli_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlpair predict: {target}: UNAVAILABLE: ") and "\n" not in err
    assert err.endswith(f"(is PredictionService up and ready there? `mlpair health --target {target}`)")


def test_the_readme_attribute_table_is_the_generated_one(model_repository):
    generated = markdown(attribute_rows(CONFIG_DIR, model_repository))
    assert readme_section(README) == generated, "run `mlpair attributes --markdown` and paste it into README.md"
    assert "`rent`" in generated and "`month-to-month`" in generated, "categories come from the trained vocabularies"
    rows = [line for line in generated.splitlines() if line.startswith("| `")]
    assert len(rows) == len(attribute_rows(CONFIG_DIR, model_repository))


@pytest.mark.parametrize(("reply", "present", "absent"), [
    # a fallback: no model answered, so no model version, and nothing came from the cache
    (pb.PredictResponse(decision_label="REVIEW", fallback=True, degraded_reason="INFERENCE_UNAVAILABLE",
                        feature_schema_version="fs-1", policy_version="p-1"),
     ["model         none (fallback), feature schema fs-1, policy p-1", "degraded      INFERENCE_UNAVAILABLE"],
     ["version ,", "cached", "calibration"]),
    # a replay: the proto leaves calibration_method unset
    (pb.PredictResponse(decision_label="APPROVE", model_version="1", replayed=True, feature_schema_version="fs-1",
                        policy_version="p-1"),
     ["model         version 1, feature schema fs-1, policy p-1", ", replayed)"], ["calibration", "degraded"]),
    # a stale cached answer
    (pb.PredictResponse(decision_label="APPROVE", model_version="1", stale=True, cache_age_ms=1200,
                        degraded_reason="INFERENCE_UNAVAILABLE", calibration_method="temperature"),
     ["calibration temperature", "degraded      INFERENCE_UNAVAILABLE (served from the cache, 1200 ms old)"], []),
])
def test_mlpair_predict_prints_no_empty_field(reply, present, absent):
    from mlpair.commands.calls import render

    text = render(reply)
    for line in present:
        assert line in text, text
    for fragment in absent:
        assert fragment not in text, text
