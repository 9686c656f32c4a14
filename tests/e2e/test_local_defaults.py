"""C65: safe local defaults. A service started with its defaults listens on loopback only: reachable
on 127.0.0.1, not on this machine's other addresses. (The images and manifests set the pod address
explicitly: tests/deploy/test_deploy_hosts.py.)"""

from __future__ import annotations

import re
import socket
import subprocess
import urllib.request

import pytest

from mlpair.local_pair import free_port, start_service, wait_ready
from mlpair.prediction.settings import PredictionSettings


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine outside 127.0.0.0/8: the source address of the default route
    (no packet is sent), else the first one `ip -4 addr` lists; None if it has none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: connect() on UDP only picks a route
            address = s.getsockname()[0]
            if not address.startswith("127.") and address != "0.0.0.0":
                return address
    except OSError:
        pass
    try:
        listed = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = [a for a in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", listed) if not a.startswith("127.")]
    return found[0] if found else None


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_c65_a_service_started_with_defaults_is_reachable_on_loopback_only(model_repository, tmp_path, monkeypatch):
    outside = non_loopback_address()
    if outside is None:
        pytest.skip("this machine has no IPv4 address outside 127.0.0.0/8 to try the service on")
    for name in ("INFERENCE_HOST", "PREDICTION_HOST"):
        monkeypatch.delenv(name, raising=False)  # the defaults, whatever this shell sets
    port, metrics_port, log = free_port(), free_port(), tmp_path / "inference.log"
    env = {"INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": str(metrics_port), "INFERENCE_WORKERS": "1",
           "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_TRACING": "false"}
    process = start_service("inference", env, log)
    try:
        wait_ready(f"127.0.0.1:{port}", process, log)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            assert reply.status == 200
        assert accepts("127.0.0.1", port) and accepts("127.0.0.1", metrics_port)
        assert not accepts(outside, port), f"gRPC port open on {outside}"
        assert not accepts(outside, metrics_port), f"metrics port open on {outside}"
    finally:
        process.terminate()
        process.wait(timeout=30)
    # PredictionService (and `mlpair relay`) bind the same setting's address for every port they open.
    assert PredictionSettings().host == "127.0.0.1"
