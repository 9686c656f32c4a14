"""Every call of NVIDIA's tritonclient gRPC client against InferenceService: each one works or
gets the refusal services/inference/README.md documents (UNIMPLEMENTED for RPCs this server does
not implement, INVALID_ARGUMENT for parameters). tritonclient runs in a subprocess
(``triton_client_check.py``): it registers the same protobuf names as ``mlpair.api.oip``."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from tests.inference.helpers import MODEL, gated, make_settings, running, wait_for

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).with_name("triton_client_check.py")
UNIMPLEMENTED = "StatusCode.UNIMPLEMENTED"
INVALID = "StatusCode.INVALID_ARGUMENT"


async def client_process(mode: str, port: int, feature_version: str, rows: Path) -> asyncio.subprocess.Process:
    # Asynchronously: the server runs on this event loop and must keep answering.
    return await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), mode, f"127.0.0.1:{port}", MODEL, feature_version, str(rows),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


@pytest.fixture
def rows_file(holdout_x, tmp_path) -> Path:
    np.save(tmp_path / "rows.npy", holdout_x[:20])
    return tmp_path / "rows.npy"


async def test_every_tritonclient_call_works_or_gets_the_documented_refusal(model_repository, rows_file,
                                                                             feature_version, credit_entry):
    settings = make_settings(model_repository, models=[MODEL], max_batch_size=32, max_queue_delay_ms=2)
    async with running(settings) as srv:
        process = await client_process("--every-call", srv.port, feature_version, rows_file)
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=90)
        assert process.returncode == 0, stderr.decode()[-3000:]
        stats = srv.engine.model(MODEL).batcher.statistics
    report = json.loads(stdout)
    assert sorted(report["extensions"]) == ["model_configuration", "parameters", "statistics"]

    config = report["config"]["ok"]
    assert (config["name"], config["platform"], config["max_batch_size"]) == (MODEL, "onnxruntime_onnx", 32)
    assert config["input"][0]["dims"] == [str(credit_entry.manifest.n_features)]  # int64 as JSON strings
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "2000"
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert report["index"]["ok"]["models"][0]["state"] == "READY"
    assert report["async_infer"] == {"id": "async-1", "shape": [3, 2]}

    s1, s2, s3, s4 = report["stream"]
    assert s1 == {"id": "s1", "shape": [1, 2]} and s3 == {"id": "s3", "shape": [2, 2]}
    assert "NaN or Inf at row 0 column 0" in s2["error"]
    assert s4 == {"id": "s4", "shape": [1, 2]}  # sent after the error arrived: the stream lived on

    (model_stats,) = report["statistics"]["ok"]
    # As the server counted (JSON carries uint64 as strings): the honoured infers ran after this.
    assert model_stats["name"] == MODEL and model_stats["version"] == "1"
    assert int(model_stats["inference_stats"]["fail"]["count"]) == 1  # the NaN request
    assert int(model_stats["inference_count"]) == 3 + 1 + 2 + 1
    assert report["statistics_all"]["ok"] == [[MODEL, "1"]]
    assert stats.inference_count == 3 + 1 + 2 + 1 + 3 * 2  # + the three honoured infers below

    refused = report["refused"]
    assert refused.pop("load_model")["status"] == "StatusCode.FAILED_PRECONDITION"
    assert refused.pop("unload_model")["status"] == "StatusCode.FAILED_PRECONDITION"
    for name in ("get_trace_settings", "update_trace_settings", "get_log_settings", "update_log_settings",
                 "get_system_shared_memory_status", "register_system_shared_memory",
                 "unregister_system_shared_memory", "get_cuda_shared_memory_status", "register_cuda_shared_memory",
                 "unregister_cuda_shared_memory"):
        assert refused.pop(name)["status"] == UNIMPLEMENTED, name
    expected = {"infer sequence_id": "sequence batching", "infer undefined priority": "priority 9 is not a defined level",
                "infer custom parameter": "unknown request parameter", "infer classification": "raw logits only",
                "infer shared-memory input": "shared memory is not implemented"}
    assert refused.keys() == expected.keys()
    for name, message in expected.items():
        assert refused[name]["status"] == INVALID and message in refused[name]["message"], name
    for name, outcome in report["honoured"].items():
        assert np.asarray(outcome["ok"]).shape == (2, 2), name


async def test_a_cancelled_tritonclient_stream_leaves_its_queued_rows_uncomputed(model_repository, rows_file,
                                                                                  feature_version):
    """One row executes behind a closed gate, three more queue; the client cancels the stream; the
    three leave the queue and are never computed (the batcher's executed rows and the metric say so)."""
    made: list = []
    settings = make_settings(model_repository, models=[MODEL], max_batch_size=32, max_queue_delay_ms=1,
                             inline_execution_max_ms=0)
    labels = {"model": MODEL, "version": "1", "reason": "cancelled"}
    cancelled_before = REGISTRY.get_sample_value("inference_queue_dropped_total", labels) or 0.0
    async with running(settings, gated(made)) as srv:
        runtime, batcher = made[0], srv.engine.model(MODEL).batcher
        runtime.close()
        process = await client_process("--cancel", srv.port, feature_version, rows_file)
        try:
            assert (await asyncio.wait_for(process.stdout.readline(), 30)).strip() == b"sent"
            await asyncio.to_thread(runtime.entered.wait, 30)  # c0 is executing, held at the gate
            process.stdin.write(b"more\n")
            assert (await asyncio.wait_for(process.stdout.readline(), 30)).strip() == b"sent"
            await wait_for(lambda: batcher.queued_rows == 3, what="c1..c3 queued")
            process.stdin.write(b"cancel\n")
            await wait_for(lambda: batcher.queued_rows == 0, what="the cancelled rows to leave the queue")
        finally:
            runtime.gate.set()
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
        assert process.returncode == 0, stderr.decode()[-3000:]
        await wait_for(lambda: batcher.statistics.execution_count == 1, what="c0's batch to end")
        await asyncio.sleep(0.2)  # time enough for anything left behind to run: nothing may
        stats = batcher.statistics
        assert (stats.execution_count, stats.executed_rows) == (1, 1)
    assert (REGISTRY.get_sample_value("inference_queue_dropped_total", labels) or 0.0) - cancelled_before == 3
    callbacks = json.loads(stdout.decode().strip().splitlines()[-1])
    assert callbacks == [{"error": "StatusCode.CANCELLED"}]  # no response after the cancel, c0's neither
