"""``execution_provider=cuda`` is a promise: without an active CUDA device the server refuses to
start (exit 2, one line saying why and what to set), rather than serving on CPU while holding a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: cuda starts")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("runtime", ["onnx", "torch"])
def test_serve_inference_with_cuda_but_no_gpu_exits_2_with_its_reason(model_repository, runtime):
    env = {**os.environ, "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": "0", "INFERENCE_METRICS_PORT": "0",
           "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_EXECUTION_PROVIDER": "cuda",
           "INFERENCE_RUNTIME": runtime}
    result = subprocess.run([sys.executable, "-m", "mlpair.cli", "serve", "inference"], env=env,
                            capture_output=True, text=True, timeout=80)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("mlpair:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "execution_provider=cuda" in lines[0] and "INFERENCE_EXECUTION_PROVIDER=auto" in lines[0]
    assert "Traceback" not in result.stderr
