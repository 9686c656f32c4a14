"""``bench/gpu_check.py`` keeps working between the sessions that have a GPU to run it on.

The script is a proof for a GPU machine, never part of the suite's claims: here it runs its
``prepare`` step for real and its ``run`` step on the CPU (``--allow-cpu``, the CUDA-only options
ignored by the runtime, as logged), with a narrow heavy variant and no service phase, so that a
GPU session spends its time measuring rather than fixing the script.
"""

from __future__ import annotations

import json

import pytest

from bench import gpu_check

torch = pytest.importorskip("torch")


def test_gpu_check_prepares_a_bundle_and_runs_its_steps_on_cpu(model_repository, tmp_path, capsys):
    bundle = tmp_path / "bundle"
    assert gpu_check.main(["prepare", "--model-repository", str(model_repository), "--bundle", str(bundle),
                           "--rows", "64"]) == 0
    meta = json.loads((bundle / "bundle.json").read_text())
    assert meta["rows"] == 64 and meta["n_features"] > 0 and meta["hidden"]
    report_path = tmp_path / "report.json"
    try:
        code = gpu_check.main(["run", "--bundle", str(bundle), "--json", str(report_path), "--allow-cpu",
                               "--seconds", "0.05", "--heavy-width", "32", "--phases", "in_process,determinism"])
    finally:
        torch.use_deterministic_algorithms(False)  # process-wide switch; leave the rest of the suite as it was
    report = json.loads(report_path.read_text())
    assert code == 0, report["errors"]
    assert set(report["models"]) == {gpu_check.MODEL, gpu_check.HEAVY}
    for model in report["models"].values():
        fp32 = model["in_process"]["fp32"]
        assert fp32["parity_ok"] and fp32["max_abs_diff_vs_cpu"] <= 1e-4  # the rebuilt program matches ONNX Runtime
        assert {b: v["calls"] > 0 for b, v in fp32["batches"].items()} == {"1": True, "32": True, "128": True}
        assert model["determinism"]["identical_across_batch_sizes"] and model["determinism"]["identical_across_runs"]
    assert "| credit-risk | fp32 | in process |" in capsys.readouterr().out
