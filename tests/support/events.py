"""A NATS server with JetStream of the test's own, for the decision-event tests.

:func:`start_nats` runs ``nats-server -js`` on a free local port with its store under the test's
``tmp_path`` (never the system server on 4222); :meth:`NatsServer.stop` ends it by PID and
:meth:`NatsServer.restart` brings it back on the same port and store, as a broker restart does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlpair.local_pair import stop_service
from tests.support.pair import free_port, reachable

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


def require_nats_server() -> str:
    """The nats-server binary; skips the calling test when there is none (fails it under CI=true)."""
    import pytest

    if os.access(NATS_SERVER, os.X_OK):
        return NATS_SERVER
    message = f"nats-server is not installed (looked on PATH and at {NATS_SERVER})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}; CI must run the decision-event tests against a real broker")
    pytest.skip(f"{message}; install it to run the decision-event tests")


@dataclass
class NatsServer:
    """One ``nats-server -js`` process: its port, JetStream store folder and log file."""

    binary: str
    port: int
    store: Path
    log: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Starts the server and waits until its port accepts connections."""
        command = [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not reachable("127.0.0.1", self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nats-server did not start on port {self.port}: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM by PID and wait for the exit (SIGKILL after ``grace_s``); a no-op when stopped."""
        process, self.process = self.process, None
        if process is not None:
            stop_service(process, grace_s)

    def restart(self) -> None:
        """Stops the server and starts it again on the same port and store."""
        self.stop()
        self.start()


def start_nats(tmp_path: Path) -> NatsServer:
    """A started :class:`NatsServer` with its store in ``tmp_path/js`` (skips the test without nats-server)."""
    server = NatsServer(require_nats_server(), free_port(), tmp_path / "js", tmp_path / "nats-server.log")
    server.start()
    return server
