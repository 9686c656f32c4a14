"""The demo's pair of services on this machine: each ``mlpair`` service as its own process on free
local ports, waited for through ``grpc.health.v1``, stopped with SIGTERM (a clean drain)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def migrate(ledger_url: str, crm_url: str) -> subprocess.CompletedProcess[str]:
    """``mlpair migrate`` as its own process (as an operator runs it before a deploy); its output
    captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "mlpair.cli", "migrate", "--ledger-url", ledger_url, "--crm-url", crm_url],
        capture_output=True,
        text=True,
    )


def start_service(role: str, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Starts ``mlpair serve <role>`` as its own process with ``env`` added to this one's, logging to
    ``log_path``."""
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "mlpair.cli", "serve", role],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_ready(target: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    """Polls ``grpc.health.v1`` until SERVING.

    Raises:
        RuntimeError: the process exited or did not become ready in :data:`READY_TIMEOUT_S` seconds
            (the last lines of its log included).
    """
    from mlpair.client import wait_until_serving

    if wait_until_serving(target, READY_TIMEOUT_S, lambda: process.poll() is None, poll_s=0.1):
        return
    tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
    raise RuntimeError(f"service at {target} did not become ready:\n{tail}")


def stop_service(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> int:
    """SIGTERM, then wait for a clean exit (SIGKILL only past ``grace_s`` seconds). Returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
