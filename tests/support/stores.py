"""Real storage servers for the model-source tests, started on free loopback ports and stopped by PID:
moto's standalone S3 server and ``mlflow server`` (sqlite backend, local artifact root).

Where the binary is missing the test skips with the reason (under CI=true it fails).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pair import free_port

SECRET = "test-secret-key-do-not-print-0123456789"
"""The secret access key the S3 tests use: it must never show in a log line or an error."""


def _missing(what: str) -> None:
    message = f"{what} is not installed (pip install -e '.[dev]')"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}; CI must run against the real server")
    pytest.skip(message)


def _bin(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except Exception:  # noqa: BLE001
            time.sleep(0.2)
    raise RuntimeError(f"{url}: server not up within {timeout_s} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@contextlib.contextmanager
def moto_s3(log: Path, port: int = 0) -> Iterator[str]:
    """A moto S3 server (on ``port``, else a free one); yields its endpoint URL (``http://127.0.0.1:PORT``)."""
    binary = _bin("moto_server")
    if binary is None:
        _missing("moto_server (moto[server])")
    port = port or free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/moto-api/", proc, 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard AWS environment variables pointing boto3 at ``endpoint``."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """``mlflow server`` with a sqlite backend store and a local artifact root; yields its URL."""
    binary = _bin("mlflow")
    if binary is None:
        _missing("mlflow")
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    cmd = [binary, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")]
    with open(root / "server.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 90)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)
