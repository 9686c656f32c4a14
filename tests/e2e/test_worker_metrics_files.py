"""C56 · one bad metrics file blinds the pod: a real supervisor with two InferenceService workers,
then an empty file and a file cut short put into its multiprocess metrics folder while it serves.
``/metrics`` still answers 200 with the workers' series, and says how many files it left out."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlpair.api.inference.v1 import inference_service_pb2 as ipb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from tests.support.e2e import OWN_CONNECTION, both_listening
from tests.support.pair import Service, free_port

MODEL = "credit-risk"
CALLS = 12


def scrape(metrics_port: int) -> tuple[int, dict[str, float]]:
    """The status of ``/metrics`` and, when 200, each sample name (with its labels) → value."""
    try:
        reply = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    samples = {}
    for family in text_string_to_metric_families(reply.read().decode()):
        for s in family.samples:
            samples[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return reply.status, samples


def ok_calls(samples: dict[str, float]) -> float:
    return samples.get('inference_requests_total{"code": "OK", "model": "credit-risk", "version": "1"}', 0.0)


async def infer(address: str, holdout_x, metadata, n: int) -> None:
    """``n`` single-row Infer calls, each over a connection of its own (so both workers get some)."""
    async def one(i: int) -> None:
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            x = holdout_x[i:i + 1]
            await ipb_grpc.InferenceServiceStub(channel).Infer(ipb.InferRequest(model_name=MODEL, inputs=ipb.Tensor(
                data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes())), metadata=metadata, timeout=20)

    await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.timeout(120)
def test_c56_an_unreadable_metrics_file_is_left_out_and_counted(model_repository, holdout_x, good_metadata,
                                                                tmp_path: Path) -> None:
    port, metrics_port, temp = free_port(), free_port(), tmp_path / "tmp"
    temp.mkdir()
    env = {"INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": str(metrics_port),
           "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_MODELS": json.dumps([MODEL]),
           "INFERENCE_WORKERS": "2", "INFERENCE_LOG_LEVEL": "WARNING", "TMPDIR": str(temp)}
    service = Service("inference", env, port, tmp_path / "inference.log")
    service.start(ready_timeout_s=90)
    try:
        workers = both_listening(service.pid, port)
        (folder,) = temp.glob("mlpair-inference-metrics-*")
        asyncio.run(infer(service.address, holdout_x, good_metadata, CALLS))
        files_at_start = sorted(p.name for p in folder.glob("*.db"))
        before = scrape(metrics_port)
        # a file cut short in the middle of its entries, and an empty one, as a worker killed while
        # extending its file would leave them (named as files of processes that are not running)
        histogram = next(p for p in folder.glob("histogram_*.db") if int(p.stem.split("_")[-1]) in workers)
        whole = histogram.read_bytes()
        used = int.from_bytes(whole[:4], "little")
        (folder / "histogram_4194301.db").write_bytes(whole[:used // 2])
        (folder / "counter_4194302.db").write_bytes(b"")
        after = scrape(metrics_port)
        asyncio.run(infer(service.address, holdout_x, good_metadata, CALLS))  # the workers keep serving
        later = scrape(metrics_port)
        log = service.log_tail(50)
    finally:
        service.kill()
    # every file of the fresh folder is one of this supervisor's workers'
    assert {int(name.rsplit("_", 1)[1][:-3]) for name in files_at_start} == set(workers), files_at_start
    assert (before[0], after[0], later[0]) == (200, 200, 200), "one bad file must not fail the scrape"
    assert ok_calls(before[1]) == CALLS
    assert before[1]["inference_metrics_files_unreadable{}"] == 0
    assert ok_calls(after[1]) == CALLS  # the workers' series, whole
    assert after[1]["inference_metrics_files_unreadable{}"] == 2
    assert ok_calls(later[1]) == 2 * CALLS
    assert later[1]["inference_metrics_files_unreadable{}"] == 2
    assert "histogram_4194301.db cannot be read" in log and "counter_4194302.db cannot be read" in log, log
