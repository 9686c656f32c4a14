"""The README's "Call it" section as a newcomer uses it: the Python client and the BatchPredict example
copied verbatim, the ``buf curl`` call run as written, the grpcurl payload, ``mlpair predict``, the
statuses a caller can get (collected from the code), and the attribute table generated from the
trained models."""

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
    snippet = code_block("python", 'request_id="readme-1"')
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
    from tests.support.pair import free_port

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


# -- C67: the README starts with what mlpair is and says what callers will see ---------------------------------

CALLS = ("buf curl", "grpcurl", "mlpair predict --family", "client.predict(", "client.batch_predict(")


def callers_section() -> str:
    """The README's "Call it" section, up to the next top-level section."""
    return README.split("\n## Call it\n", 1)[1].split("\n## ", 1)[0]


def caller_errors() -> list[type]:
    """Every error class a PredictionService caller can be answered with, collected from the code:
    PredictionService's own and those the shared server layer raises before a method runs (a
    malformed message, unknown fields, conflicting metadata, the drain)."""
    import inspect

    import mlpair.rpc.drain
    import mlpair.rpc.status
    import mlpair.wire
    from mlpair.errors import ServiceError
    from mlpair.prediction import errors
    from mlpair.prediction.feedback import items

    modules = (errors, items, mlpair.rpc.status, mlpair.wire, mlpair.rpc.drain)
    return [c for m in modules for c in vars(m).values()
            if inspect.isclass(c) and issubclass(c, ServiceError) and c.__module__ == m.__name__]


def test_c67_the_readme_says_what_mlpair_is_and_its_two_commands_before_any_call():
    title, rest = README.split("\n", 1)
    assert title == "# mlpair"
    opening = rest.split("```", 1)[0]
    assert opening.strip().startswith("mlpair "), "the first words say what mlpair is, before any code block"
    for words in ("PredictionService", "InferenceService", "decision", "reason codes"):
        assert words in opening, words
    first_call = min(README.index(c) for c in CALLS if c in README)
    assert README.index("make demo") < first_call and README.index("make test") < first_call
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert first_block.startswith("make demo") and "make test" in first_block


def test_c67_every_status_and_reason_a_caller_can_get_is_in_the_callers_section():
    from mlpair.prediction.errors import CallerLeft, InferenceUnavailable

    section = callers_section()
    errors = caller_errors()
    assert len(errors) >= 15, errors
    # Inference being down, slow or behind an open circuit is never an error for the caller: the
    # decision is the fallback, with that reason as its degraded_reason (the proto's contract).
    degraded = [c for c in errors if issubclass(c, InferenceUnavailable)]
    assert {c.reason for c in degraded} == {"INFERENCE_UNAVAILABLE", "INFERENCE_TIMEOUT", "CIRCUIT_OPEN"}
    for error in degraded:
        assert f"`{error.reason}`" in section, error.reason
    told = [c for c in errors if c not in degraded and c is not CallerLeft]  # CallerLeft: the caller has gone
    rows = [line for line in section.splitlines() if line.startswith("| ") and line.split(" | ")[0][2:].isupper()]
    for error in told:
        assert any(row.startswith(f"| {error.code} |") and f"`{error.reason}`" in row for row in rows), (
            f"{error.__name__}: {error.code} {error.reason} is not in the README's table of statuses")
    # The statuses gRPC itself gives, without an ErrorInfo.
    for code in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"):
        assert any(row.startswith(f"| {code} | none |") for row in rows), code
    # And the signals in a decision that are not errors.
    for signal in ("fallback = true", "stale = true", "replayed = true", "`UNKNOWN_ATTRIBUTE`",
                   "`EXPLANATION_NOT_RECORDED`", "`<FEATURE>_REQUIRED_MISSING`", "`MODEL_OUTPUT_INVALID`",
                   "did you mean"):
        assert signal in section, signal


def test_c67_the_callers_section_shows_the_batch_types():
    import dataclasses

    from mlpair.client import BatchItem, ItemError

    section = callers_section()
    for message in pb.BatchPredictRequest, pb.BatchPredictResponse, pb.BatchPredictResult:
        assert f"`{message.DESCRIPTOR.name}`" in section, message.DESCRIPTOR.name
        for field in message.DESCRIPTOR.fields:
            assert f"`{field.name}`" in section, (message.DESCRIPTOR.name, field.name)
    for cls in BatchItem, ItemError:
        assert f"`{cls.__name__}`" in section
        for field in dataclasses.fields(cls):
            assert f"`{field.name}`" in section, (cls.__name__, field.name)
    assert "request_id appears more than once in this batch" in " ".join(section.split())


def test_c67_the_first_call_from_a_shell_is_buf_curl_and_every_example_sends_a_complete_applicant():
    from mlpair.contracts.schema import FeatureSchema

    names = set(FeatureSchema.from_toml(CONFIG_DIR / "credit-risk" / "feature-schema.toml").attribute_names)
    shell = [b for b in re.findall(r"```bash\n(.*?)```", README, re.S) if any(c in b for c in CALLS)]
    first = next(line for line in shell[0].splitlines() if any(c in line for c in CALLS))
    assert "buf curl" in first and shell[0].startswith("make tools\n"), "the first call uses what `make tools` installs"
    payloads = []
    for block in shell:
        words = shlex.split(block.replace("\\\n", " "))
        payloads += [words[i + 1] for i, w in enumerate(words) if w == "-d"]
        if "mlpair predict --family" in block:
            assert {words[i + 1].split("=")[0] for i, w in enumerate(words) if w == "--attr"} == names
    assert len(payloads) == 2  # buf curl and grpcurl
    for payload in payloads:
        request = json_format.Parse(payload, pb.PredictRequest())
        assert request.model_name == "credit-risk" and set(request.attributes) == names
    assert README.index("buf curl") < README.index("grpcurl")
    for block in re.findall(r"```python\n(.*?)```", README, re.S):
        if "applicant = {" in block:
            assert set(eval(re.search(r"applicant = (\{.*?\})\n", block, re.S).group(1))) == names


async def test_c67_the_readme_buf_curl_call_gets_a_decision(prediction_target):
    import os
    import subprocess

    buf = REPO_ROOT / ".tools" / "node_modules" / ".bin" / "buf"
    if not buf.exists():
        if os.environ.get("CI") == "true":
            pytest.fail("buf is missing; `make tools` installs it with npm")
        pytest.skip("buf is not installed; run `make tools`")
    block = code_block("bash", "buf curl")
    words = shlex.split(block.replace("\\\n", " ").split("make tools\n", 1)[1])
    assert words[0] == ".tools/node_modules/.bin/buf" and words[-1].startswith(f"http://{DEFAULT_TARGET}/")
    words[-1] = words[-1].replace(DEFAULT_TARGET, prediction_target)
    out = await asyncio.to_thread(subprocess.run, words, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    reply = json_format.Parse(out.stdout, pb.PredictResponse())
    assert reply.decision_label in {"APPROVE", "REVIEW", "DECLINE"} and not reply.fallback
    assert not [code for code in reply.reason_codes if "MISSING" in code], "a complete applicant: nothing defaulted"


async def test_c67_the_readme_batch_example_runs_verbatim_and_prints_what_it_says(prediction_target, monkeypatch,
                                                                                 capsys):
    snippet = code_block("python", "client.batch_predict(")
    real = grpc.insecure_channel
    monkeypatch.setattr(grpc, "insecure_channel", lambda target, *a, **k: real(prediction_target, *a, **k))
    await asyncio.to_thread(exec, compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    said = [line[2:] for line in snippet.splitlines() if line.startswith("# ")]
    assert len(printed) == len(said) == 4
    assert re.fullmatch(r"(APPROVE|REVIEW|DECLINE) \['(LOW|ELEVATED|HIGH)_DEFAULT_RISK'\]", printed[0]), printed[0]
    assert printed[0] == said[0], "the README shows what the trained model decides for its applicant"
    assert printed[1:] == said[1:]
