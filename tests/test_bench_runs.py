"""The CPU benchmarks run on this release: ``bench/batch_cpu.py`` (what ``bench/ab_lockstep.py``
drives on both sides of an A/B) builds PredictionService through its composition root with a fake
InferenceService and servicer context, so a change of what the pipeline passes them (a priority, a
caller's metadata) breaks the benchmark, not the suite, unless something runs it. This does, a
few calls of each RPC, with the per-stage breakdown (which names the functions it times); it
asserts that it ran and answered, never a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("rpc", ["batch", "predict", "columns"])
def test_the_cpu_bench_runs_each_rpc_on_this_release(rpc, model_repository):
    items = "1" if rpc == "predict" else "20"
    done = subprocess.run(
        [sys.executable, "bench/batch_cpu.py", "--model-repository", str(model_repository), "--rpc", rpc,
         "--batch-items", items, "--calls", "3", "--repeats", "1", "--warmup-calls", "1", "--sqlite",
         "--stages"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["rpc"] == rpc and figures["ledger"].startswith("sqlite")
    assert figures["cpu_us_per_row_median"] > 0 and figures["infer_calls"] >= 1
    assert figures["stages_us_per_row"]["us_per_row"]["ledger commit"] > 0
