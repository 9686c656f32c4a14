"""Fixtures for InferenceService tests; those shared with the end-to-end tests (real holdout
features, the version contract) live in tests/conftest.py.

``server``, ``channel`` and ``stub``: one InferenceService on the trained repository (batching on:
64 rows, 2 ms) per test module, a channel to it and an OIP stub on that channel. A module that
defines a fixture of the same name uses its own.
"""

from __future__ import annotations

import pytest

from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from tests.inference.helpers import channel_to, make_settings, running


@pytest.fixture(scope="module")
async def server(model_repository):
    async with running(make_settings(model_repository, max_batch_size=64, max_queue_delay_ms=2)) as srv:
        yield srv


@pytest.fixture(scope="module")
async def channel(server):
    async with channel_to(server) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return oip_grpc.GRPCInferenceServiceStub(channel)
