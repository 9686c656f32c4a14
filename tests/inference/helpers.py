"""Helpers for InferenceService tests: settings, repository copies, servers on port 0."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import grpc
import pytest

from mlpair.inference.settings import InferenceSettings

MODEL = "credit-risk"
VERSION_HEADER = "x-feature-version"


def make_settings(root: Path, **overrides) -> InferenceSettings:
    """Settings for a test server on a free loopback port, without a metrics port."""
    base = dict(host="127.0.0.1", port=0, metrics_port=0, model_repository=root)
    return InferenceSettings(**{**base, **overrides})


def copy_version(source: Path, root: Path, version: str, model: str = MODEL) -> Path:
    """Copies a repository entry to ``root/model/version``, rewriting its version (same weights)."""
    target = root / model / version
    shutil.copytree(source, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["versions"]["model_version"] = version
    manifest["model_name"] = model
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


@contextlib.asynccontextmanager
async def running(settings: InferenceSettings, runtime_factory=None, *, load: bool = True):
    """A started InferenceServer (loaded unless ``load=False``), stopped on exit."""
    from mlpair.inference.server import InferenceServer

    kwargs = {"runtime_factory": runtime_factory} if runtime_factory else {}
    server = InferenceServer(settings, **kwargs)
    await server.start()
    try:
        if load:
            await server.load()
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def channel_to(server, **options):
    opts = [(f"grpc.{k}", v) for k, v in options.items()]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=opts) as channel:
        yield channel


async def expect_error(call, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await call
    assert excinfo.value.code() == code, excinfo.value.details()
    return excinfo.value


class GatedRuntime:
    """The real runtime behind a gate: while closed, the executing batch waits, so later rows stay
    queued in the batcher (for cancellation, timeout and backpressure tests). Use with
    ``inline_execution_max_ms=0`` so batches run in the executor, not on the event loop."""

    def __init__(self, inner) -> None:
        import threading

        self.inner = inner
        self.description, self.platform = inner.description, inner.platform
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a batch reaches the closed gate

    def close(self) -> None:
        self.entered.clear()
        self.gate.clear()

    def run(self, x):
        if not self.gate.is_set():
            self.entered.set()
            self.gate.wait(30)
        return self.inner.run(x)

    def device_memory_bytes(self):
        return None


def gated(made: list):
    """A runtime factory making :class:`GatedRuntime` s (appended to ``made``)."""
    from mlpair.inference.runtimes import create_runtime

    def factory(entry, settings):
        runtime = GatedRuntime(create_runtime(entry, settings))
        made.append(runtime)
        return runtime
    return factory


async def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Polls ``predicate()`` on the event loop until true; fails the test after ``timeout_s``."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
